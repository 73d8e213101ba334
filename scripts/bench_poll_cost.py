"""What the network router's polls cost busy instances: prefill time per request with and
without a poller that reads each instance's /health and /metrics every 0.5 s, as
scripts/router.py does (docs/BENCHMARKS.md, "Light load with trimmed long steps").

    python scripts/bench_poll_cost.py --phases 6

`--instances` serve.py processes of `--model` (one XLA thread each, as bench_routers.py starts
them), each driven closed-loop by its own client: one request at a time, fresh random token
ids (no prefix hit), `--prompt-tokens` in and two out. Phases alternate without and with the
poller, which also parses what it reads. Each phase's figure is the instances' prefill lane
seconds per request, from their /metrics counters (bench/instance_steps.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from laps_jax.bench import router_procs as rp
from laps_jax.bench.instance_steps import summed
from laps_jax.bench.isolated import served_model
from laps_jax.bench.routers import metrics_texts
from laps_jax.cluster.instances import POLL_INTERVAL_S
from laps_jax.config import resolve_model


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=2, help="serve.py processes (default 2)")
    ap.add_argument("--phases", type=int, default=6, help="phases, alternately without and "
                    "with the poller (default 6)")
    ap.add_argument("--requests", type=int, default=40, help="requests per instance per "
                    "phase (default 40)")
    ap.add_argument("--prompt-tokens", type=int, default=250, help="prompt length (default 250)")
    ap.add_argument("--model", default="bench-cpu", help="the instances' model (default "
                    "bench-cpu)")
    ap.add_argument("--serve-args", default=rp.BENCH_SERVE_ARGS, help="serve.py flags (default: "
                    "%(default)s)")
    a = ap.parse_args(argv)
    if min(a.instances, a.phases, a.requests, a.prompt_tokens) < 1:
        ap.error("--instances, --phases, --requests and --prompt-tokens must be >= 1")
    return a


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def complete(url: str, model: str, ids: list[int]) -> None:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def phase(urls: list[str], model: str, poll: bool, n: int, tokens: int, vocab: int,
          seed: int) -> float:
    """Prefill ms per request over one phase of `n` requests per instance."""
    stop = threading.Event()

    def poller() -> None:
        while not stop.is_set():
            for u in urls:
                get(u + "/health")
                list(text_string_to_metric_families(get(u + "/metrics")))
            stop.wait(POLL_INTERVAL_S)

    def drive(url: str, k: int) -> None:
        rng = random.Random(seed * 100 + k)
        for _ in range(n):
            complete(url, model, [rng.randrange(10, vocab - 10) for _ in range(tokens)])

    def prefill_s() -> float:
        c = summed(metrics_texts(urls))
        if c is None:
            raise RuntimeError("an instance's /metrics could not be read")
        return c.get("prefill_s", 0.0)

    before = prefill_s()
    threads = [threading.Thread(target=drive, args=(u, k)) for k, u in enumerate(urls)]
    if poll:
        threads.append(threading.Thread(target=poller))
    for t in threads:
        t.start()
    for t in threads[:len(urls)]:
        t.join()
    stop.set()
    for t in threads[len(urls):]:
        t.join()
    return 1000 * (prefill_s() - before) / (n * len(urls))


def main(argv=None) -> None:
    a = parse_args(argv)
    rp.exit_on_sigterm()
    logs = tempfile.mkdtemp(prefix="poll_cost_")
    inst = rp.start_instances(a.instances, ["--model", a.model, *a.serve_args.split()], logs)
    res: dict[bool, list[float]] = {False: [], True: []}
    try:
        urls = [p.url for p in inst]
        model, vocab = served_model(urls[0]), resolve_model(a.model)[0].vocab_size
        phase(urls, model, False, 2, a.prompt_tokens, vocab, seed=999)  # warm
        for k in range(a.phases):
            poll = k % 2 == 1
            ms = phase(urls, model, poll, a.requests, a.prompt_tokens, vocab, seed=k)
            res[poll].append(ms)
            print(f"phase {k + 1}: {'polled    ' if poll else 'not polled'} prefill "
                  f"{ms:.1f} ms per request", flush=True)
    finally:
        for p in inst:
            p.stop()
    if res[True] and res[False]:
        off, on = statistics.median(res[False]), statistics.median(res[True])
        print(f"median prefill ms per request: not polled {off:.1f}, polled {on:.1f} "
              f"({on / off:.3f}x; logs: {logs})")


if __name__ == "__main__":
    main()
