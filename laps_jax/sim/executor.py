"""How a simulated step takes time: on a device of its own, or on one shared with another lane.

`SimStepExecutor` is `SimExecutor` (engine.py: real prefix cache and admission, the latency
model's step time) with two additions the simulator needs:

- `SharedDevice`: laps-spatial on *one* device runs its short and long lanes concurrently on the
  same chip (on a CPU: the same cores). The device is processor-shared: with k steps in flight
  each advances at rate (1 + overlap x (k - 1)) / k of its solo speed. overlap = 0 is pure time
  slicing (no free lunch), 1 would be two independent devices, below 0 the two get in each
  other's way (thread oversubscription on a CPU).
- `host_overhead_s`: a fixed cost per step outside the executable (the dispatcher's own work),
  and a `Calibration`: a speed factor and a jitter per step kind ("prefill", "decode"), for
  predicting real runs (a slow machine need not slow compute-bound prefill and overhead-bound
  decode alike; and a real step is not always as long as the last one of its shape).

`FastGrid` is a `BucketGrid` that memoizes its bucket searches: the pools ask the same questions
thousands of times per simulated second, and the answers never change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

from laps_jax.engine.buckets import Bucket, BucketGrid
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.executor import StepInfo
from laps_jax.scheduler.latency_model import LatencyModel, StepShape
from laps_jax.sim.engine import SimEngine, SimExecutor


@dataclasses.dataclass
class FastGrid(BucketGrid):
    """Same buckets and answers as `BucketGrid`, cached."""

    def __post_init__(self) -> None:
        self._buckets: dict[bool, list[Bucket]] = {}
        self._fits: dict[tuple[int, int, bool], Bucket | None] = {}

    @classmethod
    def of(cls, grid: BucketGrid) -> FastGrid:
        return cls(list(grid.prefill_batches), list(grid.prefill_tokens),
                   list(grid.decode_batches), grid.max_batch_tokens)

    def prefill_buckets(self, prompt_logprobs: bool = False) -> list[Bucket]:
        b = self._buckets.get(prompt_logprobs)
        if b is None:
            b = self._buckets[prompt_logprobs] = BucketGrid.prefill_buckets(self, prompt_logprobs)
        return list(b)

    def fit_prefill(self, n_seqs: int, max_new: int,
                    prompt_logprobs: bool = False) -> Bucket | None:
        key = (n_seqs, max_new, prompt_logprobs)
        if key not in self._fits:
            self._fits[key] = BucketGrid.fit_prefill(self, n_seqs, max_new, prompt_logprobs)
        return self._fits[key]


class SharedDevice:
    """Processor sharing of one device among concurrent steps, in the loop's (virtual) time."""

    def __init__(self, overlap: float = 0.0):
        if not -1.0 < overlap <= 1.0:
            raise ValueError(f"overlap must be in (-1, 1], got {overlap}")
        self.overlap = overlap
        self.jobs: list[list] = []   # [remaining solo seconds, future]
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.busy_s = 0.0            # time with at least one step in flight

    def _rate(self, k: int) -> float:
        return (1.0 + self.overlap * (k - 1)) / k

    def _advance(self, now: float) -> None:
        if self.jobs:
            dt = now - self._last
            self.busy_s += dt
            r = self._rate(len(self.jobs))
            for j in self.jobs:
                j[0] -= dt * r
        self._last = now

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.jobs:
            soonest = min(j[0] for j in self.jobs)
            self._timer = loop.call_later(max(soonest, 0.0) / self._rate(len(self.jobs)),
                                          self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(loop.time())
        eps = 1e-12 + 1e-9 * max((abs(j[0]) for j in self.jobs), default=0.0)
        for j in [j for j in self.jobs if j[0] <= eps]:
            self.jobs.remove(j)
            if not j[1].done():
                j[1].set_result(None)
        self._schedule(loop)

    async def run(self, solo_seconds: float) -> None:
        """Returns when a step that alone would take `solo_seconds` is done."""
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        fut = loop.create_future()
        self.jobs.append([solo_seconds, fut])
        self._schedule(loop)
        await fut


@dataclasses.dataclass
class Calibration:
    """How a real machine's steps differ from the latency model: `scale` x the predicted time,
    by compiled shape ("decode 8x1") or else by step kind ("decode"), times a lognormal factor
    of mean 1 whose coefficient of variation is `jitter[kind]` (drawn from a generator seeded by
    `seed` and the executor's name: deterministic)."""

    scale: dict[str, float] = dataclasses.field(default_factory=dict)
    jitter: dict[str, float] = dataclasses.field(default_factory=dict)
    seed: int = 0


class SimStepExecutor(SimExecutor):
    """`SimExecutor` that may share its device and pays a host overhead per step."""

    def __init__(self, engine: SimEngine, model: LatencyModel, clock: Clock, name: str = "sim",
                 device: SharedDevice | None = None, host_overhead_s: float = 0.0,
                 calibration: Calibration | None = None):
        super().__init__(engine, model, clock, name)
        self.device, self.host_overhead_s = device, host_overhead_s
        self.cal = calibration or Calibration()
        self._rng = random.Random(f"{self.cal.seed}/{name}")
        self.busy_s = 0.0     # solo seconds of work executed (utilization)
        self.steps = 0

    async def _step(self, kind: str, shape: StepShape, tokens: int) -> StepInfo:
        key = f"{shape.batch}x{shape.tokens}"
        self.bucket_steps[key] = self.bucket_steps.get(key, 0) + 1
        self.real_tokens += tokens if kind == "prefill" else 0
        self.bucket_tokens += shape.batch * shape.tokens if kind == "prefill" else 0
        solo = self.model.predict(shape) * self._factor(kind, key) + self.host_overhead_s
        t0 = self.clock.now()
        if self.device is None:
            await self.clock.sleep(solo)
        else:
            await self.device.run(solo)
        self.busy_s += solo
        self.steps += 1
        return StepInfo(kind, len(shape.new), tokens, (shape.batch, shape.tokens),
                        self.clock.now() - t0)

    def _factor(self, kind: str, bucket: str) -> float:
        f = self.cal.scale.get(f"{kind} {bucket}", self.cal.scale.get(kind, 1.0))
        cv = self.cal.jitter.get(kind, 0.0)
        if cv > 0:
            var = math.log1p(cv * cv)
            f *= math.exp(self._rng.gauss(-var / 2, math.sqrt(var)))
        return f
