"""What a router's hop costs a request: TTFT on one idle instance, direct and through each
router, interleaved in shuffled order (docs/BENCHMARKS.md, "Routers, live").

    python scripts/bench_router_hop.py --requests 60
    python scripts/bench_router_hop.py --instant --prompt-tokens 100,1000,2000,4000 --requests 200

One instance of `--model`, one request at a time (fresh random token ids, so no prefix hit),
`--prompt-tokens` in and two tokens out; each router in front of the same instance. The
difference of medians against `direct` is the hop. With `--instant` the instance is
`laps_jax.bench.instant_instance`, which answers at once without a model: the hop by prompt
size, out of a prefill's noise. Under load the routers' CPU per request is in
bench_routers.py's table; this isolates the latency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

import aiohttp

from laps_jax.bench import router_procs as rp
from laps_jax.bench.isolated import served_model
from laps_jax.config import resolve_model
from laps_jax.workload.http_client import ReplayConfig, RequestRecord, stream_completion


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60, help="timed requests per target "
                    "(default 60, after 5 untimed)")
    ap.add_argument("--prompt-tokens", default="8", help="prompt lengths, comma-separated "
                    "(default 8)")
    ap.add_argument("--instant", action="store_true", help="an instance that answers at once "
                    "(laps_jax.bench.instant_instance) instead of serve.py --model")
    ap.add_argument("--model", default="bench-cpu", help="the instance's model (default "
                    "bench-cpu)")
    ap.add_argument("--routers", default="laps,round-robin=round-robin --no-affinity,"
                    "smg:round_robin", help="comma-separated, as bench_routers.py's --routers "
                    "(default: %(default)s)")
    ap.add_argument("--serve-args", default=rp.BENCH_SERVE_ARGS, help="serve.py flags (default: "
                    "%(default)s)")
    a = ap.parse_args(argv)
    try:
        a.prompt_tokens = [int(x) for x in a.prompt_tokens.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--prompt-tokens: comma-separated integers, not {a.prompt_tokens!r}")
    if a.requests < 1 or not a.prompt_tokens or min(a.prompt_tokens) < 1:
        ap.error("--requests and each --prompt-tokens must be >= 1")
    return a


async def measure(targets: dict[str, tuple[str, str]], model: str, n: int, tokens: int,
                  vocab: int) -> dict[str, list[float]]:
    rng = random.Random(0)
    out: dict[str, list[float]] = {k: [] for k in targets}
    async with aiohttp.ClientSession() as http:
        for i in range(n + 5):
            order = list(targets)
            rng.shuffle(order)
            for name in order:
                url, api = targets[name]
                rec = RequestRecord(request_id=f"{name}-{i}", arrival_s=0.0, max_tokens=2)
                ids = [rng.randrange(10, vocab - 10) for _ in range(tokens)]
                await stream_completion(http, url, model, ids, rec,
                                        ReplayConfig(api=api, progress=False),
                                        time.perf_counter())
                if rec.error:
                    raise RuntimeError(f"{name}: {rec.error}")
                if i >= 5:
                    out[name].append(rec.ttft_s * 1000)
                await asyncio.sleep(0.02)
    return out


def start_instance(a, logs: str) -> rp.Process:
    if not a.instant:
        return rp.start_instances(1, ["--model", a.model, *a.serve_args.split()], logs)[0]
    port = rp.free_port()
    p = rp.Process([sys.executable, "-m", "laps_jax.bench.instant_instance", "--port",
                    str(port)], port, os.path.join(logs, "instant_instance.log"))
    p.wait(lambda url: bool(served_model(url)), 60)
    return p


def main(argv=None) -> None:
    a = parse_args(argv)
    rp.exit_on_sigterm()
    logs = tempfile.mkdtemp(prefix="router_hop_")
    specs = [rp.RouterSpec.parse(s) for s in a.routers.split(",") if s]
    inst = start_instance(a, logs)
    routers, results = [], {}
    try:
        for s in specs:
            routers.append((s, rp.start_router(s, [inst.url], logs)))
        targets = {"direct": (inst.url, "openai"), "direct /generate": (inst.url, "sglang")}
        targets.update({s.name: (p.url, s.api) for s, p in routers})
        vocab = 32000 if a.instant else resolve_model(a.model)[0].vocab_size
        for tokens in a.prompt_tokens:
            results[tokens] = asyncio.run(measure(targets, served_model(inst.url), a.requests,
                                                  tokens, vocab))
    finally:
        for _, p in routers:
            p.stop()
        inst.stop()
    instance = "an instant instance" if a.instant else a.model
    print(f"TTFT ms on {instance}, {a.requests} requests per target and size (logs: {logs})")
    print(f"{'prompt':>7s} {'target':34s} {'median':>7s} {'p10':>7s} {'p90':>7s} {'hop':>6s}")
    for tokens, res in results.items():
        base = statistics.median(res["direct"])
        for name, v in res.items():
            q = statistics.quantiles(v, n=10)
            m = statistics.median(v)
            print(f"{tokens:7d} {name:34s} {m:7.2f} {q[0]:7.2f} {q[-1]:7.2f} {m - base:+6.2f}")


if __name__ == "__main__":
    main()
