"""Late binding: the router holds a request while every instance already has enough prefill
pending, and sends it when one drains (`--hold-tokens`, experimental, off by default).

Why: a request bound to an instance on arrival waits there even when another instance drains
first, and which one drains first is not known on arrival (on the CPU bench three instances
share two cores, so which one runs fast changes faster than a load report or a measured pace
can follow: docs/BENCHMARKS.md, "Router"). Held in the router, a request is bound only
when some instance's pending prefill falls below `hold_tokens`, to the instance the policy
picks among those. Ray Serve's request router does the same with its per-replica cap on
ongoing requests. What it costs: the instances batch less (each sees at most about
`hold_tokens` of prefill at once) and a held request pays one more hop when it is released.

The order among held requests: fewest prompt tokens first, each credited `aging` tokens per
second held (the instances' pools order their work the same way). With TTFT targets that grow
with a request's length, as the benchmark's (5x its isolated TTFT), that is earliest deadline
first.

One request is released at a time: it is picked and counted on its instance (the router's
`LoadBook`) before the next is considered, so two releases never see the same free space.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

RECHECK_S = 0.05  # held requests are looked at again this often (also on every first token)


class HoldFull(Exception):
    """`max_held` requests are held already (the router answers 503 with Retry-After)."""


@dataclasses.dataclass(eq=False)
class Held:
    tokens: int
    since: float
    released: asyncio.Future


class HoldQueue:
    """Requests held in the router until `can_send()` (some instance below the hold, or none
    available at all, which the caller then answers with 503)."""

    def __init__(self, can_send: Callable[[], bool], aging_tokens_per_s: float, max_held: int):
        self.can_send, self.aging, self.max_held = can_send, aging_tokens_per_s, max_held
        self.held: list[Held] = []
        self.releasing = False  # one released request is being sent
        self._timer: asyncio.TimerHandle | None = None

    def score(self, h: Held, now: float) -> float:
        return h.tokens - self.aging * (now - h.since)

    async def turn(self, tokens: int) -> None:
        """Returns when a request of `tokens` prompt tokens may be sent; the caller sends it (its
        pick and `LoadBook.sent` with no await between) and then calls `sent()`. HoldFull when
        `max_held` requests are held already."""
        if not self.held and not self.releasing and self.can_send():
            self.releasing = True
            return
        if len(self.held) >= self.max_held:
            raise HoldFull(f"every instance is busy and {self.max_held} requests wait in the "
                           f"router; retry shortly")
        h = Held(max(int(tokens), 0), time.monotonic(),
                 asyncio.get_running_loop().create_future())
        self.held.append(h)
        try:
            self.kick()
            await h.released
        except BaseException:  # the client went away (cancelled) while held or just released
            if h in self.held:
                self.held.remove(h)
            elif h.released.done():
                self.sent()
            raise

    def sent(self) -> None:
        """The released request was sent (or given up): the next may go."""
        self.releasing = False
        self.kick()

    def kick(self) -> None:
        """Releases the first held request if it may go now; else looks again in RECHECK_S."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.releasing or not self.held:
            return
        if not self.can_send():
            self._timer = asyncio.get_running_loop().call_later(RECHECK_S, self.kick)
            return
        now = time.monotonic()
        h = min(self.held, key=lambda x: (self.score(x, now), x.since))
        self.held.remove(h)
        self.releasing = True
        h.released.set_result(None)
