"""Sweeps: many simulations over workloads, modes, loads, instance counts and router policies.

A *load* is offered compute over the physical limit: rate x mean new tokens per request /
(devices x limit tokens/s), so load 1.0 asks for exactly what the devices could compute with
no padding, no overhead and every cacheable prefix cached. Real capacity sits below 1.0, so a
sweep to 1.0 and a little past it reaches saturation in every mode.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable

from laps_jax.cluster.inprocess import RouterConfig
from laps_jax.sim import workload as wl
from laps_jax.sim.driver import RunSpec, simulate
from laps_jax.sim.hardware import ModelSource
from laps_jax.sim.instance import InstanceSpec
from laps_jax.sim.miss_split import miss_split
from laps_jax.sim.summary import summarize


HOLD_SUFFIX = "+hold"  # a policy name's suffix: its router binds long requests late
HOLD_STEPS = 1.0  # ... holding them while every instance has a full prefill step ahead of them


def router_of(policy: str) -> tuple[RouterConfig, float]:
    """The router a policy name asks for, and its hold in full steps: `NAME` (bound on
    arrival) or `NAME+hold` (long requests bound late: cluster/hold.py). ValueError names the
    policies when NAME is not one."""
    name, hold = ((policy[:-len(HOLD_SUFFIX)], HOLD_STEPS) if policy.endswith(HOLD_SUFFIX)
                  else (policy, 0.0))
    return RouterConfig(policy=name), hold


@dataclasses.dataclass(frozen=True)
class Point:
    """One simulation of a sweep."""

    workload: str
    mode: str
    instances: int = 1
    policy: str | None = None       # router policy (instances > 1)
    load: float | None = None       # offered compute / limit (open loop)
    concurrency: int | None = None  # fixed concurrency instead of a load
    requests: int | None = None     # per instance (None: the workload source's default)
    settings: tuple = ()            # (SchedulerConfig field, value) pairs over the instance's

    def label(self) -> str:
        where = f"{self.instances}x {self.policy}" if self.instances > 1 else "1x"
        how = f"load {self.load:.2f}" if self.load is not None else f"cc {self.concurrency}"
        return f"{self.workload} {self.mode} {where} {how}"


@dataclasses.dataclass
class WorkloadSource:
    """How to get a workload with n requests (read once per size, cached)."""

    kind: str
    path: str | None = None
    length_scale: float = 1.0
    sample: float = 1.0             # fraction of the trace's conversations kept
    max_len: int = 32768
    seed: int = 0
    requests: int = 800             # default requests per single-instance run
    routed_requests: int = 400      # default requests per instance of a routed run
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def get(self, n: int) -> wl.Workload:
        if n not in self._cache:
            self._cache[n] = wl.load(self.kind, self.path, max_requests=n,
                                     length_scale=self.length_scale, max_len=self.max_len,
                                     seed=self.seed, sample=self.sample)
        return self._cache[n]


def rate_for_load(load: float, w: wl.Workload, src: ModelSource, devices: int) -> float:
    """Requests/s whose new tokens ask `load` x the devices' compute limit."""
    limit = src.limit_tokens_per_s or capacity_tokens_per_s(src)
    return load * devices * limit / max(float(w.new_token_counts().mean()), 1.0)


def capacity_tokens_per_s(src: ModelSource, chunk: int = 2048) -> float:
    """Without device figures (a CPU profile): the model's tokens/s on full chunks."""
    from laps_jax.scheduler.latency_model import StepShape
    return chunk / src.model.predict(StepShape.exact((chunk,)))


def run_point(p: Point, src: ModelSource, inst: InstanceSpec, workloads: dict[str, WorkloadSource],
              base: RunSpec, split: bool = False) -> dict:
    """Simulates one point; returns its parameters and summary in one flat dict (with
    `split`, also where its misses are: `miss_split`)."""
    source = workloads[p.workload]
    per = p.requests or (source.routed_requests if p.instances > 1 else source.requests)
    n = per * p.instances
    w = source.get(n)
    sched = dataclasses.replace(inst.scheduler, **dict(p.settings))
    router, hold = router_of(p.policy) if p.instances > 1 else (None, 0.0)
    spec = dataclasses.replace(
        base, instance=dataclasses.replace(inst, mode=p.mode, scheduler=sched),
        instances=p.instances, router=router, hold_steps=hold, concurrency=p.concurrency)
    if p.load is not None:
        spec.rate = rate_for_load(p.load, w, src, p.instances * spec.instance.devices)
    t0 = time.perf_counter()
    result = simulate(spec, src, w)
    row = dataclasses.asdict(p)
    row.update(summarize(result, spec, src))
    row.update(router=result.router, wall_s=time.perf_counter() - t0,
               workload_summary=w.summary())
    if split:
        row["miss_split"] = miss_split(result.stats, result.placed, p.instances, result.window)
    return row


def run_points(points: Iterable[Point], src: ModelSource, inst: InstanceSpec,
               workloads: dict[str, WorkloadSource], base: RunSpec, progress: bool = True,
               log: Callable[[str], None] | None = None,
               checkpoint: str | None = None) -> list[dict]:
    """Every point in order, with a progress bar on stderr; each row is also appended to
    `checkpoint` (JSON lines) as soon as it is done, so a long sweep loses nothing."""
    points = list(points)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(points), file=sys.stderr, unit="run", dynamic_ncols=True)
    rows = []
    for p in points:
        if bar:
            bar.set_description(p.label())
        rows.append(run_point(p, src, inst, workloads, base))
        if checkpoint:
            with open(checkpoint, "a") as f:
                f.write(json.dumps(rows[-1], default=str) + "\n")
        if log:
            r = rows[-1]
            log(f"{p.label()}: TTFT p90 {r.get('ttft_ms_p90') or 0:.0f} ms, SLO viol "
                f"{r.get('slo_violation_rate') or 0:.3f}, computed {r.get('computed_tok_s') or 0:.0f} tok/s")
        if bar:
            bar.update()
    if bar:
        bar.close()
    return rows


def single_instance(workloads: list[str], modes: list[str], loads: list[float],
                    requests: int | None = None) -> list[Point]:
    return [Point(w, m, load=x, requests=requests) for w in workloads for m in modes
            for x in loads]


def routed(workloads: list[str], counts: list[int], policies: list[str],
           modes: list[str], loads: list[float]) -> list[Point]:
    return [Point(w, m, n, pol, load=x) for w in workloads for n in counts for pol in policies
            for m in modes for x in loads]


def concurrency(workloads: list[str], modes: list[str], levels: list[int],
                requests: int | None = None) -> list[Point]:
    return [Point(w, m, concurrency=c, requests=requests) for w in workloads for m in modes
            for c in levels]


def save(path: str, meta: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "points": rows}, f, indent=1, default=str)
