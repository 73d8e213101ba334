"""Profile real prefill steps, fit the roofline latency model, print the short/long thresholds.

    python scripts/profile_latency.py --model bench-cpu --output runs/profile.json

Times the engine's compiled prefill buckets over (batch, new tokens, cached tokens), fits the
roofline (overhead + GEMM + attention, each bound by compute or memory) by non-negative least
squares on 75% of the shapes, reports the median relative error on the other 25%, then refits
on all of them and writes the model. `--from-samples` refits an earlier profile's timings (no
engine, nothing compiled). Prints the threshold (new tokens where prefill turns compute-bound)
on this machine and, from datasheet and measured H200 figures, for the qwen2.5-32b preset in
bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laps_jax.cli import add_engine_args, build_engine  # noqa: E402
from laps_jax.config import PRESETS, resolve_model  # noqa: E402
from laps_jax.scheduler.latency_model import (DEVICES, LatencyModel, StepShape,  # noqa: E402
                                              relative_errors)
from laps_jax.scheduler.profiling import (Sample, attention_blocks_of, plan_shapes, profile,  # noqa: E402
                                          read_profile, split_holdout)

CACHED = (0, 256, 1024, 2048)


def fit(cfg, itemsize: int, blocks: tuple[int, int], samples: list[Sample],
        name: str) -> LatencyModel:
    return LatencyModel.fit(cfg, itemsize, [s.shape for s in samples],
                            [s.seconds for s in samples], blocks, name)


def gpu_thresholds() -> dict:
    cfg = PRESETS["qwen2.5-32b"]
    return {name: {str(c): LatencyModel(cfg, 2, dev).threshold(c) for c in (0, 2048, 8192, 32768)}
            for name, dev in DEVICES.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(ap)
    ap.add_argument("--output", required=True, help="profile JSON to write")
    ap.add_argument("--shapes", type=int, default=40, help="step shapes to time (default 40)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per shape, min kept (3)")
    ap.add_argument("--holdout", type=float, default=0.25,
                    help="fraction of shapes held out of the fit to measure error (0.25)")
    ap.add_argument("--seed", type=int, default=0, help="shape sampling seed (0)")
    ap.add_argument("--from-samples", default=None,
                    help="refit from the samples of an earlier profile JSON (no timing)")
    args = ap.parse_args(argv)
    if args.model == "builtin":
        args.model = "bench-cpu"

    if args.from_samples:
        try:
            earlier = read_profile(args.from_samples)
        except ValueError as e:  # the message names the file and what is wrong
            ap.error(f"--from-samples: {e}")
        try:
            samples = [Sample.from_dict(d) for d in earlier["samples"]]
            model_name, grid = earlier["model"], earlier["engine"]
            cfg, _ = resolve_model(model_name)
            itemsize = int(earlier["latency_model"]["itemsize"])
            lm = earlier["latency_model"]
            blocks = (int(lm.get("kv_block", 1)), int(lm.get("q_block", 256)))
        except (ValueError, KeyError, TypeError) as e:
            ap.error(f"--from-samples {args.from_samples}: not a profile of this script "
                     f"({type(e).__name__}: {e})")
    else:
        built = build_engine(args)
        engine = built.engine
        model_name, cfg = built.model_name, engine.cfg
        itemsize, blocks = engine.runner.kv_dtype.itemsize, attention_blocks_of(engine)
        grid = {"max_chunk": engine.grid.max_chunk,
                "max_batch_tokens": engine.grid.max_batch_tokens}
        shapes = plan_shapes(engine, args.shapes, CACHED, args.seed)
        t0 = time.perf_counter()

        def show(i, n, s):
            print(f"  [{i}/{n}] batch {len(s.shape.new)}/{s.shape.batch} x {s.shape.tokens} "
                  f"new {max(s.shape.new)} cached {s.shape.cached[0]}: "
                  f"{1e3 * s.seconds:.1f} ms", file=sys.stderr, flush=True)
        samples = profile(engine, shapes, args.reps, show)
        engine.kv.clear_prefix_cache()
        print(f"timed {len(samples)} shapes in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    train, held = split_holdout(samples, args.holdout, args.seed)
    errs = relative_errors(fit(cfg, itemsize, blocks, train, "heldout-fit"),
                           [s.shape for s in held], [s.seconds for s in held]) if held else []
    model = fit(cfg, itemsize, blocks, samples, f"{os.uname().nodename}-cpu")
    all_errs = relative_errors(model, [s.shape for s in samples], [s.seconds for s in samples])
    local = {str(c): model.threshold(c) for c in CACHED}
    d = model.device
    report = {
        "model": model_name, "engine": grid,
        "latency_model": model.to_dict(),
        "heldout_median_rel_error": statistics.median(errs) if errs else None,
        "heldout_max_rel_error": max(errs) if errs else None,
        "fit_median_rel_error": statistics.median(all_errs),
        "threshold": local, "gpu_threshold_qwen2.5-32b_bf16": gpu_thresholds(),
        "samples": [s.to_dict() for s in samples],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"fitted: overhead {1e3 * d.step_overhead_s:.2f} ms, gemm {d.peak_flops / 1e9:.1f} "
          f"GFLOP/s, weights {d.mem_bandwidth / 1e9:.1f} GB/s, attention "
          f"{d.attn_rate / 1e9:.1f} GFLOP/s (ragged path {d.ragged_rate / 1e9:.1f}), K/V "
          f"{d.kv_rate / 1e9:.1f} GB/s, attention compute and K/V "
          f"{'overlapped (max)' if d.attn_overlap else 'added'}")
    if errs:
        print(f"held-out shapes: {len(errs)}, median relative error {100 * statistics.median(errs):.1f}% "
              f"(max {100 * max(errs):.1f}%; goal < 15%)")
    print(f"threshold on this machine ({model_name}): "
          + ", ".join(f"{v} new tokens over {c} cached" for c, v in local.items()))
    for name, th in report["gpu_threshold_qwen2.5-32b_bf16"].items():
        print(f"threshold {name} qwen2.5-32b bf16: "
              + ", ".join(f"{v} over {c} cached" for c, v in th.items()))
    one = model.predict(StepShape.exact((1,)))
    print(f"isolated 1-token prefill here: {1e3 * one:.1f} ms; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
