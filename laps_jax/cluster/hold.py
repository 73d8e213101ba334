"""Late binding of long requests: the router holds a long request while every instance already
has enough work that would run ahead of it, and sends it when one drains (`--hold-tokens` on the
network router, on by default with laps-inflow; `+hold` in the simulator's screens: 0.87x /
0.60x / 0.60x laps-inflow's misses in light / medium / heavy cells, docs/SIMULATION.md; live
on two CPU instances 0.87x on overloaded code completion over 24 rounds, level at lighter
loads and on code-chat: docs/BENCHMARKS.md).

Why: a long request bound to an instance on arrival waits there even when another instance
drains first, and which one drains first is not known on arrival. Held in the router, it is
bound only when some instance has less than the hold of work ahead of it, to the instance the
policy picks among those. A long request that finds such room on arrival is not held, and the
policy places it among every instance, as bound on arrival: confined to the instances with
room, each one went where the only pending work was one larger request (which it overtakes),
and long work piled up on that instance (simulated agent-fanout, 4 and 8 instances at load
1.3, 25 seeds: 88 misses confined, 66 placed among all, 58 bound on arrival). "Ahead" is
what the instance will run first: its short work and the long work smaller than this request,
since every instance runs the least remaining first. So a long request smaller than
everything pending goes at once (it would overtake that work anyway).
Short requests, and long ones no larger than the hold (about one step's work), are never held:
they wait at most a step or two wherever they go. Nor is a turn whose cached history is at least
as long as its new part: its holder is where it belongs, as the policy weighs it, and sent
wherever room opened first it would compute that history again (holding such turns too did not
gain live on code-chat: 0.97x, 1.04x, 1.16x and 1.07x laps-inflow's misses in four runs).
Holding every request on whatever was pending cost light loads more than it won, and holding
requests just over the short threshold lost live on the CPU, where they are most of the long
ones (docs/SIMULATION.md, "Late binding"). Ray Serve's request router binds late too, with its
per-replica cap on ongoing requests. What it costs: a held request pays one more hop when it is
released.

The order among held requests: fewest new tokens first, each credited `aging` tokens per
second held (the instances' pools order their work the same way). With TTFT targets that grow
with a request's length, as the benchmark's (5x its isolated TTFT), that is earliest deadline
first. Only the first in that order is looked at: a later one that might fit does not pass it.

One request is released at a time: it is picked and counted on its instance (the router's
`LoadBook`, the simulator's pending list) before the next is considered, so two releases never
see the same free space.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

RECHECK_S = 0.05  # held requests are looked at again this often (also on every first token)
AGING_TOKENS_PER_S = 1000.0  # a held request's credit per second held (both routers')


def holds(new: int, cached: int, short: bool, within_hold: bool) -> bool:
    """Whether the hold keeps a request of `new` tokens to compute with `cached` tokens of its
    prompt cached at its best instance: the rule of the module docstring, the one both routers
    apply (each measures `short` and `within_hold` in its own units: tokens or seconds)."""
    return not short and not within_hold and cached < new


def held_counts(q: "HoldQueue | None") -> tuple[int, float]:
    """Requests that waited in `q` so far and the seconds the released ones waited ((0, 0.0)
    without a hold): what both routers report."""
    return (q.held_total, q.held_s_total) if q is not None else (0, 0.0)


class HoldFull(Exception):
    """`max_held` requests are held already (the router answers 503 with Retry-After)."""


@dataclasses.dataclass(eq=False)
class Held:
    tokens: int
    since: float
    released: asyncio.Future


class HoldQueue:
    """Requests held in the router until `can_send(tokens)`: some instance has less than the
    hold of work ahead of a request of `tokens` new tokens (or none is available at all, which
    the caller then answers with 503). `now` is the caller's clock (the simulator's is
    virtual)."""

    def __init__(self, can_send: Callable[[int], bool], aging_tokens_per_s: float, max_held: int,
                 now: Callable[[], float] = time.monotonic, recheck_s: float = RECHECK_S):
        self.can_send, self.aging, self.max_held = can_send, aging_tokens_per_s, max_held
        self.now, self.recheck_s = now, recheck_s
        self.held: list[Held] = []
        self.releasing = False  # one released request is being sent
        self.held_total = 0  # requests that waited here, and the seconds the released ones did
        self.held_s_total = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def score(self, h: Held, now: float) -> float:
        return h.tokens - self.aging * (now - h.since)

    async def turn(self, tokens: int) -> bool:
        """Returns when a request of `tokens` new tokens may be sent: True if it was held
        (then the caller sends it only to an instance with room), False if it goes at once
        (then wherever the policy picks). The caller sends it (its pick and `LoadBook.sent`
        with no await between) and then calls `sent()`. HoldFull when `max_held` requests
        are held already."""
        if not self.held and not self.releasing and self.can_send(tokens):
            self.releasing = True
            return False
        if len(self.held) >= self.max_held:
            raise HoldFull(f"every instance is busy and {self.max_held} requests wait in the "
                           f"router; retry shortly")
        h = Held(max(int(tokens), 0), self.now(),
                 asyncio.get_running_loop().create_future())
        self.held.append(h)
        try:
            self.kick()
            if h.released.done():  # released at once
                return False
            self.held_total += 1
            await h.released
            self.held_s_total += self.now() - h.since
            return True
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
        """Releases the first held request if it may go now; else looks again in `recheck_s`."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.releasing or not self.held:
            return
        now = self.now()
        h = min(self.held, key=lambda x: (self.score(x, now), x.since))
        if not self.can_send(h.tokens):
            self._timer = asyncio.get_running_loop().call_later(self.recheck_s, self.kick)
            return
        self.held.remove(h)
        self.releasing = True
        h.released.set_result(None)
