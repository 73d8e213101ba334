"""What the network router knows of each instance behind it: health, load and routed blocks.

Plain bookkeeping, no I/O (the poller and the proxy in http_router.py feed it), so it is tested
without processes.

- `LoadBook`: an instance's pending prefill tokens as the router counts them: what the
  instance last reported (`laps_pending_prefill_tokens`, summed over its pools) plus the new
  tokens the router sent it since the poll that produced the report began. Work sent before
  the poll began is in the report (the instance counts a request it has not admitted yet in
  full, as pool "admission"); a request still in the instance's HTTP parser at that moment is
  missed until the next poll, half a second later.
- `BlockIndex`: the chained hashes of the full token blocks of every prompt routed to an
  instance, hashed as the engine hashes its prefix cache (`engine.kv_cache.block_hash`, the
  instance's block size), least recently used first out past the instance's block count, as
  the engine evicts. `cached_prefixes` turns the indexes into the "cached prefix of this prompt
  on each instance" that the routing policy takes.
- `parse_metrics`: the gauges of an instance's /metrics text the router reads (with the
  instance's own short/long threshold, `laps_short_threshold_tokens`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence as Seq

from prometheus_client.parser import text_string_to_metric_families

from laps_jax.engine.kv_cache import block_hash


class LoadBook:
    def __init__(self) -> None:
        self.reported = self.reported_short = 0.0
        self._sent: collections.deque[tuple[float, int, bool]] = collections.deque()

    def sent(self, tokens: int, now: float, short: bool = False) -> None:
        """The router sent a request with `tokens` new tokens (short or not) at `now`."""
        self._sent.append((now, max(int(tokens), 0), short))

    def report(self, pending_tokens: float, poll_started: float,
               pending_short: float | None = None) -> None:
        """The instance reported `pending_tokens` (of which `pending_short` in its short pool)
        in a poll sent at `poll_started`: what was sent before then is in the report."""
        self.reported = max(float(pending_tokens), 0.0)
        self.reported_short = min(max(float(pending_short or 0.0), 0.0), self.reported)
        while self._sent and self._sent[0][0] < poll_started:
            self._sent.popleft()

    def clear(self) -> None:
        self.reported = self.reported_short = 0.0
        self._sent.clear()

    @property
    def since_poll(self) -> int:
        return sum(t for _, t, _ in self._sent)

    @property
    def load(self) -> float:
        return self.reported + self.since_poll

    @property
    def short_load(self) -> float:
        """The part of `load` that is short work (the instance's short pool + short sends)."""
        return self.reported_short + sum(t for _, t, short in self._sent if short)


def prompt_hashes(tokens: Seq[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens` (at most `limit` blocks)."""
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    out, parent = [], b""
    for b in range(n):
        parent = block_hash(parent, tokens[b * block_size:(b + 1) * block_size])
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
        for h in prompt_hashes(tokens, self.block_size):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while self.capacity is not None and len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


def cached_prefixes(tokens: Seq[int], indexes: Seq[BlockIndex | None]) -> list[int]:
    """Prompt tokens each instance is expected to hold in its prefix cache: its longest run of
    indexed full blocks from the start, leaving the last token to compute (as the engine's
    `match_prefix`). Each block size's hashes are computed once, only as far as some instance
    still matches; an instance without an index (block size unknown yet) holds nothing."""
    best = [0] * len(indexes)
    by_size: dict[int, list[int]] = {}
    for i, ix in enumerate(indexes):
        if ix is not None and len(ix):
            by_size.setdefault(ix.block_size, []).append(i)
    for ps, alive in by_size.items():
        parent = b""
        for b in range((len(tokens) - 1) // ps):
            parent = block_hash(parent, tokens[b * ps:(b + 1) * ps])
            alive = [i for i in alive if parent in indexes[i]]
            if not alive:
                break
            for i in alive:
                best[i] = (b + 1) * ps
    return best


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


def parse_metrics(text: str) -> MetricsReport:
    """The gauges the router reads from an instance's /metrics (Prometheus text); absent ones
    stay None. Raises ValueError on text that is not Prometheus exposition format."""
    r = MetricsReport()
    simple = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
              "vllm:kv_cache_usage_perc": "kv_usage"}
    summed = {"laps_pending_prefill_tokens": "pending_tokens", "laps_kv_pages_used": "pages_used"}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in simple:
                setattr(r, simple[s.name], float(s.value))
            elif s.name in summed:
                setattr(r, summed[s.name], (getattr(r, summed[s.name]) or 0.0) + float(s.value))
            if s.name == "laps_pending_prefill_tokens" and s.labels.get("pool") == "short":
                r.pending_short = (r.pending_short or 0.0) + float(s.value)
            elif s.name == "laps_short_threshold_tokens":
                r.threshold = int(s.value)
            elif s.name == "vllm:cache_config_info":
                try:
                    r.block_size = int(s.labels["block_size"])
                    r.num_blocks = int(s.labels["num_gpu_blocks"])
                except (KeyError, ValueError):
                    pass
    return r
