"""Prefill/decode disaggregation across processes: the two halves of one request.

A *prefill* instance runs the request's prefill as any other (LAPS pools, first token sampled),
then, instead of decoding, offers its K/V pages on the process's transfer server
(`engine/kv_remote.py`) and finishes the request with the offer as its result; the pages stay
pinned (`Offers.held`) until the decode side says it has them (`release`) or `timeout_s`
passes. Prefill legs and their offers together may pin at most `max_pinned` of the pool
(`Offers.wait_room`): a leg beyond it waits for pages, then is refused, so a flood of legs that
nobody pulls cannot starve ordinary requests. Every release wakes the lane (`Lane.release`).
The decode side is `pd_adopt.py`. JAX-free: engine calls go through the executor's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from laps_jax.engine.sequence import Status
from laps_jax.scheduler.request import Request

log = logging.getLogger(__name__)
ROLES = ("both", "prefill", "decode")


@dataclasses.dataclass
class PDConfig:
    role: str = "both"
    transfer_address: str = "127.0.0.1:0"
    timeout_s: float = 30.0  # an offer nobody pulls, or a pull that does not come, ends here
    max_pinned: float = 0.5  # share of the KV pool prefill legs and their offers may hold
    secret_file: str | None = None  # where the split's shared secret is (pd_secret.py)


def add_args(g) -> None:
    d = PDConfig()
    g.add_argument("--role", choices=ROLES, default=d.role,
                   help="both: prefill and decode here (default); prefill: also offer a "
                        "request's KV pages to a decode instance when asked (the router's "
                        "--prefill); decode: also take requests prefilled elsewhere (--decode). "
                        "prefill and decode start a JAX transfer server, and need the "
                        "split's secret (--pd-secret-file)")
    g.add_argument("--transfer-address", default=d.transfer_address, metavar="HOST:PORT",
                   help="where the transfer server listens (default 127.0.0.1:0: loopback, "
                        "any free port; use this machine's address for a peer elsewhere)")
    g.add_argument("--pd-timeout", type=float, default=d.timeout_s,
                   help="seconds an offered KV copy waits for its pull, and a pull for its "
                        f"data, before the pages are freed (default {d.timeout_s:g})")
    g.add_argument("--pd-max-pinned", type=float, default=d.max_pinned, metavar="FRACTION",
                   help="--role prefill: share of the KV pool that prefill legs and their "
                        "offers waiting for a pull may hold; a leg beyond it waits for pages "
                        "(up to --pd-timeout), then gets 503 with Retry-After, so ordinary "
                        f"requests always keep the rest (default {d.max_pinned:g})")
    g.add_argument("--pd-secret-file", default=d.secret_file, metavar="PATH",
                   help="--role prefill/decode: a file holding the secret the router and "
                        "every instance of the split share; legs and hand-offs without it "
                        "are refused (401). Else the LAPS_PD_SECRET environment variable, "
                        "else --api-key; with none of them a prefill or decode instance "
                        "refuses to start")


def from_args(args) -> PDConfig:
    if args.pd_timeout <= 0:
        raise ValueError("--pd-timeout must be positive")
    if not 0 < args.pd_max_pinned <= 1:
        raise ValueError("--pd-max-pinned must be in (0, 1]")
    return PDConfig(args.role, args.transfer_address, args.pd_timeout, args.pd_max_pinned,
                    args.pd_secret_file)


class NoRoom(Exception):
    """The split's pages are taken: the leg is refused (503 with Retry-After), nothing held."""


@dataclasses.dataclass
class Held:
    request: Request
    deadline: float


class Offers:
    """Prefill side: requests whose K/V is offered, their pages pinned until released."""

    def __init__(self, dispatcher, remote, timeout_s: float, max_pinned: float = 0.5):
        self.dispatcher, self.remote, self.timeout_s = dispatcher, remote, timeout_s
        self.lane = dispatcher.lanes[0]
        self.held: dict[int, Held] = {}
        self.legs: dict[Request, int] = {}  # prefill legs (running or held): their pages
        kv = self.lane.executor.engine.kv
        self.page_size = kv.page_size
        self.limit = max(1, int(max_pinned * (kv.num_pages - 1)))  # page 0 is nobody's
        self._tasks: set[asyncio.Task] = set()
        self.lane.handoff = self._hook

    def pinned_pages(self) -> int:
        """Pages the split's prefill legs hold or will hold: running ones, offered ones."""
        held = {h.request for h in self.held.values()}
        self.legs = {r: n for r, n in self.legs.items()
                     if (not r.done and not r.aborted) or r in held}
        return sum(self.legs.values())

    async def wait_room(self, prompt_len: int) -> int:
        """Waits (at most `timeout_s`) until a leg of `prompt_len` tokens fits under the pin
        limit; returns its pages for `track`. Raises NoRoom. A leg larger than the limit runs
        alone. The caller submits and tracks it with no await in between."""
        need = -(-(prompt_len + 1) // self.page_size)
        deadline = time.monotonic() + self.timeout_s
        while True:
            pinned = self.pinned_pages()
            if pinned + need <= self.limit or pinned == 0:
                return need
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoRoom(f"prefill legs hold {pinned} KV pages, the split's limit is "
                             f"{self.limit} (--pd-max-pinned); retry shortly")
            await self.lane.wait_for_pages(left)

    def track(self, r: Request, pages: int) -> None:
        self.legs[r] = pages

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hook(self, r: Request) -> bool:
        if not r.pd_offer:
            return False  # an ordinary request decodes here
        # it never decodes here: it reserves no growth (Admission counts unfinished ones), its
        # pages are freed by release() alone
        r.seq.status = Status.FINISHED
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
            await self.lane.release([r.seq], "abort")
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
        await self.lane.release([held.request.seq], "handoff")  # wakes what waits for pages
        return True

    async def close(self) -> None:
        for uuid in list(self.held):
            await self.release(uuid)
