"""KV hand-off between processes: a prefilled sequence's pages offered on JAX's transfer
server (`jax.experimental.transfer`) and pulled by another instance into pages it reserved.

The prefill side gathers the sequence's pages (only those holding its tokens, in the copy
bucket `KVTransfer` already compiles) and offers the copy under a random uuid with
`await_pull`; it keeps the pages themselves pinned until the decode side says it has them (or a
deadline passes: the caller's business). The decode side connects to the offering server
(one connection per peer address, kept) and pulls arrays of the same bucket shape, then
scatters them with `KVTransfer.import_`. The descriptor that travels between the two
(`Offer.to_json`) is plain JSON: address, uuid, page and token counts, the array shape and dtype.

Found on jax 0.10.2's CPU backend (two processes): a pull of a live offer works; `await_pull`'s
timeout drops the offer, but a pull whose offer is gone (or never came) blocks until the
peer's process exits, whatever `pull`'s own timeout says. So the puller bounds the wait itself
(`scheduler/pd_adopt.py`) and the offerer passes its deadline to `await_pull` so the copy is
dropped. A pull from an address where nothing listens blocks the same way: `pull` first opens a
plain TCP connection there (`CONNECT_TIMEOUT_S`), so a dead peer fails at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import secrets
import socket
import threading

import jax
from jax.experimental import transfer as jax_transfer

from laps_jax.engine.kv_transfer import KVPages, export_sequence
from laps_jax.engine.sequence import Sequence

CONNECT_TIMEOUT_S = 2.0
MAX_UUID = 1 << 62


@dataclasses.dataclass
class Offer:
    """What the decode side needs to pull one sequence's K/V (the hand-off descriptor)."""

    address: str      # the offering transfer server
    uuid: int
    num_pages: int    # pages holding the sequence's tokens (the arrays are padded to a bucket)
    num_tokens: int
    shape: list[int]  # of K and of V: [layers, bucket pages, page_size, kv_heads, head_dim]
    dtype: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Offer":
        try:
            o = cls(str(d["address"]), int(d["uuid"]), int(d["num_pages"]),
                    int(d["num_tokens"]), [int(x) for x in d["shape"]], str(d["dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad KV hand-off descriptor: {type(e).__name__}: {e}") from None
        host, _, port = o.address.rpartition(":")
        if (len(o.shape) != 5 or o.num_pages < 1 or o.num_tokens < 1 or not host
                or not port.isdigit() or not 0 < int(port) < 65536
                or not 0 <= o.uuid < MAX_UUID):
            raise ValueError(f"bad KV hand-off descriptor: {str(d)[:300]}")
        return o


def expected_shape(engine, num_pages: int) -> tuple[list[int], str]:
    """The shape and dtype of the K (and V) arrays an offer of `num_pages` pages holds."""
    r = engine.runner
    return ([r.cfg.num_layers, engine.transfer.bucket(num_pages), r.page_size,
             r.cfg.num_kv_heads, r.cfg.head_dim], str(r.kv_dtype))


def _reachable(address: str) -> None:
    """Raises ConnectionError at once when nothing listens at `address` (a pull there would
    block until this process exits)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConnectionError(f"the transfer server at {address} is unreachable: {e}") from None


def _transport(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return f"{host}:0"


class RemoteKV:
    """One process's transfer server: offers pages to peers and pulls theirs."""

    def __init__(self, address: str = "127.0.0.1:0"):
        if ":" not in address:
            raise ValueError(f"--transfer-address must be HOST:PORT, got {address!r}")
        client = jax.devices()[0].client
        self.server = jax_transfer.start_transfer_server(
            client, address, [_transport(address)])
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.server.address()

    # -- prefill side (engine thread) -------------------------------------------------------
    def offer(self, engine, seq: Sequence, timeout_s: float) -> Offer:
        """Gathers `seq`'s computed tokens' pages and offers the copy for `timeout_s` seconds."""
        data = export_sequence(engine, seq)
        uuid = secrets.randbits(62)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self.server.await_pull(uuid, [data.k, data.v], timeout=deadline)
        return Offer(self.address, uuid, data.num_pages, data.num_tokens,
                     list(data.k.shape), str(data.k.dtype))

    # -- decode side ----------------------------------------------------------------------
    def _conn(self, address: str):
        with self._lock:
            if address not in self._conns:
                self._conns[address] = self.server.connect(address)
            return self._conns[address]

    def forget(self, address: str) -> None:
        """Drops a peer's connection (after a failed pull: the peer may have restarted)."""
        with self._lock:
            self._conns.pop(address, None)

    def pull(self, engine, offer: Offer) -> KVPages:
        """The offered K/V, on this engine's device (blocks; run it off the engine thread)."""
        r = engine.runner
        want, dtype = expected_shape(engine, offer.num_pages)
        if offer.shape != want or offer.dtype != dtype:
            raise ValueError(f"the offered K/V is {offer.dtype}{offer.shape}, this engine "
                             f"holds {r.kv_dtype}{want}: both instances need the same model, "
                             f"--dtype, --page-size and --max-model-len")
        sharding = jax.tree.leaves(r.k_cache)[0].sharding
        spec = jax.ShapeDtypeStruct(tuple(want), r.kv_dtype, sharding=sharding)
        _reachable(offer.address)
        k, v = self._conn(offer.address).pull(offer.uuid, [spec, spec])
        jax.block_until_ready((k, v))
        return KVPages(k, v, offer.num_pages, offer.num_tokens)


def place(engine, seq: Sequence, data: KVPages) -> None:
    """Writes pulled K/V into `seq`'s reserved pages (not the prefix it found cached here)
    and registers the full blocks in the prefix cache, so a follow-up turn finds them."""
    pages = seq.pages
    engine.transfer.import_(pages.pages, data, skip=pages.cached_len // engine.kv.page_size)
    engine.kv.commit(pages, seq.prompt[:data.num_tokens])


__all__ = ["Offer", "RemoteKV", "expected_shape", "place"]
