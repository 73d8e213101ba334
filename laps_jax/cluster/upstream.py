"""What the network router knows of each instance behind it: health, load and routed blocks.

Plain bookkeeping, no I/O (the poller and the proxy in http_router.py feed it), so it is tested
without processes.

- `LoadBook`: an instance's pending prefill tokens as the router counts them: its own
  requests from sending until their first token comes back, plus what the instance's last
  report (`laps_pending_prefill_tokens`, summed over its pools; a request not admitted yet
  counts in full, as pool "admission") holds beyond the router's own work.
- `BlockIndex`: the chained hashes of the full token blocks of every prompt routed to an
  instance, hashed as the engine hashes its prefix cache (`engine.kv_cache.block_hash`, the
  instance's block size), least recently used first out past the instance's block count, as
  the engine evicts. `cached_prefixes` turns the indexes into the "cached prefix of this prompt
  on each instance" that the routing policy takes. `text_hashes` / `matched_blocks` do the same
  over a prompt's text, in blocks of bytes, when the router has no tokenizer.
- `parse_metrics`: the gauges of an instance's /metrics text the router reads (with the
  instance's own short/long threshold, `laps_short_threshold_tokens`, and long chunk,
  `laps_long_chunk_tokens`). `parse_load` reads the same gauges from serve.py's /load (JSON,
  with its health: one small read per poll instead of /health and /metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence as Seq

import numpy as np

from laps_jax.engine.kv_cache import block_hash, block_hash_bytes


class LoadBook:
    """Pending prefill tokens on one instance, as fresh as the router can know them.

    The router's own requests count from the moment it sends them until their first token
    comes back through it (`sent` gives a ticket, `prefilled` closes it): no poll in between,
    so a request that finished its prefill stops counting at once instead of up to a poll
    interval later (with 0.5 s polls and prefills of 20-300 ms, stale reports herded
    least-load routing onto the other instances). The instance's report adds what the router
    cannot see: work other clients sent (`foreign`: reported minus the router's own work still
    open when the poll began), and it caps the router's older open work, whose prefill the
    instance may have done without the router seeing a token yet (a non-streamed answer).
    """

    def __init__(self) -> None:
        self.reported = self.reported_short = 0.0
        self.foreign = self.foreign_short = 0.0
        self.poll_t = float("-inf")
        self._next = 0
        self._open: dict[int, tuple[float, int, bool]] = {}  # ticket -> sent at, tokens, short
        self._closed: list[tuple[float, float, int, bool]] = []  # sent at, closed at, ...

    def sent(self, tokens: int, now: float, short: bool = False) -> int:
        """The router sent a request with `tokens` new tokens (short or not) at `now`."""
        self._next += 1
        self._open[self._next] = (now, max(int(tokens), 0), short)
        return self._next

    def prefilled(self, ticket: int, now: float) -> None:
        """The request's first token came back (or it ended): its prefill no longer waits."""
        t = self._open.pop(ticket, None)
        if t is not None and t[0] < now:
            self._closed.append((t[0], now, t[1], t[2]))

    def report(self, pending_tokens: float, poll_started: float,
               pending_short: float | None = None) -> None:
        """The instance reported `pending_tokens` (of which `pending_short` in its short pool)
        in a poll sent at `poll_started`: the router's work open at that moment is in it."""
        self.reported = max(float(pending_tokens), 0.0)
        self.reported_short = min(max(float(pending_short or 0.0), 0.0), self.reported)
        p = poll_started
        mine = [(n, sh) for t, n, sh in self._open.values() if t < p]
        mine += [(n, sh) for t, c, n, sh in self._closed if t < p < c]
        self.foreign = max(self.reported - sum(n for n, _ in mine), 0.0)
        self.foreign_short = max(self.reported_short - sum(n for n, sh in mine if sh), 0.0)
        self.poll_t = max(self.poll_t, p)
        self._closed = [c for c in self._closed if c[1] > self.poll_t]

    def clear(self) -> None:
        self.reported = self.reported_short = self.foreign = self.foreign_short = 0.0
        self._open.clear()
        self._closed.clear()

    def _own(self, short_only: bool) -> tuple[float, float]:
        """The router's open work sent before / since the last poll began."""
        old = new = 0.0
        for t, n, sh in self._open.values():
            if short_only and not sh:
                continue
            if t < self.poll_t:
                old += n
            else:
                new += n
        return old, new

    @property
    def open_requests(self) -> int:
        """The router's requests here still waiting for their first token."""
        return len(self._open)

    @property
    def since_poll(self) -> int:
        return int(self._own(False)[1])

    @property
    def load(self) -> float:
        old, new = self._own(False)
        return new + min(old, self.reported) + self.foreign

    def ahead(self, tokens: int) -> float:
        """The part of `load` an instance runs before a long request of `tokens` new tokens:
        its short work and the router's own long requests no larger (every instance runs the
        least remaining first). Other clients' long work is left out: its sizes are unseen,
        and counted whole it could hold this router's requests for as long as they send."""
        smaller = sum(n for _, n, sh in self._open.values() if not sh and n <= tokens)
        return min(self.short_load + smaller, self.load)

    @property
    def short_load(self) -> float:
        """The part of `load` that is short work."""
        old, new = self._own(True)
        return min(new + min(old, self.reported_short) + self.foreign_short, self.load)


def prompt_hashes(tokens: Seq[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens` (at most `limit` blocks): the
    engine's `block_hash` of each block, with the tokens turned to bytes once (a conversion
    per block was most of the router's time on a 2,000-token prompt)."""
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    data = np.asarray(tokens[:n * block_size], dtype="<i4").tobytes()
    step, out, parent = 4 * block_size, [], b""
    for start in range(0, n * step, step):
        parent = block_hash_bytes(parent, data[start:start + step])
        out.append(parent)
    return out


class BlockIndex:
    """The block hashes routed to one instance, at most `capacity` (None: no bound)."""

    def __init__(self, block_size: int, capacity: int | None = None):
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size, self.capacity = block_size, capacity
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def add(self, tokens: Seq[int]) -> None:
        """Records the full blocks of a prompt sent to the instance (they are the most recently
        used: a prefix shared with older prompts is refreshed)."""
        self.add_hashes(prompt_hashes(tokens, self.block_size))

    def add_hashes(self, hashes: Seq[bytes]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while self.capacity is not None and len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


def cached_prefixes(tokens: Seq[int], indexes: Seq[BlockIndex | None],
                    hashes: Callable[[int], Seq[bytes]] | None = None) -> list[int]:
    """Prompt tokens each instance is expected to hold in its prefix cache: its longest run of
    indexed full blocks from the start, leaving the last token to compute (as the engine's
    `match_prefix`). Each block size's hashes are computed once, only as far as some instance
    still matches, unless `hashes(block_size)` gives the prompt's (`prompt_hashes`, kept by a
    caller that looks the prompt up more than once); an instance without an index (block size
    unknown yet) holds nothing."""
    best = [0] * len(indexes)
    by_size: dict[int, list[int]] = {}
    for i, ix in enumerate(indexes):
        if ix is not None and len(ix):
            by_size.setdefault(ix.block_size, []).append(i)
    for ps, alive in by_size.items():
        parent, known = b"", hashes(ps) if hashes is not None else None
        for b in range((len(tokens) - 1) // ps):
            parent = (known[b] if known is not None
                      else block_hash(parent, tokens[b * ps:(b + 1) * ps]))
            alive = [i for i in alive if parent in indexes[i]]
            if not alive:
                break
            for i in alive:
                best[i] = (b + 1) * ps
    return best


def text_hashes(text: str, block: int, limit: int) -> list[bytes]:
    """The chained hashes of the full `block`-byte blocks of `text` in UTF-8 (at most `limit`):
    the router's key for a prompt it cannot tokenize (`TEXT_BLOCK_BYTES` in instances.py)."""
    data = text.encode("utf-8", "surrogatepass")
    out, parent = [], b""
    for start in range(0, min(len(data) // block, limit) * block, block):
        parent = hashlib.blake2b(parent + data[start:start + block], digest_size=16).digest()
        out.append(parent)
    return out


def matched_blocks(hashes: Seq[bytes], index: BlockIndex | None) -> int:
    """How many of `hashes`, from the first, `index` holds."""
    n = 0
    if index is not None:
        for h in hashes:
            if h not in index:
                break
            n += 1
    return n


@dataclasses.dataclass
class MetricsReport:
    pending_tokens: float | None = None   # laps_pending_prefill_tokens, summed over pools
    block_size: int | None = None          # vllm:cache_config_info{block_size}
    num_blocks: int | None = None          # vllm:cache_config_info{num_gpu_blocks}
    waiting: float | None = None           # vllm:num_requests_waiting
    running: float | None = None           # vllm:num_requests_running
    kv_usage: float | None = None          # vllm:kv_cache_usage_perc
    pages_used: float | None = None        # laps_kv_pages_used, summed over engines
    pending_short: float | None = None     # laps_pending_prefill_tokens{pool="short"}
    threshold: int | None = None           # laps_short_threshold_tokens
    long_chunk: int | None = None          # laps_long_chunk_tokens
    loop_stalls: float | None = None       # laps_event_loop_stalls_total (loop_lag)


_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPE = re.compile(r"\\(.)")
_SIMPLE = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "vllm:kv_cache_usage_perc": "kv_usage", "laps_event_loop_stalls_total": "loop_stalls"}
_SUMMED = {"laps_pending_prefill_tokens": "pending_tokens", "laps_kv_pages_used": "pages_used"}
MAX_REPORTED_TOKENS = 1 << 24  # a threshold, chunk or block count past this is not a report
MAX_BLOCK_SIZE = 1 << 16
MAX_VALUE = 1e15  # any gauge read: past this a sum of them could overflow
MAX_LOAD_GAUGES = 4096  # gauges in one /load answer (serve.py sends about 10 per engine)
_READ = {*_SIMPLE, *_SUMMED, "laps_short_threshold_tokens", "laps_long_chunk_tokens",
         "vllm:cache_config_info"}


def _unescape(m: re.Match) -> str:
    return "\n" if m.group(1) == "n" else m.group(1)


def _samples(text: str):
    """(name, labels, value) of the samples of Prometheus text whose name the router reads.
    A line-by-line reader of just those (prometheus_client's parser took 5-15 ms of the
    router's CPU per poll, three instances twice a second); any other sample line is only
    checked to start with a metric name. Raises ValueError on text that is not the format."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] == "#":
            continue
        m = _NAME.match(line)
        if m is None:
            raise ValueError(f"not Prometheus text: {line[:80]!r}")
        name, rest = m.group(), line[m.end():]
        if name not in _READ:
            continue
        labels = {}
        if rest.startswith("{"):
            pos = 1
            while (lm := _LABEL.match(rest, pos)) is not None and lm.end() > pos:
                labels[lm.group(1)] = _ESCAPE.sub(_unescape, lm.group(2))
                pos = lm.end()
            if rest[pos:pos + 1] != "}":
                raise ValueError(f"bad labels: {line[:80]!r}")
            rest = rest[pos + 1:]
        parts = rest.split()
        if not parts:
            raise ValueError(f"no value: {line[:80]!r}")
        yield name, labels, float(parts[0])


def _size(labels: dict, key: str, limit: int) -> int | None:
    """An integer label in [1, limit], else None (the layout is then not known)."""
    try:
        v = int(labels[key])
    except (KeyError, ValueError):
        return None
    return v if 1 <= v <= limit else None


def parse_metrics(text: str) -> MetricsReport:
    """The gauges the router reads from an instance's /metrics (Prometheus text); absent ones
    stay None. Raises ValueError on text that is not Prometheus exposition format, and on a
    value the router would misread: negative, not finite, a threshold or chunk outside
    [1, MAX_REPORTED_TOKENS] (the instance then fails alone: marked down with that reason,
    its report never reaching a routing decision). A block layout that is missing or out of
    range is left unknown (no prefix index for that instance)."""
    return _report(_samples(text))


def parse_load(body: bytes) -> MetricsReport:
    """The same report from a serve.py instance's /load answer (JSON: "gauges", a list of
    [name, labels, value] under /metrics' names), checked as `parse_metrics` checks its
    text; raises ValueError on anything else (wrong types, over `MAX_LOAD_GAUGES` gauges)."""
    try:
        doc = json.loads(body)
    except RecursionError:  # a forged answer nested past the parser's depth
        raise ValueError("/load: JSON nested too deep") from None
    gauges = doc.get("gauges") if isinstance(doc, dict) else None
    if not isinstance(gauges, list) or len(gauges) > MAX_LOAD_GAUGES:
        raise ValueError(f"/load: 'gauges' must be a list of at most {MAX_LOAD_GAUGES}")
    return _report(_load_samples(gauges))


def _load_samples(gauges: list):
    for g in gauges:
        if not (isinstance(g, list) and len(g) == 3 and isinstance(g[0], str)
                and isinstance(g[1], dict) and isinstance(g[2], (int, float))
                and not isinstance(g[2], bool)
                and all(isinstance(v, str) for v in g[1].values())):
            raise ValueError(f"/load: a gauge must be [name, {{label: text}}, number], "
                             f"not {str(g)[:80]!r}")
        if g[0] in _READ:
            if abs(g[2]) > MAX_VALUE:  # (an integer of 400 digits does not even fit a float)
                raise ValueError(f"{g[0]} is over {MAX_VALUE:g}")
            yield g[0], g[1], float(g[2])


def _report(samples) -> MetricsReport:
    """The router's report from (name, labels, value) samples, each value checked."""
    r = MetricsReport()
    for name, labels, value in samples:
        if not (math.isfinite(value) and 0 <= value <= MAX_VALUE):
            raise ValueError(f"{name} is {value:g}: a count or gauge must be in [0, {MAX_VALUE:g}]")
        if name in ("laps_short_threshold_tokens", "laps_long_chunk_tokens") and \
                not 1 <= value <= MAX_REPORTED_TOKENS:
            raise ValueError(f"{name} is {value:g}, outside [1, {MAX_REPORTED_TOKENS}]")
        if name in _SIMPLE:
            setattr(r, _SIMPLE[name], value)
        elif name in _SUMMED:
            setattr(r, _SUMMED[name], (getattr(r, _SUMMED[name]) or 0.0) + value)
        if name == "laps_pending_prefill_tokens" and labels.get("pool") == "short":
            r.pending_short = (r.pending_short or 0.0) + value
        elif name == "laps_short_threshold_tokens":
            r.threshold = int(value)
        elif name == "laps_long_chunk_tokens":
            r.long_chunk = int(value)
        elif name == "vllm:cache_config_info":
            r.block_size = _size(labels, "block_size", MAX_BLOCK_SIZE)
            r.num_blocks = _size(labels, "num_gpu_blocks", MAX_REPORTED_TOKENS)
            if r.block_size is None:
                r.num_blocks = None
    return r
