"""The order in which a benchmark runs the things it compares, round by round (the modes of
compare_modes.py, the routers of bench_routers.py).

On a shared 2-core machine a replay's speed drifts, and a replay may leave something for the
next (an instance's adaptive state, the host's caches), so neither a fixed order nor a plain
rotation is fair: with a rotation every router always follows the same one. Each odd round
reverses the round before it, so a drift within a pair of rounds hits every item alike, and
each pair starts one rotation further on, so no item keeps one position and each follows more
than one other. With three items: all six orders every six rounds. (In an A/A run of the mode
comparison, two settings that made identical decisions differed 20% on mean prefill over 8
rounds, one of them in the middle every round; in one of the router bench's, with a plain
rotation, the same router missed 1.19x its twin's SLOs over 8 rounds [1.08-1.31], the twin
always right after it: noise or position, a fair order rules out the second.)
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def round_order(items: list[T], rnd: int) -> list[T]:
    """The order of `items` in round `rnd` (from 0)."""
    k = (rnd // 2) % max(1, len(items))
    rotated = list(items[k:]) + list(items[:k])
    return rotated if rnd % 2 == 0 else rotated[::-1]
