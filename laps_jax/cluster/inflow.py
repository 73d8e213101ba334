"""The long work a router has lately sent each instance, for `laps-inflow`'s predicted finish.

On a laps instance the long pool runs the least remaining first, so a long request waits not
only for the smaller long work pending when it arrives but for the smaller work that arrives
while it waits. Deep in a queue that second part is most of the wait: on the simulated H200's
overloaded code-chat, laps's predicted finish for a request under 2,000 new tokens was a third
of its real one (docs/SIMULATION.md, "Routers on the trace family"). The router sees that
inflow as it routes: the work of each long request it sent to an instance in the last
`window_s`. Its rate, in seconds of work per second (`rho`), stretches the predicted finish
by 1 / (1 - rho), as queueing theory has it for a job that everything smaller overtakes.

Only the router's own decisions count, so it needs no new number from the instances; in load
units other than seconds (the network router's tokens) the caller converts with each
instance's measured seconds per unit (`cluster/pace.py`).
"""

from __future__ import annotations

import collections
import dataclasses

WINDOW_S = 5.0   # the inflow counted (the groups' own window; 2.5 s screened alike, 10 s
                 # lost the overloaded code-chat cells: 1.11x prefix against 0.83x)
MAX_RHO = 0.9    # the stretch is capped at 10x: past it the rate says "saturated", no more


@dataclasses.dataclass
class RecentLongWork:
    """Long requests routed lately: (time, instance, work in load units)."""

    window_s: float = WINDOW_S
    items: collections.deque = dataclasses.field(default_factory=collections.deque)

    def record(self, now: float, instance: int, work: float) -> tuple:
        """Counts `work` sent to `instance` now; returns the record, for `withdraw`."""
        item = (now, instance, work)
        self.items.append(item)
        self._forget(now)
        return item

    def withdraw(self, item: tuple) -> None:
        """Uncounts a record whose request left that instance for another (the instance
        failed); one already forgotten is left alone."""
        try:
            self.items.remove(item)
        except ValueError:
            pass

    def _forget(self, now: float) -> None:
        while self.items and self.items[0][0] < now - self.window_s:
            self.items.popleft()

    def rho(self, instance: int, at_most: float, now: float, unit_s: float) -> float:
        """The share of `instance`'s time the long work no larger than `at_most` sent to it
        in the last window takes (work in load units of `unit_s` seconds each)."""
        self._forget(now)
        work = sum(w for t, i, w in self.items if i == instance and w <= at_most)
        return work * unit_s / self.window_s


def stretch(rho: float) -> float:
    """How much longer a wait gets when `rho` of the instance's time goes to work that
    overtakes it (1 / (1 - rho), capped)."""
    return 1.0 / (1.0 - min(max(rho, 0.0), MAX_RHO))
