"""The `prefix` policy: a cache-aware baseline that decides as the SGLang Model Gateway's
`cache_aware` policy does (learned from its description and source; our own code).

Load is requests in flight per instance. When the instances are imbalanced — the busiest has
more than `balance_abs` requests more than the idlest AND more than `balance_rel` x its count —
the request goes to the least loaded (ties: fewer requests routed so far, then the lowest
index). Otherwise it goes to the instance whose cache holds the longest prefix of the prompt if
that prefix is more than `cache_threshold` of the prompt, else to the least loaded again. (The
gateway's approximate tree records the prompts it routed; here the caller supplies each
instance's cached prefix: the in-process router reads the real prefix caches, the network
router its block index of routed prompts, which is the gateway's idea at block granularity.)
Older versions of the gateway sent a cache miss to the instance with the smallest tree; the
current one sends it to the least loaded, as here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence as Seq


@dataclasses.dataclass(frozen=True)
class CacheAwareSettings:
    cache_threshold: float = 0.5   # the gateway's defaults
    balance_abs: int = 32
    balance_rel: float = 1.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("balance_abs must be >= 0 and balance_rel >= 1")


def pick_cache_aware(prompt_len: int, cached: Seq[int], inflight: Seq[int], routed: Seq[int],
                     ok: Callable[[int], bool], s: CacheAwareSettings) -> tuple[int, bool]:
    """(instance, chosen for its cache) among the eligible instances."""
    members = [i for i in range(len(cached)) if ok(i)]
    least = min(members, key=lambda i: (inflight[i], routed[i], i))
    lo, hi = min(inflight[i] for i in members), max(inflight[i] for i in members)
    if hi - lo > s.balance_abs and hi > s.balance_rel * lo:
        return least, False
    best = max(members, key=lambda i: (cached[i], -i))
    if prompt_len > 0 and cached[best] / prompt_len > s.cache_threshold:
        return best, True
    return least, False
