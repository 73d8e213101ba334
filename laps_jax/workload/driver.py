"""The one closed-loop session driver: how a multi-turn conversation is paced and how its
prompts grow, whatever serves it.

A session's turn 0 is submitted at the session's arrival; turn k ``think_s`` after turn k-1's
answer came back, with the prompt = turn k-1's prompt + the answer ids actually returned + the
new input (``Session.prompt_ids``), so a later turn repeats its history token for token and
the prefix cache under test is exercised. Where a turn goes is the caller's ``submit``
coroutine function: the in-process dispatcher (bench), a simulated router (sim) or HTTP
(``http_replay``). It returns the answer ids, or None when the turn failed: the session ends
there, since the next prompt cannot be built without the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from .records import TokenSpace
from .sessions import Session, SessionTrace, Turn


class Clock(Protocol):
    """What the driver needs of a clock (wall time, or a simulation's virtual time)."""

    def now(self) -> float:
        """Seconds on this clock's time line."""

    async def sleep(self, seconds: float) -> None:
        """Waits ``seconds`` (at most a yield when not positive)."""


@dataclasses.dataclass(frozen=True)
class SessionTurn:
    """One turn ready to submit: its prompt, when it arrives on the driver's clock, how many
    tokens to generate, and how many prompt tokens are new (not the session's history)."""

    session: Session
    index: int
    prompt: list[int]
    arrival_s: float
    max_tokens: int
    new_tokens: int

    @property
    def request_id(self) -> str:
        return f"{self.session.session_id}/{self.index}"

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens a warm prefix cache holds already (earlier turns and answers)."""
        return len(self.prompt) - self.new_tokens


Submit = Callable[[SessionTurn], Awaitable[Sequence[int] | None]]


@dataclasses.dataclass(frozen=True)
class SessionPacing:
    """Where turns go in time and what is not sent.

    ``time_scale`` multiplies session arrivals and think times (1 when the reader scaled them
    already); ``late_s`` submits each turn that long after the arrival it is stamped with (a
    simulated replay reproducing the lateness of a busy real event loop's timers); ``max_len``
    ends a conversation whose next prompt + output would not fit the context; ``max_output``
    caps the tokens a turn asks for.
    """

    time_scale: float = 1.0
    late_s: float = 0.0
    max_len: int | None = None
    max_output: int | None = None

    def max_tokens(self, turn: Turn) -> int:
        n = max(1, turn.output_tokens)
        return min(n, self.max_output) if self.max_output else n


@dataclasses.dataclass(frozen=True)
class SessionEnd:
    """How far a session got: turns submitted, and why it stopped ("done", "failed" when its
    last submitted turn failed, "max_len" when the next turn would not fit the context)."""

    sent: int
    reason: str


async def run_session(session: Session, space: TokenSpace, submit: Submit, clock: Clock,
                      start: float, pacing: SessionPacing = SessionPacing(),
                      scheduled: Callable[[SessionTurn], None] | None = None) -> SessionEnd:
    """Walks one session's turns closed loop from ``start`` on ``clock``; ``scheduled`` hears of
    each turn as soon as its arrival is fixed, before the wait for it (a replay cut short at a
    deadline still knows when the turn it was waiting for was due)."""
    prompt: list[int] | None = None
    answer: Sequence[int] | None = None
    t = start + session.arrival_s * pacing.time_scale
    for k, turn in enumerate(session.turns):
        if k:
            t = clock.now() + turn.think_s * pacing.time_scale
        prompt = session.prompt_ids(k, space, prompt, answer)
        out = pacing.max_tokens(turn)
        if pacing.max_len is not None and len(prompt) + out > pacing.max_len:
            return SessionEnd(k, "max_len")  # the conversation outgrew the context
        new = min(session.new_tokens(k), len(prompt))
        planned = SessionTurn(session, k, prompt, t, out, new)
        if scheduled is not None:
            scheduled(planned)
        await clock.sleep(t + pacing.late_s - clock.now())
        answer = await submit(planned)
        if answer is None:
            return SessionEnd(k + 1, "failed")
    return SessionEnd(len(session.turns), "done")


async def run_sessions(trace: SessionTrace, submit: Submit, clock: Clock,
                       pacing: SessionPacing = SessionPacing()) -> list[SessionEnd]:
    """Every session of ``trace`` at once, arrivals counted from now; ends in session order."""
    start = clock.now()
    return list(await asyncio.gather(*(run_session(s, trace.token_space, submit, clock, start,
                                                   pacing) for s in trace.sessions)))
