"""Shutdown with a deadline: drain what is in flight, then end whatever is still running.

After SIGTERM the server answers 503 to new requests and lets the ones in flight finish for
`--shutdown-timeout` seconds. Past that it aborts them: each stream still open gets its last
chunk (finish_reason "abort") and `[DONE]`, each whole response its answer, and the process
exits. A step that never returns (a hung device) cannot hold the exit either: the engine gets
`GRACE_S` to stop, the HTTP connections the runner's `shutdown_timeout` (`make_runner`: the
same 5 s) to close.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web

from laps_jax.server.state import ServerState
from laps_jax.server.http_runner import SHUTDOWN_GRACE_S

GRACE_S = SHUTDOWN_GRACE_S  # after the deadline: for the engine to stop


async def shut_down(state: ServerState, dispatcher, runner: web.BaseRunner, timeout_s: float,
                    log: Callable[[str], None]) -> None:
    loop = asyncio.get_running_loop()
    state.draining = True
    deadline = loop.time() + max(timeout_s, 0.0)
    while state.live and loop.time() < deadline:
        await asyncio.sleep(0.05)
    drain = not state.live
    if not drain:
        log(f"shutdown timeout ({timeout_s:g} s) reached: aborting {state.live} requests "
            f"still running")
    try:  # abort (not drain) frees every request now; its handler sends the end of it
        await asyncio.wait_for(dispatcher.stop(drain=drain), GRACE_S)
    except TimeoutError:
        log(f"the engine did not stop within {GRACE_S:g} s; exiting without it")
    await runner.cleanup()  # waits at most the runner's shutdown_timeout for open handlers
