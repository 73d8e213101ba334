"""Packing prefill work into one bucket: which rows share a step, and in which shape.

Every batch is a rectangle: rows x the widest row, padded into the smallest compiled bucket that
holds it (`BucketGrid.fit_prefill`) with at most `budget` padded tokens. `pack` fills one from an
ordered candidate list. The dispatcher's pools (scheduler/pools.py decides the order), the
offline job and the engine's own synchronous loop all cut their steps with it, so a batch is
shaped one way everywhere. Plain Python: the scheduler and the simulator import it without JAX.
"""

from __future__ import annotations

import operator
from typing import Callable, Iterable, Sequence, TypeVar

from laps_jax.engine.buckets import Bucket, BucketGrid

T = TypeVar("T")


def fits(grid: BucketGrid, rows: int, width: int, budget: int) -> Bucket | None:
    b = grid.fit_prefill(rows, width)
    if b is None or (rows > 1 and b.batch * b.tokens > budget) or width > budget:
        return None
    return b


def max_width(grid: BucketGrid, rows: int, budget: int) -> int:
    """Widest row a batch of `rows` may have under `budget` (0 if none)."""
    for t in reversed(grid.prefill_tokens):
        if fits(grid, rows, t, budget) is not None:
            return t
    return 0


def pack(cands: Iterable[T], grid: BucketGrid, budget: int, chunk: bool, strict: bool,
         max_padding: float = 0.5,
         remaining: Callable[[T], int] = operator.attrgetter("remaining")
         ) -> tuple[list[tuple[T, int]], Bucket | None, bool]:
    """Greedy batch from ordered candidates: (work, bucket, saturated), work being (candidate,
    new tokens) rows. The first row always goes in; a row that would pad the others' tokens past
    `max_padding` is left out (row padding up to the bucket's power of two is not counted).
    `chunk`: a row may be cut to the widest a batch of its rows may have; `strict`: stop at the
    first row that does not go in (nobody overtakes). `saturated`: some candidate was left out
    for lack of rows or budget, so the batch cannot grow. `remaining(candidate)`: its prompt
    tokens still to compute."""
    work: list[tuple[T, int]] = []
    width, real, saturated = 0, 0, False
    for r in cands:
        rows = len(work) + 1
        if rows > grid.prefill_batches[-1]:
            saturated = True
            break
        n = min(remaining(r), grid.max_chunk, budget)
        if n <= 0:
            continue
        if fits(grid, rows, max(width, n), budget) is None and chunk and work:
            n = min(n, max_width(grid, rows, budget))
        bucket = fits(grid, rows, max(width, n), budget) if n > 0 else None
        if bucket is None:
            saturated = True
        elif work and 1.0 - (real + n) / (rows * bucket.tokens) > max_padding:
            bucket = None
        if bucket is None:
            if strict:
                break
            continue
        work.append((r, n))
        width, real = max(width, n), real + n
    bucket = fits(grid, len(work), width, budget) if work else None
    return work, bucket, saturated


def shortest_first(items: Sequence[T], remaining: Callable[[T], int], grid: BucketGrid
                   ) -> list[tuple[T, int]]:
    """The next step of a loop that only wants throughput (the offline job, `Engine.generate`):
    the fewest remaining tokens first, as many rows as one bucket of the grid holds. Similar
    lengths share a step, so padding stays low without a cap on it; a one-row step may take a
    whole chunk, as the grid compiles one-row buckets that wide whatever its budget."""
    todo = sorted((it for it in items if remaining(it) > 0), key=remaining)
    budget = max(grid.max_batch_tokens, grid.max_chunk)
    work, _, _ = pack(todo, grid, budget, chunk=False, strict=True, max_padding=1.0,
                      remaining=remaining)
    return work
