"""The request record every workload source produces, and the token ids replays send.

Traces carry lengths, never text, so a replay has to invent prompts. Prompts are described
as a list of segments, each a (key, length) pair; a segment's token at position ``i`` depends
only on the key, the position and the seed of a :class:`TokenSpace`. That gives two properties
the prefix cache under test relies on, for free:

* two prompts whose leading segments have equal keys share exactly those leading tokens
  (Mooncake hash blocks, multi-turn history);
* a segment cut short is a prefix of the full segment, so truncation keeps sharing intact.

Tokens are built lazily: a full Mooncake replay would otherwise hold ~150M ids in memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .sampling import check_fraction

# First special-token id of the Qwen2.5 tokenizer: every id below it is an ordinary token.
QWEN25_TEXT_VOCAB = 151643
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class TraceFormatError(ValueError):
    """A malformed trace file; the message names the file and the line."""

    def __init__(self, path: str, line: int | None, what: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {what}")
        self.path, self.line = str(path), line


def parse_count(value: Any, name: str, path: str, line: int) -> int:
    """An integral count (``12``, ``12.0`` or ``"12"``); anything else is a format error."""
    number: float | int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, (float, str)) and not isinstance(value, bool):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and not (math.isfinite(number) and number == int(number)):
            number = None
    if number is None:
        raise TraceFormatError(path, line, f"{name} must be an integer, got {value!r}")
    if number < 0:
        raise TraceFormatError(path, line, f"{name} must be >= 0, got {value!r}")
    return int(number)


def iter_json_objects(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; errors name the line."""
    with open(path) as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, line_no, f"invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(path, line_no, f"expected a JSON object, got "
                                                      f"{type(obj).__name__}")
            yield line_no, obj


def require_field(obj: dict[str, Any], name: str, path: str, line: int) -> Any:
    if name not in obj:
        raise TraceFormatError(path, line, f"missing field {name!r}")
    return obj[name]


def segment_key(*parts: int | str) -> int:
    """Stable 64-bit key from parts (no Python ``hash``: it is salted per process)."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclasses.dataclass(frozen=True)
class TokenSpace:
    """Where synthetic token ids come from: ``[low, vocab_size)``, seeded.

    ``low`` skips the first ids (often byte or control tokens in small test vocabularies);
    ``vocab_size`` is an exclusive bound, so pass the model's *text* vocabulary (the default is
    Qwen2.5's, below its special tokens) to keep prompts free of control tokens.
    """

    vocab_size: int = QWEN25_TEXT_VOCAB
    low: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.vocab_size:
            raise ValueError(f"need 0 <= low < vocab_size, got low={self.low}, "
                             f"vocab_size={self.vocab_size}")

    def tokens(self, key: int, n: int, start: int = 0) -> np.ndarray:
        """Tokens ``start .. start+n`` of the segment ``key`` (counter-based: no state)."""
        base = (key ^ ((self.seed + 1) * _GOLDEN)) & _MASK64
        with np.errstate(over="ignore"):
            x = (np.arange(start, start + n, dtype=np.uint64) * np.uint64(_GOLDEN)
                 + np.uint64(base))
            mixed = _splitmix64(x)
        return (mixed % np.uint64(self.vocab_size - self.low)).astype(np.int64) + self.low


@dataclasses.dataclass(frozen=True)
class Segment:
    """``length`` tokens of the deterministic token stream named by ``key``."""

    key: int
    length: int


@dataclasses.dataclass
class TraceRequest:
    """One request of a replay: when it arrives, how long it is, and how to build its prompt.

    ``history_len`` is the part of the prompt that repeats an earlier turn of the same session
    (what a prefix cache can reuse); ``hash_ids`` are Mooncake's 512-token block hashes for the
    leading blocks. ``prompt_ids`` overrides the segments when the prompt is known exactly
    (a closed-loop session turn built from the answers actually produced).
    """

    request_id: str
    arrival_s: float
    input_len: int
    output_len: int
    segments: tuple[Segment, ...] = ()
    session_id: str | None = None
    turn: int = 0
    history_len: int = 0
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0
    prompt_ids: list[int] | None = None
    token_space: TokenSpace = dataclasses.field(default_factory=TokenSpace, repr=False)

    @property
    def new_input_len(self) -> int:
        """Tokens a warm prefix cache would still have to prefill (history excluded)."""
        return self.input_len - self.history_len

    def prompt_token_ids(self) -> list[int]:
        """The prompt as token ids (built on demand, deterministic)."""
        if self.prompt_ids is not None:
            return list(self.prompt_ids)
        if not self.segments:
            return self.token_space.tokens(segment_key("request", self.request_id),
                                           self.input_len).tolist()
        parts = [self.token_space.tokens(s.key, s.length) for s in self.segments]
        ids = np.concatenate(parts).tolist()
        assert len(ids) == self.input_len, (len(ids), self.input_len)
        return ids


@dataclasses.dataclass(frozen=True)
class TraceOptions:
    """Options every reader takes.

    ``length_scale`` multiplies input and output lengths (at least 1 token each) so that a
    long-context trace fits a CPU; ``time_scale`` multiplies inter-arrival (and think) times,
    so 0.5 replays twice as fast. ``max_len`` caps prompt + output tokens (a model's context):
    the prompt keeps at least half of it, and the trace counts what it cut. ``sample`` keeps
    that fraction of the trace's conversations, whole (``workload.sampling``), before
    ``max_requests`` counts.
    """

    max_requests: int | None = None
    length_scale: float = 1.0
    time_scale: float = 1.0
    vocab_size: int = QWEN25_TEXT_VOCAB
    token_low: int = 10
    max_len: int | None = None
    seed: int = 0
    sample: float = 1.0

    def __post_init__(self) -> None:
        check_fraction(self.sample)
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {self.max_requests}")
        if not (self.length_scale > 0 and math.isfinite(self.length_scale)):
            raise ValueError(f"length_scale must be positive, got {self.length_scale}")
        if not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 (one prompt and one output token), "
                             f"got {self.max_len}")

    @property
    def token_space(self) -> TokenSpace:
        return TokenSpace(self.vocab_size, self.token_low, self.seed)

    def scale_len(self, n: int) -> int:
        return max(1, round(n * self.length_scale))

    def fit(self, input_len: int, output_len: int) -> tuple[int, int, bool]:
        """Apply ``max_len`` to a (prompt, output) pair; returns the new pair and whether it was cut."""
        if self.max_len is None or input_len + output_len <= self.max_len:
            return input_len, output_len, False
        new_in = min(input_len, self.max_len - min(output_len, self.max_len // 2))
        return new_in, min(output_len, self.max_len - new_in), True


@dataclasses.dataclass
class Trace:
    """Requests of one source in arrival order, plus what the reader changed on the way."""

    source: str
    requests: list[TraceRequest]
    notes: list[str] = dataclasses.field(default_factory=list)
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    def summary(self, threshold: int = 256) -> "LengthSummary":
        return summarize([r.input_len for r in self.requests], threshold)


def implied_new_tokens(requests) -> list[int]:
    """Per request: tokens not covered by session history or by Mooncake blocks seen earlier
    (what the trace says a warm prefix cache leaves to prefill; replays and the simulator set
    SLOs and offered loads by it)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for r in requests:
        cached = r.history_len
        if r.hash_ids and r.block_size:
            full = min(len(r.hash_ids), r.input_len // r.block_size)
            k = 0
            while k < full and tuple(r.hash_ids[:k + 1]) in seen:
                k += 1
            seen.update(tuple(r.hash_ids[:i + 1]) for i in range(full))
            cached = max(cached, min(k * r.block_size, r.input_len - 1))
        out.append(r.input_len - cached)
    return out


@dataclasses.dataclass(frozen=True)
class LengthSummary:
    """The numbers the LAPS argument rests on: how many requests are short, and the tail."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    threshold: int
    frac_under: float  # fraction strictly under ``threshold``


def summarize(lengths: Sequence[int] | np.ndarray, threshold: int = 256) -> LengthSummary:
    """Count, mean, p50/p90/p99, max and the fraction of lengths under ``threshold``."""
    a = np.asarray(lengths, dtype=np.float64)
    if a.size == 0:
        nan = float("nan")
        return LengthSummary(0, nan, nan, nan, nan, 0, threshold, nan)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return LengthSummary(int(a.size), float(a.mean()), float(p50), float(p90), float(p99),
                         int(a.max()), threshold, float((a < threshold).mean()))
