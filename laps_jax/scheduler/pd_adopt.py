"""Decode side of the prefill/decode split: a request whose prefill ran on another instance.

`Adopter.adopt` reserves pages for the prompt under the same admission rule as any request
(waiting for pages up to `ROOM_WAIT` of `timeout_s`, woken by every release), pulls the
offered K/V into them, registers them in its prefix cache, and decodes from the first token
on. Any failure ends the request with an error and frees what it held.

Pulls are bounded: a pull whose offer is gone never returns on its own (it blocks until the
peer's process exits, `engine/kv_remote.py`), so its thread may be lost until then. Each pull
runs on a thread of its own, at most `PULLS_PER_PEER` at once per peer (a stuck peer holds
its own slots and nobody else's), and at most `MAX_THREADS` pull threads live at once, stuck
ones included: beyond that a pull fails at once. A peer where nothing listens fails at once
(`kv_remote`'s connect check). JAX-free: engine calls go through the executor's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from laps_jax.engine.sequence import SamplingParams, Status, TokenLogprobs
from laps_jax.scheduler.pd import NoRoom
from laps_jax.scheduler.request import Request, RequestHandle

log = logging.getLogger(__name__)
PULLS_PER_PEER = 2  # pulls from one prefill peer at once
MAX_THREADS = 16    # pull threads alive at once, stuck ones included
ROOM_WAIT = 0.75    # share of --pd-timeout a decode leg waits for pages before its 503


class PeerBusy(Exception):
    """Every pull thread of that peer is taken (stuck on offers that are gone, or busy)."""


class Adopter:
    """Decode side: takes requests whose prefill ran elsewhere."""

    def __init__(self, dispatcher, remote, timeout_s: float):
        self.dispatcher, self.remote, self.timeout_s = dispatcher, remote, timeout_s
        self.lane = dispatcher.lanes[0]
        self.peers: dict[str, asyncio.Semaphore] = {}  # a slot per pull in flight
        self.threads = 0  # pull threads alive

    async def adopt(self, prompt: list[int], params: SamplingParams, first: TokenLogprobs,
                    offer, finish_reason: str | None = None) -> RequestHandle:
        """Pulls `offer` into pages reserved here and decodes on from `first`. Returns once
        the K/V is in place (or the request failed: its handle then ends with the error).
        Without an offer the first token ended the request (`finish_reason`): it is answered
        with that token alone. Raises NoRoom (nothing held) when pages stay taken."""
        d = self.dispatcher
        r = d.register(list(prompt), params)
        stats, now = r.stats, r.stats.submitted
        r.lane, stats.lane = self.lane, self.lane.name
        if offer is None:
            r.seq.output.append(first.token_id)
            r.seq.logprobs.append(first)
            r.seq.finish_reason, r.seq.status = finish_reason, Status.FINISHED
            self.lane._deliver(r, now)
            return r.handle
        self.lane.moving.add(r)  # an abort meanwhile leaves the pages to us
        try:
            await self._reserve(r)
        except NoRoom:
            self.lane.moving.discard(r)
            r.aborted = True
            self.lane._finish(r, "abort")
            raise
        try:
            await self._pull(r, first, offer)
        except Exception as e:  # noqa: BLE001 - answered as this request's error
            self.lane.moving.discard(r)
            why = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            await self.lane._fail([r], "error", f"KV pull failed: {why}")  # wakes the lane
            return r.handle
        self.lane.moving.discard(r)
        if r.aborted:
            await self.lane.release([r.seq], "abort")
            return r.handle
        stats.admitted = stats.prefill_done = d.clock.now()
        stats.cached_tokens = r.seq.cached_tokens
        self.lane._deliver(r, d.clock.now())  # the first token (sampled on the prefill side)
        self.lane.decoding.append(r)
        self.lane.wake.set()
        return r.handle

    async def _reserve(self, r: Request) -> None:
        """Pages for the prompt (reusing cached history) under the admission rule, waiting
        for a release while they are taken: fits-and-admit runs on the engine thread in one
        go, so the lane's own admission cannot take them in between."""
        ex, seq = self.lane.executor, r.seq
        # the offer must outlive the wait and the pull: it was made a moment before this leg
        deadline = time.monotonic() + self.timeout_s * ROOM_WAIT
        while not await ex.admit([seq]):
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoRoom("no room: the KV pages this request needs stay taken")
            await self.lane.wait_for_pages(left)
        if seq.error is not None:
            raise RuntimeError(seq.error)

    def _slots(self, address: str) -> asyncio.Semaphore:
        # (addresses come from legs that carried the split's secret: the router's peers)
        return self.peers.setdefault(address, asyncio.Semaphore(PULLS_PER_PEER))

    async def _fetch(self, ex, offer):
        """The offered K/V, pulled on a thread of its own: at most PULLS_PER_PEER at once
        per peer, and at most MAX_THREADS alive (a pull of an offer that is gone never
        returns until its peer exits: such threads count until then, and beyond the cap
        every pull fails at once instead of piling up)."""
        if self.threads >= MAX_THREADS:
            raise PeerBusy(f"{self.threads} KV pulls are still waiting for offers that are "
                           f"gone (they end when those peers exit)")
        slots = self._slots(offer.address)
        try:
            await asyncio.wait_for(slots.acquire(), self.timeout_s / 2)
        except TimeoutError:
            raise PeerBusy(f"every pull from {offer.address} is taken") from None
        loop = asyncio.get_running_loop()
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                result, err = self.remote.pull(ex.engine, offer), None
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                result, err = None, e
            try:
                loop.call_soon_threadsafe(self._thread_ended)
            except RuntimeError:  # the loop is closed: the process is exiting
                return
            if done.set_running_or_notify_cancel():  # False: the waiter gave up
                done.set_exception(err) if err is not None else done.set_result(result)

        self.threads += 1
        threading.Thread(target=run, name="laps-pull", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self.timeout_s)
        finally:
            slots.release()

    def _thread_ended(self) -> None:
        self.threads -= 1

    async def _pull(self, r: Request, first: TokenLogprobs, offer) -> None:
        from laps_jax.engine import kv_remote  # JAX: only on an instance that runs one
        ex, seq = self.lane.executor, r.seq
        try:
            data = await self._fetch(ex, offer)
            await ex.call(kv_remote.place, ex.engine, seq, data)
        except BaseException:
            self.remote.forget(offer.address)
            raise
        seq.num_computed = len(seq.prompt)
        seq.status = Status.DECODE
        seq.output.append(first.token_id)
        seq.logprobs.append(first)

    async def close(self) -> None:
        self.peers.clear()  # pull threads are daemons: a stuck one does not hold the exit
