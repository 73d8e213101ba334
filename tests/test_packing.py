"""`shortest_first` (the offline job's and Engine.generate's steps, cut by the dispatcher's
`pack`) plans the steps the engine's own planner used to: the same rows, the same widths, so
the job's buckets and log-probs did not change when it moved onto the shared packing."""

from __future__ import annotations

import dataclasses
import random

import pytest

from laps_jax.engine.buckets import BucketGrid
from laps_jax.engine.packing import shortest_first


@dataclasses.dataclass
class Item:
    remaining: int


def old_first_step(items, grid: BucketGrid):
    """Engine.prefill_plan(...)[0] as it was before the move (the reference)."""
    todo = sorted((s for s in items if s.remaining > 0), key=lambda s: s.remaining)
    cur = []
    for s in todo:
        n = min(s.remaining, grid.max_chunk)
        width = max([n] + [c for _, c in cur])
        if cur and (len(cur) + 1 > grid.prefill_batches[-1]
                    or grid.fit_prefill(len(cur) + 1, width) is None
                    or (len(cur) + 1) * width > grid.max_batch_tokens):
            break
        cur.append((s, n))
    return cur


@pytest.mark.parametrize("seed", range(40))
def test_same_steps_as_the_old_planner(seed):
    rng = random.Random(seed)
    chunk = rng.choice([64, 256, 512, 2048])
    grid = BucketGrid.default(chunk, rng.choice([1, 2, 8]), 8, 16,
                              rng.choice([None, chunk // 2, chunk, chunk * 4]))
    items = [Item(rng.choice([0, 1, 5, 17, 60, 200, 700, 3000]))
             for _ in range(rng.randint(0, 20))]
    want = old_first_step(items, grid)
    got = shortest_first(items, lambda it: it.remaining, grid)
    assert [(id(it), n) for it, n in got] == [(id(it), n) for it, n in want]


def test_nothing_left_is_no_step():
    assert shortest_first([Item(0)], lambda it: it.remaining, BucketGrid.default(64)) == []
