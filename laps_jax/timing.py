"""Timing two implementations side by side on a noisy machine (used by the benchmark scripts).

Calls alternate (one of each, repeated) and the speedup is the median of the per-pair ratios, so
a slow moment of the machine hits both sides alike instead of whichever ran then.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def paired_times(fa: Callable[[], object], fb: Callable[[], object] | None,
                 repeats: int) -> tuple[float, float, float]:
    """Median seconds of `fa` and of `fb`, and the median of the per-pair ratios t_b / t_a
    (nan without `fb`). Each function is called once first as a warm-up."""
    fns = [f for f in (fa, fb) if f is not None]
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    if fb is None:
        return statistics.median(times[0]), float("nan"), float("nan")
    ratio = statistics.median(b / a for a, b in zip(*times))
    return statistics.median(times[0]), statistics.median(times[1]), ratio


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return paired_times(fn, None, repeats)[0]
