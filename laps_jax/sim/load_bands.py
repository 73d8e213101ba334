"""The load bands a router comparison is split by, shared by the live harness
(`bench/load_groups.py`, blocks of a bench_routers.py run) and the simulated screening
(`sim/route_screen.py`, cells): a block's band is the share of SLOs round-robin missed in it."""

from __future__ import annotations

GROUPS = (("light", 0.0, 0.2), ("medium", 0.2, 0.5), ("heavy", 0.5, 1.01))


def group_of(rate: float) -> str:
    """The band of a miss rate: light under 20%, medium 20-50%, heavy over 50%."""
    for name, lo, hi in GROUPS:
        if lo <= rate < hi:
            return name
    return GROUPS[-1][0]
