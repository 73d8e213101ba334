"""Replays a trace against a dispatcher in-process: what compare_modes measures.

Open-loop traces (Azure, Mooncake) submit each request at its scaled arrival time. Session traces
run closed-loop through `workload.driver` (the driver every replayer shares): turn k+1 is sent
`think_s` after turn k's answer is complete, and its prompt is turn k's prompt + the answer
actually generated + the new input, so the prefix cache sees real multi-turn reuse. Arrival (and
think) times are multiplied by `time_scale`. A request's TTFT SLO comes from
`slo_fn(new_tokens, cached_tokens)`, with the new tokens the trace implies (session history and
Mooncake blocks already seen count as cached), so it is the same in every mode.
`late_s` submits each request that long after the arrival it is stamped with: a simulated replay
uses it for the lateness a real one measures (`RequestStats.submitted - arrival`: timers of a
busy event loop fire late).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.request import RequestStats
from laps_jax.workload.driver import SessionPacing, SessionTurn, run_sessions
from laps_jax.workload.records import Trace, implied_new_tokens
from laps_jax.workload.sessions import SessionTrace, flatten_sessions

SloFn = Callable[[int, int], float]


@dataclasses.dataclass
class OpenRequest:
    request_id: str
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    new_tokens: int  # prompt tokens the trace implies are not cached yet


def open_requests(trace: Trace) -> list[OpenRequest]:
    """Token prompts and expected new tokens, in arrival order."""
    reqs = list(trace)
    return [OpenRequest(r.request_id, r.arrival_s, r.prompt_token_ids(), max(1, r.output_len), n)
            for r, n in zip(reqs, implied_new_tokens(reqs))]


def natural_rate(arrivals: list[float]) -> float:
    """Requests per second of a trace as recorded."""
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else float("inf")


def session_arrivals(trace: SessionTrace) -> list[float]:
    """Turn arrivals with zero response time (an upper bound on the request rate)."""
    return [r.arrival_s for r in flatten_sessions(trace)]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


async def replay_open(dispatcher, reqs: list[OpenRequest], time_scale: float, slo_fn: SloFn,
                      clock: Clock, late_s: float = 0.0) -> list[RequestStats]:
    start = clock.now()
    handles = []
    for r in reqs:
        t = start + r.arrival_s * time_scale
        await clock.sleep(t + late_s - clock.now())
        handles.append(dispatcher.submit(
            r.prompt, _params(r.max_tokens), arrival_time=t, request_id=r.request_id,
            slo=slo_fn(r.new_tokens, len(r.prompt) - r.new_tokens)))
    return [await h.result() for h in handles]


async def replay_sessions(dispatcher, trace: SessionTrace, time_scale: float, slo_fn: SloFn,
                          clock: Clock, max_len: int, late_s: float = 0.0) -> list[RequestStats]:
    """The sessions closed loop (`workload.driver`), each turn submitted to `dispatcher`; the
    stats come back per session, in session and turn order."""
    stats: dict[str, list[RequestStats]] = {s.session_id: [] for s in trace.sessions}

    async def submit(turn: SessionTurn) -> list[int]:
        h = dispatcher.submit(turn.prompt, _params(turn.max_tokens), arrival_time=turn.arrival_s,
                              request_id=turn.request_id,
                              slo=slo_fn(turn.new_tokens, turn.cached_tokens))
        stats[turn.session.session_id].append(await h.result())
        return h.tokens  # a failed turn's too: the session goes on with what it got

    await run_sessions(trace, submit, clock, SessionPacing(time_scale, late_s, max_len))
    return [st for s in trace.sessions for st in stats[s.session_id]]
