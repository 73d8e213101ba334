"""Where a simulated run's SLO misses are: by pool, by whether the request found history
cached, and by instance.

A router's miss count alone cannot say whether it loses by placing work badly or because every
instance queues the same work whatever the placement: on the simulated agent loops at twice
the physical load, 80-88% of every rule's misses were long requests, spread evenly over the
instances (docs/SIMULATION.md, "Agent loops at steady state"). `simulate.py route-screen
--miss-split` logs this split for each cell and keeps it in its rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from laps_jax.scheduler.request import RequestStats
from laps_jax.sim.summary import in_window


def kind_of(s: RequestStats) -> str:
    """"short/cached", "long/uncached", ...: its pool and whether any of its prompt was
    cached where it ran (a follow-up or a shared document found; else a first prompt, or
    history recomputed away from its holder)."""
    return f"{s.pool or 'unknown'}/{'cached' if s.cached_tokens else 'uncached'}"


def miss_split(stats: Iterable[RequestStats], placed: Mapping[str, int] | None, n: int,
               window: tuple[float, float] | None = None) -> dict:
    """{"kinds": kind -> [misses, requests], "instances": [[misses, requests] per instance]}
    over the requests with an SLO that arrived in `window` (all without one); `placed` maps a
    request id to its instance (None: no instance split)."""
    kinds: dict[str, list[int]] = {}
    instances = [[0, 0] for _ in range(n)]
    for s in in_window(stats, window):
        if s.slo_s is None:
            continue
        missed = int(bool(s.slo_violated))
        acc = kinds.setdefault(kind_of(s), [0, 0])
        acc[0] += missed
        acc[1] += 1
        i = None if placed is None else placed.get(s.request_id)
        if i is not None:
            instances[i][0] += missed
            instances[i][1] += 1
    return {"kinds": dict(sorted(kinds.items())), "instances": instances}


def line(split: dict) -> str:
    """One log line: each kind's misses / requests, then each instance's."""
    kinds = ", ".join(f"{k} {m}/{r}" for k, (m, r) in split["kinds"].items())
    per = " ".join(f"{m}/{r}" for m, r in split["instances"])
    return f"{kinds}; by instance {per}"
