"""Times real prefill steps of an engine's compiled buckets, to fit the latency model.

Shapes are drawn from the engine's own bucket grid (so nothing compiles on the way, other than
what warm-up would) over a range of cached-context lengths; each is timed a few times and the
minimum kept (the machine is shared: the minimum is the least disturbed run). A random part of
the shapes is held out of the fit to measure prediction error honestly.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import time
from typing import TYPE_CHECKING, Callable

from laps_jax.scheduler.latency_model import LatencyModel, StepShape

if TYPE_CHECKING:  # profiling runs a real engine; importing this module needs no JAX
    from laps_jax.engine.engine import Engine
    from laps_jax.engine.runner import SeqInput


@dataclasses.dataclass
class Sample:
    shape: StepShape
    seconds: float

    def to_dict(self) -> dict:
        return {"new": list(self.shape.new), "cached": list(self.shape.cached),
                "batch": self.shape.batch, "tokens": self.shape.tokens, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        return cls(StepShape(tuple(d["new"]), tuple(d["cached"]), d["batch"], d["tokens"]),
                   float(d["seconds"]))


def attention_blocks_of(engine: Engine) -> tuple[int, int]:
    """The engine's attention (kv_block, q_block): what a latency model fitted to it prices."""
    return engine.runner.attention_blocks


def plan_shapes(engine: Engine, n: int, cached_lens: tuple[int, ...] = (0, 256, 1024, 2048),
                seed: int = 0) -> list[StepShape]:
    """`n` bucket shapes spread over (batch, tokens, cached); new tokens fill 50-100% of a row.

    One-token steps (the decode buckets) are included: they are the memory-bound end of the
    curve, without which overhead and weight reading cannot be told apart from compute.
    """
    rng = random.Random(seed)
    grid = engine.grid
    limit = engine.ecfg.max_model_len
    buckets = [b for b in grid.prefill_buckets() if b.tokens > 1] + grid.decode_buckets()
    combos = [(b, c) for b in buckets for c in cached_lens if c + b.tokens <= limit]
    rng.shuffle(combos)
    # every bucket at least once when n allows, then any combination
    seen, picked = set(), []
    for b, c in combos:
        if b not in seen:
            seen.add(b)
            picked.append((b, c))
    picked += [x for x in combos if x not in picked]
    shapes = []
    for b, c in picked[:n]:
        rows = rng.randint(max(1, b.batch // 2 + 1), b.batch) if b.batch > 1 else 1
        if b.tokens == 1:
            rows = b.batch  # one-token steps: a full decode bucket
        lo = max(1, b.tokens // 2 + 1)
        new = tuple(rng.randint(lo, b.tokens) for _ in range(rows))
        new = (b.tokens,) + new[1:]  # the widest row fills the bucket
        shapes.append(StepShape.bucketed(new, (c,) * rows, b.batch, b.tokens))
    return shapes


def _inputs(engine: Engine, shape: StepShape) -> list[SeqInput]:
    ps = engine.ecfg.page_size
    pages = list(range(1, 1 + -(-(max(shape.cached) + shape.tokens) // ps)))
    # garbage K/V in those pages is fine for timing (profile a fresh engine: it overwrites them)
    from laps_jax.engine.runner import SeqInput  # JAX: profiling runs a real engine
    return [SeqInput(list(range(10, 10 + n)), c, pages) for n, c in zip(shape.new, shape.cached)]


def time_once(engine: Engine, seqs: list[SeqInput]) -> float:
    t0 = time.perf_counter()
    engine.runner.run(seqs)
    return time.perf_counter() - t0


def profile(engine: Engine, shapes: list[StepShape], reps: int = 3,
            progress: Callable[[int, int, Sample], None] | None = None) -> list[Sample]:
    """Minimum of `reps` timings per shape. The reps go round-robin over all shapes, so a burst
    of load from other processes spoils one timing of many shapes, not every timing of one."""
    inputs = [_inputs(engine, s) for s in shapes]
    for seqs in inputs:
        engine.runner.run(seqs)  # untimed first run
    best = [float("inf")] * len(shapes)
    for _ in range(reps):
        for i, seqs in enumerate(inputs):
            best[i] = min(best[i], time_once(engine, seqs))
    out = [Sample(s, t) for s, t in zip(shapes, best)]
    if progress:
        for i, smp in enumerate(out):
            progress(i + 1, len(out), smp)
    return out


def speed_factor(engine: Engine, samples: list[Sample], n: int = 8,
                 reps: int = 3) -> tuple[float, int]:
    """(how many times slower this machine runs these shapes now than when `samples` were
    timed, shapes timed): the median of now/then over up to `n` samples spread across their
    durations, each still a bucket of this engine. A shared VM's speed drifts by tens of percent
    between hours; a profile from another hour would set SLOs and plans for another machine."""
    grid, limit = engine.grid, engine.ecfg.max_model_len
    usable = sorted((s for s in samples
                     if (b := grid.fit(s.shape.batch, s.shape.tokens)) is not None
                     and (b.batch, b.tokens) == (s.shape.batch, s.shape.tokens)
                     and max(s.shape.cached) + s.shape.tokens <= limit),
                    key=lambda s: s.seconds)
    if not usable:
        return 1.0, 0
    step = max(1, len(usable) // n)
    chosen = usable[::step][:n]
    now = profile(engine, [s.shape for s in chosen], reps)
    return statistics.median(a.seconds / b.seconds for a, b in zip(now, chosen)), len(chosen)


def _not_a_profile(path: str, e: Exception) -> ValueError:
    return ValueError(f"{path}: not a latency profile of scripts/profile_latency.py "
                      f"({type(e).__name__}: {e})")


def read_profile(path: str) -> dict:
    """A profile JSON of scripts/profile_latency.py, or ValueError naming the file."""
    try:
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict) or not isinstance(d.get("latency_model"), dict):
            raise ValueError("no latency_model")
        return d
    except (OSError, ValueError) as e:
        raise _not_a_profile(path, e) from None


def load_profile(path: str, engine: Engine,
                 rescale: bool = True) -> tuple[LatencyModel, float | None]:
    """(the latency model of a profile JSON for `engine`, the speed factor applied or None).
    With `rescale` some of its shapes run again now and the model is scaled by how much slower
    or faster they are (`speed_factor`); shapes that are no bucket of this engine are skipped,
    and with none left the profile is kept as it is."""
    d = read_profile(path)
    try:
        model = LatencyModel.from_dict(d["latency_model"], engine.cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise _not_a_profile(path, e) from None
    if not rescale:
        return model, None
    f, n = speed_factor(engine, [Sample.from_dict(x) for x in d.get("samples", [])])
    engine.kv.clear_prefix_cache()
    return (model.scaled(f), f) if n else (model, None)


def split_holdout(samples: list[Sample], frac: float = 0.25,
                  seed: int = 0) -> tuple[list[Sample], list[Sample]]:
    """(fit, held out): a seeded random `frac` of the samples is held out."""
    idx = list(range(len(samples)))
    random.Random(seed).shuffle(idx)
    k = max(1, round(frac * len(samples))) if len(samples) > 4 else 0
    held = set(idx[:k])
    return ([s for i, s in enumerate(samples) if i not in held],
            [s for i, s in enumerate(samples) if i in held])
