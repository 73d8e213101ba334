"""Clocks the dispatcher runs on: wall time, or virtual time for simulation.

The dispatcher only ever asks a `Clock` for the time and waits through it, so the same pool,
window and dispatch code runs on the device (`RealClock`) and in a discrete-event simulation
(`SimClock` under `run_simulated`, where asyncio's own timers run on virtual time: a sleep of an
hour returns at once, but in the right order relative to every other timer).
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Awaitable, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock's time line."""

    async def sleep(self, seconds: float) -> None:
        """Waits `seconds` on this clock."""

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        """Waits for `event` at most `timeout` seconds; True if it was set."""


class _LoopClock:
    """Shared by both clocks: asyncio primitives over the running loop's time."""

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))

    async def wait(self, event: asyncio.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        if timeout is not None and timeout <= 0:
            return False
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class RealClock(_LoopClock):
    """Monotonic wall time (the default asyncio loop uses the same clock for its timers)."""

    def now(self) -> float:
        return time.monotonic()


class SimClock(_LoopClock):
    """Virtual time: the time of a loop made by `run_simulated`."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()


class ManualClock:
    """A clock a test moves by hand, for code that only reads the time (pool and window logic)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: when nothing is ready, jumps virtual time to the next timer instead."""

    def __init__(self):
        super().__init__()
        self.virtual_time = 0.0

    def select(self, timeout=None):
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("simulation deadlock: every task waits and no timer is pending")
        self.virtual_time += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time() is virtual and advances only when every task waits.

    asyncio runs a timer up to its clock resolution (1 ns) early, and jumps time to a timer
    only when nothing else is ready. So a waiter that woke early and asked again to wait until
    the same instant, beside other tasks that are always ready, never saw time move: eight
    simulated instances spun at one virtual instant (a rag-docs route screen, seed 4) until
    killed. Here a timer that fires moves virtual time to its due time first."""

    def __init__(self):
        self._vsel = _VirtualSelector()
        super().__init__(self._vsel)

    def time(self) -> float:
        return self._vsel.virtual_time

    def call_at(self, when, callback, *args, context=None):
        def at_due_time(*a):
            if when > self._vsel.virtual_time:
                self._vsel.virtual_time = when
            callback(*a)
        return super().call_at(when, at_due_time, *args, context=context)


def run_simulated(main: Awaitable[T]) -> T:
    """Runs a coroutine on a `VirtualTimeLoop` (use `SimClock` and a simulated executor)."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
