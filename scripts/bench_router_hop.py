"""What a router's hop costs a short request: TTFT on one idle serve.py instance, direct and
through each router, interleaved in shuffled order (docs/BENCHMARKS.md, "Routers, live").

    python scripts/bench_router_hop.py --requests 60

One instance of `--model`, one request at a time (fresh random token ids, so no prefix hit),
`--prompt-tokens` in and two tokens out; each router in front of the same instance. The
difference of medians against `direct` is the hop. Under load the routers' CPU per request is
in bench_routers.py's table; this isolates the latency.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

import aiohttp

from laps_jax.bench import router_procs as rp
from laps_jax.bench.isolated import served_model
from laps_jax.config import resolve_model
from laps_jax.workload.http_client import ReplayConfig, RequestRecord, stream_completion


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60, help="timed requests per target "
                    "(default 60, after 5 untimed)")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="prompt length (default 8)")
    ap.add_argument("--model", default="bench-cpu", help="the instance's model (default "
                    "bench-cpu)")
    ap.add_argument("--routers", default="laps,round-robin=round-robin --no-affinity,"
                    "smg:round_robin", help="comma-separated, as bench_routers.py's --routers "
                    "(default: %(default)s)")
    ap.add_argument("--serve-args", default=rp.BENCH_SERVE_ARGS, help="serve.py flags (default: "
                    "%(default)s)")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.prompt_tokens < 1:
        ap.error("--requests and --prompt-tokens must be >= 1")
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


def main(argv=None) -> None:
    a = parse_args(argv)
    rp.exit_on_sigterm()
    logs = tempfile.mkdtemp(prefix="router_hop_")
    specs = [rp.RouterSpec.parse(s) for s in a.routers.split(",") if s]
    inst = rp.start_instances(1, ["--model", a.model, *a.serve_args.split()], logs)
    routers = []
    try:
        for s in specs:
            routers.append((s, rp.start_router(s, [inst[0].url], logs)))
        targets = {"direct": (inst[0].url, "openai"), "direct /generate": (inst[0].url, "sglang")}
        targets.update({s.name: (p.url, s.api) for s, p in routers})
        vocab = resolve_model(a.model)[0].vocab_size
        res = asyncio.run(measure(targets, served_model(inst[0].url), a.requests,
                                  a.prompt_tokens, vocab))
    finally:
        for _, p in routers:
            p.stop()
        inst[0].stop()
    base = statistics.median(res["direct"])
    print(f"TTFT ms, {a.prompt_tokens}-token prompts, {a.requests} each (logs: {logs})")
    print(f"{'target':34s} {'median':>7s} {'p10':>7s} {'p90':>7s} {'hop':>6s}")
    for name, v in res.items():
        q = statistics.quantiles(v, n=10)
        m = statistics.median(v)
        print(f"{name:34s} {m:7.1f} {q[0]:7.1f} {q[-1]:7.1f} {m - base:+6.1f}")


if __name__ == "__main__":
    main()
