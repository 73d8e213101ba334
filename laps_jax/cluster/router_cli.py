"""`scripts/router.py`: start-up and shutdown of the network router (http_router.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import secrets
import signal
import sys

from aiohttp import web

from laps_jax.cluster.pace import FORGET_S, PACE_WEIGHT
from laps_jax.cluster.policy import POLICIES, RouterConfig
from laps_jax.server import pd_secret

AFFINITY_POLICIES = ("round-robin", "least-load", "length-aware")  # follow history by a rule


AUTO = "auto"


def hold_tokens(text: str) -> float | str:
    """`--hold-tokens`: AUTO (each instance's long chunk) or a number of tokens (checked in
    `make_router`, so a bad value is a ValueError there as the other flags')."""
    return AUTO if text.strip().lower() == AUTO else float(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="One OpenAI-compatible endpoint (the API of serve.py: /v1/completions, "
                    "/v1/chat/completions with streaming, /v1/models, /health, /metrics) in "
                    "front of several serve.py instances, plus GET /router/status (each "
                    "instance's group, health and load as JSON). Instances are polled every "
                    "0.5 s; one that stops answering leaves the rotation within 2 s, its "
                    "requests in flight go on at another instance (sent again if the client "
                    "had no byte yet, streams resumed from the tokens already sent), and it "
                    "rejoins when healthy again.",
        epilog="example: python scripts/router.py --instance http://127.0.0.1:8001 "
               "--instance http://127.0.0.1:8002 --tokenizer /path/to/model --port 8100")
    ap.add_argument("--instance", action="append", default=[], metavar="URL",
                    help="a serve.py instance's base URL (repeat for each instance)")
    ap.add_argument("--prefill", action="append", default=[], metavar="URL",
                    help="a serve.py --role prefill instance (repeat); with --decode, instead "
                         "of --instance: each request is prefilled on one and decoded on "
                         "the other, its K/V pulled across (cluster/pd_router.py)")
    ap.add_argument("--decode", action="append", default=[], metavar="URL",
                    help="a serve.py --role decode instance (repeat)")
    ap.add_argument("--pd-secret-file", default=None, metavar="PATH",
                    help="with --prefill/--decode: a file holding the secret the router and "
                         "the split's instances share (it opens their legs); else the "
                         "LAPS_PD_SECRET environment variable, else --instance-api-key; with "
                         "none of them the router refuses to start")
    ap.add_argument("--policy", choices=sorted(POLICIES), default="laps-inflow",
                    help="laps-inflow (default): laps, with a long request's predicted finish "
                         "on an instance stretched by the smaller long work the router sent "
                         "there in the last 5 s, which overtakes it (in seconds by the "
                         "pace measured on streamed requests; until one is measured it "
                         "takes laps-adaptive's switch instead), and a short request priced at the short "
                         "work ahead of it, no long chunk, once every instance has short "
                         "work pending, and long requests held in the router until an "
                         "instance has room (--hold-tokens auto); the best worst case on the "
                         "simulated trace family (docs/SIMULATION.md). laps-adaptive: laps, and "
                         "once every instance is three long chunks behind, the fewest requests in "
                         "flight (or the holder of most of the prompt). laps: the instance "
                         "where the request's prefill is predicted to finish first (the "
                         "history holder counts only the new tokens), with short and long "
                         "groups (new tokens after the cached prefix at or under the "
                         "threshold: short) sized by their share of the pending work, moved "
                         "with hysteresis, a dwell time and draining; prefix: cache-aware like "
                         "the SGLang gateway's cache_aware (best prefix match over half the "
                         "prompt, else least requests in flight); length-aware: the LAPS "
                         "reference router (fixed groups, one move per 5 s on a 2x pending "
                         "ratio); round-robin; least-load: least pending prefill tokens; "
                         "bucket: prompt-length ranges per instance levelled on the recent "
                         "work, like the SGLang gateway's bucket. round-robin, least-load and "
                         "length-aware send a request to the instance caching half its prompt")
    ap.add_argument("--no-affinity", action="store_true",
                    help="round-robin, least-load, length-aware: place by the policy alone, "
                         "never by where a prompt's history is cached (round-robin is then "
                         "plain data parallelism, the baseline of docs/BENCHMARKS.md; laps "
                         "weighs the history itself and prefix is cache-aware by definition, "
                         "so they refuse it)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="the instances' model (or tokenizer) directory, or 'builtin' for "
                         "serve.py's default model: text prompts and chat messages are "
                         "tokenized as serve.py does, for prefix affinity and exact new-token "
                         "counts; without it text length estimates the tokens and prefix "
                         "affinity keys on the prompt's text")
    ap.add_argument("--threshold", type=int, default=None,
                    help="new tokens at or under which a request is short (default: what the "
                         "instances report in /metrics as laps_short_threshold_tokens, from "
                         "their latency profiles; 256 until one does)")
    ap.add_argument("--long-chunk-tokens", type=int, default=None,
                    help="laps: the long chunk a short request may wait out on an instance "
                         "with long work (default: what each instance reports in /metrics as "
                         "laps_long_chunk_tokens, the chunk its scheduler runs; 512 until it "
                         "does). laps-adaptive also counts an instance far behind from 3 of "
                         "these chunks pending")
    ap.add_argument("--spill-tokens", type=float, default=2048.0,
                    help="laps, length-aware: a long request goes to the short group when an "
                         "instance there has this many fewer pending prefill tokens (default "
                         "2048; inf: never; laps scales it by short work's share)")
    ap.add_argument("--decode-step-tokens", type=float, default=0.0,
                    help="laps (experimental): a request sent to an instance where the "
                         "router's requests are decoding waits a decode step before each of "
                         "its prefill steps; count one decode step as this many prefill tokens "
                         "(-1: the threshold, the prefill a memory-bound step holds; default 0: "
                         "not counted; it showed no gain live, docs/BENCHMARKS.md)")
    ap.add_argument("--decode-seq-tokens", type=float, default=0.0,
                    help="laps (experimental): add this many prefill tokens to that decode "
                         "step per sequence of the router's decoding there, so a request "
                         "leans to the instance with the fewest decoding (default 0: not "
                         "counted; no gain live, docs/BENCHMARKS.md)")
    ap.add_argument("--pace-weight", type=float, default=PACE_WEIGHT,
                    help="laps: weigh each instance's pending work by how fast it has lately "
                         "turned work into first tokens against the others (an exponential "
                         "mean of streamed requests' TTFT per token ahead, this weight per "
                         f"sample, in (0, 1]; 0: not measured; default {PACE_WEIGHT}: "
                         "0.63-0.80x plain laps's SLO violations on three traces, "
                         "docs/BENCHMARKS.md)")
    ap.add_argument("--pace-forget-s", type=float, default=FORGET_S,
                    help="laps, with --pace-weight: seconds after which an instance's last "
                         "pace counts for 1/e of its difference from the others, so one that "
                         f"looked slow and got no work since is not shunned for good (default "
                         f"{FORGET_S:g}; 0.5 and 6 were level with it on Azure, docs/BENCHMARKS.md "
                         "0: paces are forgotten at once, as if pace were off)")
    ap.add_argument("--hold-tokens", type=hold_tokens, default=None,
                    help="late binding of long requests: hold a request of more than this "
                         "many new tokens (and over the short threshold) in the router while "
                         "every instance has this many prefill tokens or more ahead of it (its "
                         "short work and the router's smaller long requests there), and send "
                         "it, fewest tokens first (aged), to the policy's pick among the "
                         "instances with room; smaller requests, and turns whose cached "
                         "history is at least their new part, go at once. 'auto': each "
                         "instance's long chunk (laps_long_chunk_tokens, or "
                         "--long-chunk-tokens), as the simulator screened it; 0: send every "
                         "request on arrival. Default: auto with laps-inflow, 0 with the other "
                         "policies and with --prefill/--decode. Simulated H200: 0.41-0.66x the "
                         "gateway's misses with laps-inflow, 0.69-0.89x without; live on two "
                         "CPU instances 0.87x the misses of laps-inflow without it on "
                         "overloaded code completion (24 rounds), level at lighter loads and "
                         "on code-chat (docs/BENCHMARKS.md). /metrics counts the requests held "
                         "and their seconds (laps_router_held_total, "
                         "laps_router_held_seconds_total)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1/* and /router/status "
                         "(/health and /metrics stay open; default: no key)")
    ap.add_argument("--instance-api-key", default=None,
                    help="the key the instances require, sent on requests to them")
    ap.add_argument("--max-inflight", type=int, default=256,
                    help="requests in flight per instance through the router; when every "
                         "instance is at it (or unavailable) the router answers 503 with "
                         "Retry-After (default 256, serve.py's --max-queue)")
    ap.add_argument("--max-request-bytes", type=int, default=4 << 20,
                    help="largest request body in bytes (default 4 MiB); larger get 413")
    ap.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds a client may take to send a request's headers, and again its "
                         "body (default 30; 0: no limit)")
    ap.add_argument("--event-loop", choices=("asyncio", "uvloop"), default="asyncio",
                    help="the router's event loop: asyncio (default) or uvloop (needs the "
                         "uvloop package): 8%% less router CPU per streamed chat request live "
                         "on a 2-core VM, where the router shares the cores with the instances "
                         "(docs/BENCHMARKS.md)")
    return ap


def loop_factory(event_loop: str):
    """The `asyncio.Runner` loop factory of `--event-loop` (None: asyncio's own); a clear
    error when uvloop is asked for and not installed."""
    if event_loop != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        raise ValueError("--event-loop uvloop needs the uvloop package (pip install uvloop)"
                         ) from None
    return uvloop.new_event_loop


def run_on_loop(event_loop: str, make_coro):
    """`make_coro()` run to its end on `--event-loop`'s loop (router.py and serve_cluster.py);
    the loop is checked before the coroutine is made, so a missing uvloop leaves none unrun."""
    with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
        return runner.run(make_coro())


def make_router(args):
    from laps_jax.cluster.http_router import HTTPRouter
    tokenizer = None
    if args.tokenizer:
        from laps_jax.config import model_dir
        from laps_jax.text.tokenizer import Tokenizer
        tokenizer = Tokenizer(model_dir(args.tokenizer))
    if bool(args.prefill) != bool(args.decode) or bool(args.instance) == bool(args.prefill):
        raise ValueError("give --instance URL..., or --prefill URL... with --decode URL...")
    if not (args.decode_seq_tokens >= 0 and math.isfinite(args.decode_seq_tokens)):
        raise ValueError(f"--decode-seq-tokens must be a finite number >= 0, "
                         f"got {args.decode_seq_tokens}")
    if not (args.pace_weight == 0 or 0 < args.pace_weight <= 1):
        raise ValueError(f"--pace-weight must be 0 (off) or in (0, 1], got {args.pace_weight}")
    if not (args.pace_forget_s >= 0 and math.isfinite(args.pace_forget_s)):
        raise ValueError(f"--pace-forget-s must be a finite number >= 0, got {args.pace_forget_s}")
    hold = args.hold_tokens  # not given: laps-inflow's long requests bound late, by AUTO
    if hold is None:
        hold = AUTO if args.policy == "laps-inflow" and not args.prefill else 0.0
    if hold != AUTO and not (hold >= 0 and math.isfinite(hold)):
        raise ValueError(f"--hold-tokens must be 'auto' or a finite number >= 0, got {hold}")
    if hold != 0 and args.prefill:
        raise ValueError("--hold-tokens applies to --instance routing, not --prefill/--decode")
    if args.long_chunk_tokens is not None and args.long_chunk_tokens < 1:
        raise ValueError(f"--long-chunk-tokens must be >= 1, got {args.long_chunk_tokens}")
    if args.no_affinity and args.policy not in AFFINITY_POLICIES:
        raise ValueError(f"--no-affinity applies to {', '.join(AFFINITY_POLICIES)}, "
                         f"not --policy {args.policy}")
    secret = None
    if args.prefill:  # refused now, before anything starts, when the split has no secret
        secret = pd_secret.resolve(args.pd_secret_file, args.instance_api_key)
    config = RouterConfig(policy=args.policy)
    if args.no_affinity:
        config.affinity_ratio = None
    router = HTTPRouter(args.instance or args.prefill + args.decode, config,
                        tokenizer=tokenizer, threshold=args.threshold,
                        spill_tokens=args.spill_tokens, max_inflight=args.max_inflight,
                        decode_step_tokens=(None if args.decode_step_tokens < 0
                                            else args.decode_step_tokens),
                        decode_seq_tokens=args.decode_seq_tokens,
                        instance_api_key=args.instance_api_key,
                        long_chunk_tokens=args.long_chunk_tokens,
                        pace_weight=args.pace_weight, pace_forget_s=args.pace_forget_s,
                        hold_tokens=None if hold == AUTO else hold)
    if args.prefill:
        from laps_jax.cluster.pd_router import PDSplit
        router.split = PDSplit(router, len(args.prefill), secret)
    return router


def share_pd_secret(serve_args: list[str], address: str | None, log) -> None:
    """A split's legs need a secret the router and the instances share (server/pd_secret.py):
    without LAPS_PD_SECRET, --pd-secret-file or --api-key one is made for this deployment and
    handed over in the environment (a command line is visible to every user: `ps`), which
    the instances of a Ray cluster this launcher starts inherit. A cluster that runs already
    (--address) does not: its nodes need LAPS_PD_SECRET set, or an --api-key."""
    if os.environ.get(pd_secret.ENV) or any(
            a.split("=")[0] in ("--pd-secret-file", "--api-key") for a in serve_args):
        return
    if address:
        log(f"warning: a prefill/decode split on an existing Ray cluster needs "
            f"{pd_secret.ENV} set on its nodes (or --api-key after '--'); the instances "
            f"refuse to start without one")
    os.environ[pd_secret.ENV] = secrets.token_urlsafe(32)

async def serve(args, log, on_app=None) -> int:
    """Serves until SIGTERM or SIGINT. `on_app(app)`, if given, may add routes and start-up
    hooks first (serve_cluster.py: the follower of Ray's instances, /cluster/status)."""
    from laps_jax.cluster.http_router import create_router_app
    from laps_jax.server.http_runner import make_runner
    app = create_router_app(make_router(args), args.api_key, args.max_request_bytes)
    if on_app is not None:
        on_app(app)
    runner = make_runner(app, args.read_timeout or None, access_log=None,
                         handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log(f"routing ({'prefill/decode' if args.prefill else args.policy}) over "
        f"{len(args.instance or args.prefill + args.decode)} instances at "
        f"http://{args.host}:{args.port}/v1")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    log("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    # instances going down, slow, unavailable and back (cluster/instances.py)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("laps_jax.router").setLevel(logging.INFO)
    try:
        return run_on_loop(args.event_loop, lambda: serve(args, log))
    except (ValueError, OSError) as e:  # bad tokenizer path, port in use, ...
        log(f"error: {e}")
        return 2
