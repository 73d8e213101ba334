"""Prefill/decode disaggregation across processes: the two halves of one request.

A *prefill* instance runs the request's prefill as any other (LAPS pools, first token sampled),
then, instead of decoding, offers its K/V pages on the process's transfer server
(`engine/kv_remote.py`) and finishes the request with the offer as its result; the pages stay
pinned (`Offers.held`) until the decode side says it has them (`release`) or `timeout_s`
passes. A *decode* instance adopts the request (`adopt`): reserves pages for the prompt under
the same admission rule as any request, pulls the offered K/V into them (bounded by
`timeout_s`: a pull whose offer is gone never returns on its own), registers them in its prefix
cache, and decodes from the first token on. Any failure ends the request with an error and
frees what it held. JAX-free: the engine calls go through the executor's worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time

from laps_jax.engine.sequence import SamplingParams, Status, TokenLogprobs
from laps_jax.scheduler.request import Request, RequestHandle

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")


@dataclasses.dataclass
class PDConfig:
    role: str = "both"
    transfer_address: str = "127.0.0.1:0"
    timeout_s: float = 30.0  # an offer nobody pulls, or a pull that does not come, ends here


def add_args(g) -> None:
    d = PDConfig()
    g.add_argument("--role", choices=ROLES, default=d.role,
                   help="both: prefill and decode here (default); prefill: also offer a "
                        "request's KV pages to a decode instance when asked (the router's "
                        "--prefill); decode: also take requests prefilled elsewhere (--decode). "
                        "prefill and decode start a JAX transfer server")
    g.add_argument("--transfer-address", default=d.transfer_address, metavar="HOST:PORT",
                   help="where the transfer server listens (default 127.0.0.1:0: loopback, "
                        "any free port; use this machine's address for a peer elsewhere)")
    g.add_argument("--pd-timeout", type=float, default=d.timeout_s,
                   help="seconds an offered KV copy waits for its pull, and a pull for its "
                        f"data, before the pages are freed (default {d.timeout_s:g})")


def from_args(args) -> PDConfig:
    if args.pd_timeout <= 0:
        raise ValueError("--pd-timeout must be positive")
    return PDConfig(args.role, args.transfer_address, args.pd_timeout)


@dataclasses.dataclass
class Held:
    request: Request
    deadline: float


class Offers:
    """Prefill side: requests whose K/V is offered, their pages pinned until released."""

    def __init__(self, dispatcher, remote, timeout_s: float):
        self.dispatcher, self.remote, self.timeout_s = dispatcher, remote, timeout_s
        self.lane = dispatcher.lanes[0]
        self.held: dict[int, Held] = {}
        self._tasks: set[asyncio.Task] = set()
        self.lane.handoff = self._hook

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hook(self, r: Request) -> bool:
        if not r.pd_offer:
            return False  # an ordinary request decodes here
        self.lane.moving.add(r)
        self._spawn(self._offer(r))
        return True

    async def _offer(self, r: Request) -> None:
        ex = self.lane.executor
        try:
            offer = await ex.call(self.remote.offer, ex.engine, r.seq, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - this request fails, nothing else
            log.exception("KV offer of %s failed", r.stats.request_id)
            self.lane.moving.discard(r)
            await self.lane._fail([r], "error", f"KV offer failed: {type(e).__name__}: {e}")
            return
        self.lane.moving.discard(r)
        if r.aborted:  # the client left while the copy was made
            await ex.release([r.seq], "abort")
            return
        r.handoff = offer.to_json()
        self.held[offer.uuid] = Held(r, time.monotonic() + self.timeout_s)
        self.lane._finish(r, "handoff")  # answered; the pages stay pinned until release
        self._spawn(self._expire(offer.uuid))

    async def _expire(self, uuid: int) -> None:
        await asyncio.sleep(self.timeout_s)
        if uuid in self.held:
            log.warning("KV offer %d was not released within %g s: pages freed", uuid,
                        self.timeout_s)
            await self.release(uuid)

    async def release(self, uuid: int) -> bool:
        """Frees an offered request's pages (they stay in the prefix cache); False if unknown."""
        held = self.held.pop(uuid, None)
        if held is None:
            return False
        await self.lane.executor.release([held.request.seq], "handoff")
        return True

    async def close(self) -> None:
        for uuid in list(self.held):
            await self.release(uuid)


class Adopter:
    """Decode side: takes requests whose prefill ran elsewhere."""

    def __init__(self, dispatcher, remote, timeout_s: float):
        self.dispatcher, self.remote, self.timeout_s = dispatcher, remote, timeout_s
        self.lane = dispatcher.lanes[0]
        # pulls block until their data comes (or the peer exits): never on the engine thread
        self._pulls = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="laps-pull")

    async def adopt(self, prompt: list[int], params: SamplingParams, first: TokenLogprobs,
                    offer, finish_reason: str | None = None) -> RequestHandle:
        """Pulls `offer` into pages reserved here and decodes on from `first`. Returns once
        the K/V is in place (or the request failed: its handle then ends with the error).
        Without an offer the first token ended the request (`finish_reason`): it is answered
        with that token alone."""
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
            await self._pull(r, first, offer)
        except Exception as e:  # noqa: BLE001 - answered as this request's error
            self.lane.moving.discard(r)
            why = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            await self.lane._fail([r], "error", f"KV pull failed: {why}")
            return r.handle
        self.lane.moving.discard(r)
        if r.aborted:
            await self.lane.executor.release([r.seq], "abort")
            return r.handle
        stats.admitted = stats.prefill_done = d.clock.now()
        stats.cached_tokens = r.seq.cached_tokens
        self.lane._deliver(r, d.clock.now())  # the first token (sampled on the prefill side)
        self.lane.decoding.append(r)
        self.lane.wake.set()
        return r.handle

    async def _pull(self, r: Request, first: TokenLogprobs, offer) -> None:
        from laps_jax.engine import kv_remote  # JAX: only on an instance that runs one
        ex, seq = self.lane.executor, r.seq
        if not ex.admission.fits(seq):
            raise RuntimeError("no room: the KV pages this request needs are taken")
        await ex.call(ex.engine.admit, seq)  # pages (reusing cached history), its seeded rng
        ex.admission.live.append(seq)
        loop = asyncio.get_running_loop()
        try:
            data = await asyncio.wait_for(loop.run_in_executor(
                self._pulls, self.remote.pull, ex.engine, offer), self.timeout_s)
            await ex.call(kv_remote.place, ex.engine, seq, data)
        except BaseException:
            self.remote.forget(offer.address)
            raise
        seq.num_computed = len(seq.prompt)
        seq.status = Status.DECODE
        seq.output.append(first.token_id)
        seq.logprobs.append(first)

    async def close(self) -> None:
        self._pulls.shutdown(wait=False, cancel_futures=True)
