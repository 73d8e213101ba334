"""Start-up and shutdown of the HTTP server (what `scripts/serve.py` runs).

Loads the model, compiles every bucket, starts the dispatcher, then serves. SIGTERM (or
Ctrl-C) stops taking requests (503), lets those in flight finish, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from aiohttp import web

from laps_jax.cli import add_engine_args, build_engine, setup_logging
from laps_jax.scheduler import flags as scheduler_flags
from laps_jax.server import dry_run
from laps_jax.server.loop_lag import freeze_startup_heap


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="OpenAI-compatible LLM server with length-aware prefill (LAPS). "
                    "With no arguments it serves the built-in model on http://127.0.0.1:8000.")
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="most requests in the server at once; more get 503 + Retry-After")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body in bytes (default 4 MiB); larger get 413")
    g.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds to let in-flight requests finish after SIGTERM; then those "
                        "still running are aborted (streams end with finish_reason 'abort') "
                        "and the server exits")
    g.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a request's headers, and again its "
                        "body (default 30; 0: no limit); slower connections are closed, a slow "
                        "body gets 408")
    s = ap.add_argument_group("scheduler")
    s.add_argument("--mode", choices=("laps", "laps-spatial", "mixed"), default="laps",
                   help="laps: short and long prefill pools on one device (default); "
                        "laps-spatial: each pool on its own device group; mixed: FCFS baseline")
    scheduler_flags.add_args(s, ("threshold", "order", "long_order", "finish_slack"))
    s.add_argument("--latency-profile", default=None,
                   help="profile.json from scripts/profile_latency.py (calibrates the threshold, "
                        "the waiting window and laps' long-chunk size; without it long chunks "
                        "are the full step budget); some of its shapes are timed again at start "
                        "and the model scaled to this machine's speed now")
    s.add_argument("--no-rescale-profile", action="store_true",
                   help="use --latency-profile's rates as they are")
    from laps_jax.scheduler import pd as pd_flags
    pd_flags.add_args(ap.add_argument_group("prefill/decode disaggregation"))
    add_engine_args(ap)
    dry_run.add_args(ap.add_argument_group("plan"))
    return ap


async def serve(args, log) -> int:
    from laps_jax.scheduler.dispatcher import Dispatcher
    from laps_jax.server.app import create_app
    from laps_jax.server.http_runner import make_runner
    from laps_jax.server.shutdown import shut_down
    from laps_jax.server.state import ServerState

    t0 = time.perf_counter()
    secret = None
    if args.role != "both":  # no open split: refused before minutes of compiling
        from laps_jax.server.pd_secret import resolve
        secret = resolve(args.pd_secret_file, args.api_key)
    if args.latency_profile:  # a wrong path fails now, not after minutes of compiling
        from laps_jax.scheduler.profiling import read_profile
        read_profile(args.latency_profile)
    # laps-spatial: the long pool gets its own engine, on the second device if there is one
    built = build_engine(args, log=log, engines=2 if args.mode == "laps-spatial" else 1,
                         spread=True)
    engines, long_engine = built.engines, built.long_engine
    model = None
    if args.latency_profile:
        from laps_jax.scheduler.profiling import load_profile
        log(f"latency profile {args.latency_profile}: timing some of its shapes"
            if not args.no_rescale_profile else f"latency profile {args.latency_profile}")
        model, f = load_profile(args.latency_profile, built.engine, not args.no_rescale_profile)
        if f is not None:
            log(f"latency profile rescaled: its shapes run {f:.2f}x their profiled time here")
    dispatcher = Dispatcher(built.engine, args.mode, scheduler_flags.from_args(args, args.mode),
                            long_engine=long_engine, latency_model=model)
    if dispatcher.kv_handoff:
        log("compiling and running the KV hand-off copies")
    await dispatcher.start()
    name = args.served_model_name or built.model_name
    state = ServerState(dispatcher, engines, built.tokenizer, built.engine.cfg.vocab_size,
                        built.engine.ecfg.max_model_len, (name,), args.api_key, args.max_queue)
    if args.role != "both":
        from laps_jax.scheduler.pd import from_args as pd_config
        from laps_jax.server.pd import PDServer
        if args.mode == "laps-spatial":
            raise ValueError("--role prefill/decode runs one device group: not with "
                             "--mode laps-spatial")
        log("compiling and running the KV hand-off copies")
        await dispatcher.lanes[0].executor.warmup_transfer()
        state.pd = PDServer(pd_config(args), dispatcher, secret)
        log(f"role {args.role}: KV transfer server at {state.pd.remote.address}")
    # full collections no longer walk the model (no 1 s loop stalls); before the app starts,
    # so the collection it makes first is not one of them
    freeze_startup_heap()
    app = create_app(state, args.max_request_bytes)
    runner = make_runner(app, args.read_timeout or None, access_log=None,
                         handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    url = f"http://{args.host}:{args.port}"
    log(f"serving {name} at {url}/v1 (mode {args.mode})")
    log(f"ready: {url} (start-up took {time.perf_counter() - t0:.1f} s)")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log("shutting down: finishing requests in flight")
    await shut_down(state, dispatcher, runner, args.shutdown_timeout, log)
    log("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    try:
        if args.dry_run:
            return dry_run.dry_run(args)
        return asyncio.run(serve(args, log))
    except (ValueError, OSError) as e:  # bad model path, port in use, ...
        log(f"error: {e}")
        return 2
