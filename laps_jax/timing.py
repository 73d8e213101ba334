"""Timing two implementations side by side on a noisy machine (used by the benchmark scripts).

The two sides take turns and the speedup is the median of the per-turn ratios, so a slow moment
of the machine hits both sides alike instead of whichever ran then. With `block` > 1 each turn is
one untimed call and then `block` timed ones: two libraries with thread pools of their own (XLA's
and torch's OpenMP, whose workers busy-wait after every parallel region) on the same cores get in
each other's way right after a switch, and the untimed call absorbs that.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def paired_times(fa: Callable[[], object], fb: Callable[[], object] | None, repeats: int,
                 block: int = 1, budget_s: float | None = None) -> tuple[float, float, float]:
    """Median seconds of `fa` and of `fb` over `repeats` turns each, and the median of the
    per-turn ratios t_b / t_a (nan without `fb`). Each function is called once first as a
    warm-up; with block > 1 a turn is one untimed call and the median of `block` timed ones.
    With `budget_s`, no new turn starts once that long has passed since the first (at least one
    turn runs)."""
    fns = [f for f in (fa, fb) if f is not None]
    for f in fns:
        f()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    for turn in range(repeats):
        if turn and budget_s is not None and time.perf_counter() - start >= budget_s:
            break
        for i, f in enumerate(fns):
            if block > 1:
                f()
            turn = []
            for _ in range(block):
                t0 = time.perf_counter()
                f()
                turn.append(time.perf_counter() - t0)
            times[i].append(statistics.median(turn))
    if fb is None:
        return statistics.median(times[0]), float("nan"), float("nan")
    ratio = statistics.median(b / a for a, b in zip(*times))
    return statistics.median(times[0]), statistics.median(times[1]), ratio


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return paired_times(fn, None, repeats)[0]
