"""Benchmark of the prefill/decode KV hand-off: a pull between two processes (JAX transfer
server, loopback) against an in-process device_put of the same pages, per prompt length, with
the transfer's share of TTFT when a latency profile predicts the prefill.

    python scripts/bench_kv_transfer.py --model bench-cpu --profile docs/data/profile_bench_cpu.json
"""

import argparse
import json
import sys

from laps_jax.bench.kv_transfer import run, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-cpu", help="a preset or model directory (shapes)")
    ap.add_argument("--profile", default=None,
                    help="latency profile of the same model (prefill time, for TTFT share)")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--output", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    from laps_jax.config import resolve_model
    cfg, _ = resolve_model(args.model)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.page_size, lengths,
               args.reps, args.dtype, args.max_model_len)
    if args.profile:
        from laps_jax.scheduler.latency_model import LatencyModel
        from laps_jax.scheduler.profiling import read_profile
        model = LatencyModel.from_dict(read_profile(args.profile)["latency_model"], cfg)
        for r in rows:
            r.prefill_ms = model.predict_prefill(r.tokens) * 1e3
    print(table(rows))
    if args.output:
        with open(args.output, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
