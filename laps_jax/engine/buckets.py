"""Which shapes the engine compiles: buckets and the bucket grid, in plain Python.

The scheduler plans steps in these shapes and the simulator prices them, neither importing
JAX; `executables.py` compiles them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    batch: int
    tokens: int
    prompt_logprobs: bool = False

    @property
    def is_decode(self) -> bool:
        return self.tokens == 1


def padding_fraction(real_tokens: int, bucket_tokens: int) -> float:
    """Share of the buckets' tokens that were padding (0 before any step)."""
    return 1.0 - real_tokens / bucket_tokens if bucket_tokens else 0.0


def pow2_range(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return sorted(set(out))


@dataclasses.dataclass
class BucketGrid:
    """Which (batch, tokens) shapes exist. Prefill batches stay under a token budget."""

    prefill_batches: list[int]
    prefill_tokens: list[int]
    decode_batches: list[int]
    max_batch_tokens: int

    @classmethod
    def default(cls, max_chunk: int = 2048, max_prefill_batch: int = 8, max_decode_batch: int = 32,
                min_tokens: int = 16, max_batch_tokens: int | None = None,
                widths: Sequence[int] | None = None) -> "BucketGrid":
        """Prefill widths in powers of two from `min_tokens` to `max_chunk` (or `widths` as
        given), batches in powers of two, under a budget of `max_batch_tokens` a step."""
        if widths:
            widths = sorted(set(widths))
            min_tokens, max_chunk = widths[0], widths[-1]
        budget = max_batch_tokens or max_chunk
        min_tokens = min(min_tokens, max_chunk)
        # a batch size with no bucket under the budget is never compiled nor planned
        batches = [b for b in pow2_range(1, max_prefill_batch) if b * min_tokens <= budget]
        return cls(batches or [1], widths or pow2_range(min_tokens, max_chunk),
                   pow2_range(1, max_decode_batch), budget)

    @classmethod
    def of_settings(cls, s) -> "BucketGrid":
        """The grid an engine with settings `s` compiles (an `EngineConfig`, or anything with
        its bucket fields): the engine, the comparison harness and the simulator's validation
        all build it here."""
        return cls.default(s.max_chunk, s.max_prefill_batch, s.max_decode_batch, s.min_chunk,
                           s.max_batch_tokens)

    def prefill_buckets(self, prompt_logprobs: bool = False) -> list[Bucket]:
        return list(self._prefill_buckets(prompt_logprobs))

    def _prefill_buckets(self, prompt_logprobs: bool) -> tuple[Bucket, ...]:
        key = (prompt_logprobs, tuple(self.prefill_batches), tuple(self.prefill_tokens),
               self.max_batch_tokens)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:  # the scheduler asks on every plan: build the list once
            cache[key] = tuple(Bucket(b, t, prompt_logprobs) for b in self.prefill_batches
                               for t in self.prefill_tokens
                               if b == 1 or b * t <= self.max_batch_tokens)
        return cache[key]

    def decode_buckets(self) -> list[Bucket]:
        return [Bucket(b, 1) for b in self.decode_batches]

    @property
    def max_chunk(self) -> int:
        return self.prefill_tokens[-1]

    def fit_prefill(self, n_seqs: int, max_new: int, prompt_logprobs: bool = False) -> Bucket | None:
        """Smallest bucket (fewest padded tokens) holding n_seqs sequences of <= max_new tokens."""
        best = None
        for b in self._prefill_buckets(prompt_logprobs):
            if b.batch >= n_seqs and b.tokens >= max_new:
                if best is None or (b.batch * b.tokens, b.tokens) < (best.batch * best.tokens,
                                                                     best.tokens):
                    best = b
        return best

    def fit(self, n_seqs: int, max_new: int, prompt_logprobs: bool = False) -> Bucket | None:
        """The bucket a step of n_seqs sequences (<= max_new new tokens each) runs in: a decode
        bucket for one token each, else the smallest prefill bucket; None if none holds it."""
        if max_new == 1 and not prompt_logprobs:
            b = self.fit_decode(n_seqs)
            if b is not None:
                return b
        return self.fit_prefill(n_seqs, max_new, prompt_logprobs)

    def check_holds(self, bucket: Bucket, widths: list[int], prompt_logprobs: bool = False
                    ) -> None:
        """Raises ValueError unless `bucket` is one of this grid's and holds rows of `widths`
        new tokens: a planned bucket is checked where it runs, never chosen again there."""
        ours = (bucket in self.decode_buckets() if bucket.is_decode and not prompt_logprobs
                else bucket in self._prefill_buckets(prompt_logprobs))
        if not ours or len(widths) > bucket.batch or max(widths, default=0) > bucket.tokens:
            raise ValueError(f"planned bucket {bucket.batch}x{bucket.tokens} does not hold "
                             f"{len(widths)} rows of at most {max(widths, default=0)} new "
                             f"tokens{'' if ours else ' (not in the grid)'}")

    def fit_decode(self, n_seqs: int) -> Bucket | None:
        for b in self.decode_batches:
            if b >= n_seqs:
                return Bucket(b, 1)
        return None
