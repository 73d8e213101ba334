"""Runs one simulation: instances (+ router) on virtual time, a workload replayed against them.

Decode is either `colocated` (each instance decodes what it prefilled, interleaved by its lane:
what compare_modes measures) or `disaggregated` (prefill instances of a PD deployment, the
LAPS paper's setting: an instance computes the prompt and the first token, then the request
leaves for decode instances that are not simulated; its answer takes `tpot_s` per token, and
for a multi-turn session the answer's KV comes back to the prefill instance's prefix cache, as
with a shared KV store, so the next turn re-prefills only its new input).

Arrivals are open loop (trace timestamps x time scale), closed loop per session (a turn waits
for the previous answer plus think time), or a fixed concurrency (a new request as soon as one
completes, the way the LAPS reference benchmark measures throughput).
"""

from __future__ import annotations

import asyncio
import dataclasses

from laps_jax.engine.kv_cache import OutOfPages
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.scheduler.request import RequestHandle, RequestStats
from laps_jax.cluster.inprocess import Router, RouterConfig
from laps_jax.sim.hardware import ModelSource
from laps_jax.sim.instance import InstanceSpec, build_dispatcher, executors
from laps_jax.sim.workload import Workload
from laps_jax.workload.driver import SessionPacing, SessionTurn, run_sessions
from laps_jax.workload.records import TokenSpace


@dataclasses.dataclass
class RunSpec:
    instance: InstanceSpec = dataclasses.field(default_factory=InstanceSpec)
    instances: int = 1
    router: RouterConfig | None = None   # needed when instances > 1
    hold_steps: float = 0.0              # router: late binding of long requests (cluster/hold.py)
    rate: float | None = None            # offered requests/s (None: as recorded)
    time_scale: float | None = None      # multiply the trace's times by this instead of `rate`
    concurrency: int | None = None       # closed loop at this many in flight (ignores arrivals)
    decode: str = "disaggregated"        # or "colocated"
    tpot_s: float = 0.03                 # disaggregated: decode time per output token
    max_output: int | None = None        # cap on output tokens
    slo_scale: float = 5.0               # TTFT SLO = this x isolated predicted prefill latency
    warmup_fraction: float = 0.2         # sessions: measure arrivals after this share of starts

    def __post_init__(self) -> None:
        if self.decode not in ("disaggregated", "colocated"):
            raise ValueError(f"decode must be disaggregated or colocated, got {self.decode!r}")
        if self.instances > 1 and self.router is None:
            raise ValueError("more than one instance needs a router")


@dataclasses.dataclass
class RunResult:
    stats: list[RequestStats]
    dispatchers: list              # the finished Dispatchers (metrics, executors)
    router: dict | None
    time_scale: float
    end_time: float
    window: tuple[float, float] | None = None  # steady-state measurement window (sessions)
    placed: dict[str, int] | None = None       # routed: request id -> instance


def _out_tokens(spec: RunSpec, n: int) -> int:
    n = max(1, n)
    return min(n, spec.max_output) if spec.max_output else n


class _Run:
    def __init__(self, spec: RunSpec, src: ModelSource, target, grid):
        self.spec, self.src, self.target, self.grid = spec, src, target, grid
        self.stats: list[RequestStats] = []
        self.clock = SimClock()

    def slo(self, new: int, cached: int) -> float:
        return self.spec.slo_scale * self.src.model.predict_prefill(max(new, 1), cached, self.grid)

    def params(self, out: int) -> SamplingParams:
        n = 1 if self.spec.decode == "disaggregated" else _out_tokens(self.spec, out)
        return SamplingParams(max_tokens=n, ignore_eos=True)

    async def finish(self, h: RequestHandle, out: int, decode: bool = True) -> RequestStats:
        """Waits until the request is done here (and, with `decode`, until its answer is
        complete on the decode side); records its stats."""
        st = await h.result()
        self.stats.append(st)
        if decode and self.spec.decode == "disaggregated" and st.first_token is not None:
            await self.clock.sleep(st.first_token + _out_tokens(self.spec, out) *
                                   self.spec.tpot_s - self.clock.now())
        return st

    def submit(self, prompt: list[int], out: int, new: int, rid: str, t: float) -> RequestHandle:
        return self.target.submit(prompt, self.params(out), arrival_time=t, request_id=rid,
                                  slo=self.slo(new, len(prompt) - new))

    async def open_loop(self, w: Workload, scale: float) -> None:
        start, tasks = self.clock.now(), []
        for it in w.items:
            t = start + it.arrival_s * scale
            await self.clock.sleep(t - self.clock.now())
            h = self.submit(it.trace.prompt_token_ids(), it.trace.output_len, it.new_tokens,
                            it.trace.request_id, t)
            tasks.append(asyncio.ensure_future(self.finish(h, it.trace.output_len, False)))
        await asyncio.gather(*tasks)

    async def fixed_concurrency(self, w: Workload, c: int) -> None:
        """`c` requests always in flight on the instances (a slot frees when this instance is
        done with its request: after prefill when decode is disaggregated)."""
        items = iter(w.items)

        async def worker():
            for it in items:
                h = self.submit(it.trace.prompt_token_ids(), it.trace.output_len,
                                it.new_tokens, it.trace.request_id, self.clock.now())
                await self.finish(h, it.trace.output_len, False)
        await asyncio.gather(*(worker() for _ in range(c)))

    async def turn(self, turn: SessionTurn, space: TokenSpace) -> list[int] | None:
        """Submits one session turn (the session driver calls this); the answer the next turn
        builds on, or None if the turn failed. Disaggregated, the answer is the nominal one and
        its KV returns to the prefill instance, so the next turn re-prefills only its input."""
        h = self.submit(turn.prompt, turn.max_tokens, turn.new_tokens, turn.request_id,
                        turn.arrival_s)
        st = await self.finish(h, turn.max_tokens)
        if st.finish_reason not in ("length", "stop"):
            return None
        if self.spec.decode == "colocated":
            return h.tokens
        answer = turn.session.nominal_answer_ids(turn.index, space)[:turn.max_tokens]
        if h.request.lane is not None:
            _return_kv(h.request.lane.executor, turn.prompt + answer)
        return answer

    async def sessions(self, w: Workload, scale: float) -> None:
        """Every session closed loop (`workload.driver`), each turn through `turn`."""
        space = w.sessions.token_space
        pacing = SessionPacing(scale, max_len=self.spec.instance.max_model_len,
                               max_output=self.spec.max_output)
        await run_sessions(w.sessions, lambda turn: self.turn(turn, space), self.clock, pacing)


def _return_kv(executor, tokens: list[int]) -> None:
    """The decode side hands the answer's KV back: the prompt + answer become cached prefix."""
    kv = executor.engine.kv
    try:
        pages = kv.allocate(tokens)
    except OutOfPages:
        return
    kv.commit(pages, tokens)
    kv.release(pages)


def simulate(spec: RunSpec, src: ModelSource, workload: Workload) -> RunResult:
    """Runs `workload` at `spec.rate` against `spec.instances` simulated instances."""
    if spec.concurrency is not None or spec.time_scale is not None:
        w, scale = workload, 1.0 if spec.time_scale is None else spec.time_scale
    else:
        w, scale = workload.at_rate(spec.rate)
    grid = spec.instance.grid.build()

    async def main() -> RunResult:
        clock = SimClock()
        ds = [build_dispatcher(spec.instance, src.cfg, src.model, clock, f"i{i}", grid)
              for i in range(spec.instances)]
        target = (Router(ds, spec.router, clock, hold_steps=spec.hold_steps)
                  if spec.instances > 1 else ds[0])
        for ids in w.shared_prefixes():  # hot documents / system prompts: cached from the start
            for d in ds:
                for ex in executors(d):
                    _return_kv(ex, ids)
        run = _Run(spec, src, target, grid)
        await target.start()
        window = None
        if w.closed_loop and spec.concurrency is None:
            starts = [s.arrival_s * scale for s in w.sessions.sessions]
            lo, hi = min(starts), max(starts)
            window = (lo + spec.warmup_fraction * (hi - lo), hi)
        if spec.concurrency is not None:
            if w.closed_loop:
                raise ValueError("fixed concurrency needs an open-loop trace")
            await run.fixed_concurrency(w, spec.concurrency)
        elif w.closed_loop:
            await run.sessions(w, scale)
        else:
            await run.open_loop(w, scale)
        await target.stop(drain=True)
        router = target.metrics() if isinstance(target, Router) else None
        if router:
            router.pop("instances", None)
        placed = target.placed if isinstance(target, Router) else None
        return RunResult(run.stats, ds, router, scale, clock.now(), window, placed)

    return run_simulated(main())


def sim_executors(result: RunResult) -> list:
    return [ex for d in result.dispatchers for ex in executors(d)]
