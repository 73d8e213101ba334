"""Step times of every bucket of a built engine: what the GPU run of `scripts/device_check.py`
reports for a 32B-shaped model with random weights.

Each prefill bucket runs full rows of new tokens over no cached history (the compute-bound
end); each decode bucket runs one token per row over `decode_cached` cached tokens (the
memory-bound end: all weights and that much K/V read per step). The timing is
`scheduler.profiling.profile`'s: an untimed first run, then the minimum of `reps`.
"""

from __future__ import annotations

import time

from laps_jax.scheduler.latency_model import StepShape
from laps_jax.scheduler.profiling import profile


def bucket_shapes(engine, decode_cached: int = 1024) -> list[StepShape]:
    grid, limit = engine.grid, engine.ecfg.max_model_len
    cached = min(decode_cached, limit - 1)
    shapes = [StepShape.bucketed((b.tokens,) * b.batch, (0,) * b.batch, b.batch, b.tokens)
              for b in grid.prefill_buckets() if b.tokens > 1]
    shapes += [StepShape.bucketed((1,) * b.batch, (cached,) * b.batch, b.batch, 1)
               for b in grid.decode_buckets()]
    return shapes


def time_buckets(engine, reps: int = 3, decode_cached: int = 1024, say=print) -> dict:
    """{"prefill": [...], "decode": [...]}: per bucket its shape, milliseconds per step, and
    tokens per second."""
    t0 = time.perf_counter()
    rows = {"prefill": [], "decode": []}
    for s in profile(engine, bucket_shapes(engine, decode_cached), reps):
        kind = "decode" if s.shape.tokens == 1 else "prefill"
        ms = s.seconds * 1e3
        row = {"batch": s.shape.batch, "tokens": s.shape.tokens, "cached": s.shape.cached[0],
               "ms": round(ms, 3), "tokens_per_s": round(s.shape.batch * s.shape.tokens / ms
                                                         * 1e3, 1)}
        rows[kind].append(row)
        say(f"{kind} {row['batch']}x{row['tokens']} over {row['cached']} cached: "
            f"{ms:.2f} ms ({row['tokens_per_s']:.0f} tokens/s)")
    rows["seconds"] = round(time.perf_counter() - t0, 1)
    return rows


__all__ = ["bucket_shapes", "time_buckets"]
