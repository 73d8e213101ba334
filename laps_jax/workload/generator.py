"""Seeded multi-turn chat sessions shaped like LMSYS-Chat-1M, as LAPS reports it.

The public traces are long-context; LAPS targets chat, where (LMSYS-Chat-1M) 63% of first-turn
prompts and 81% of later-turn new inputs are under 256 tokens, with a heavy tail. Lengths are
two-component lognormal mixtures: a "chat" component and a "paste a document" component. The
component shapes are fixed and the mixing weight is *solved* in closed form so the fraction
under the threshold is exactly the target (see :meth:`LengthMixture.fit`), which keeps the
defaults honest when someone changes a median.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .sessions import Session, Turn


@dataclasses.dataclass(frozen=True)
class LogNormal:
    """A lognormal given by its median (``exp(mu)``) and the sigma of its log."""

    median: float
    sigma: float

    def cdf(self, x: float) -> float:
        if x <= 0:
            return 0.0
        return 0.5 * (1.0 + math.erf(math.log(x / self.median) / (self.sigma * math.sqrt(2))))


@dataclasses.dataclass(frozen=True)
class LengthMixture:
    """Token lengths: a lognormal mixture, rounded to integers and clipped to [1, max_len]."""

    weights: tuple[float, ...]
    components: tuple[LogNormal, ...]
    max_len: int = 16384

    def __post_init__(self) -> None:
        if len(self.weights) != len(self.components) or not self.components:
            raise ValueError("need one weight per component")
        if any(w < 0 for w in self.weights) or not math.isclose(sum(self.weights), 1.0):
            raise ValueError(f"weights must be >= 0 and sum to 1, got {self.weights}")

    def frac_under(self, threshold: int) -> float:
        """P(length < threshold) of the rounded lengths (``round(x) < t`` iff ``x < t - 0.5``)."""
        if threshold > self.max_len:
            return 1.0
        return sum(w * c.cdf(threshold - 0.5) for w, c in zip(self.weights, self.components))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        which = rng.choice(len(self.weights), size=n, p=np.asarray(self.weights))
        mu = np.log([c.median for c in self.components])[which]
        sigma = np.asarray([c.sigma for c in self.components])[which]
        x = np.exp(mu + sigma * rng.standard_normal(n))
        return np.clip(np.rint(x), 1, self.max_len).astype(np.int64)

    @classmethod
    def fit(cls, short: LogNormal, long: LogNormal, target_frac_under: float,
            threshold: int = 256, max_len: int = 16384) -> "LengthMixture":
        """Solve the weight of ``short`` so that ``frac_under(threshold) == target``."""
        ps, pl = short.cdf(threshold - 0.5), long.cdf(threshold - 0.5)
        if not min(ps, pl) <= target_frac_under <= max(ps, pl) or ps == pl:
            raise ValueError(f"target {target_frac_under} under {threshold} is out of reach of "
                             f"components giving {pl:.3f}..{ps:.3f}")
        w = (target_frac_under - pl) / (ps - pl)
        return cls((w, 1.0 - w), (short, long), max_len)


# LMSYS-Chat-1M shape reported by LAPS (MLSys 2026): 63% / 81% under 256 new tokens.
LMSYS_FIRST_TURN = LengthMixture.fit(LogNormal(48, 1.0), LogNormal(900, 1.0), 0.63)
LMSYS_LATER_TURN = LengthMixture.fit(LogNormal(24, 1.0), LogNormal(500, 1.1), 0.81)
LMSYS_OUTPUT = LengthMixture((1.0,), (LogNormal(180, 0.9),), max_len=2048)


def tailed(median: float, sigma: float, long_share: float = 0.0, long_median: float = 8192.0,
           long_sigma: float = 0.5, max_len: int = 32768) -> LengthMixture:
    """A lognormal body with a share ``long_share`` of very long prompts (a second lognormal
    around ``long_median``): the length tails a family of traces spans."""
    if long_share <= 0:
        return LengthMixture((1.0,), (LogNormal(median, sigma),), max_len)
    return LengthMixture((1.0 - long_share, long_share),
                         (LogNormal(median, sigma), LogNormal(long_median, long_sigma)), max_len)


@dataclasses.dataclass(frozen=True)
class SessionGenConfig:
    """Session arrivals (Poisson, ``rate`` per second; or Poisson bursts of a geometric number
    of sessions, ``burst_size`` on average, ``burst_gap_s`` apart on average), turns
    (geometric), lengths, think times, and shared prefixes: a share ``prefix_share`` of the
    sessions opens with one of ``prefix_docs`` documents (each ``prefix_len`` long, drawn once;
    a RAG corpus or an agent's system prompt) that every session using it shares token for
    token."""

    rate: float = 1.0
    mean_turns: float = 3.0
    max_turns: int = 16
    first_input: LengthMixture = LMSYS_FIRST_TURN
    later_input: LengthMixture = LMSYS_LATER_TURN
    output: LengthMixture = LMSYS_OUTPUT
    think_s: LogNormal = LogNormal(4.0, 0.8)
    length_scale: float = 1.0
    burst_size: float = 1.0
    burst_gap_s: float = 0.0
    prefix_share: float = 0.0
    prefix_docs: int = 0
    prefix_len: LengthMixture | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 sessions/s, got {self.rate}")
        if not self.mean_turns >= 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        if not self.burst_size >= 1 or not self.burst_gap_s >= 0:
            raise ValueError(f"burst_size must be >= 1 and burst_gap_s >= 0, got "
                             f"{self.burst_size}, {self.burst_gap_s}")
        if not 0 <= self.prefix_share <= 1:
            raise ValueError(f"prefix_share must be in [0, 1], got {self.prefix_share}")
        if self.prefix_share > 0 and (self.prefix_docs < 1 or self.prefix_len is None):
            raise ValueError("a prefix_share needs prefix_docs >= 1 and a prefix_len")

    @property
    def expected_turns(self) -> float:
        """Mean turns per session: a geometric count with mean ``mean_turns``, capped at
        ``max_turns`` (E[min(G, m)] = sum of P(G > k) for k < m)."""
        q = 1.0 - 1.0 / self.mean_turns
        return sum(q ** k for k in range(self.max_turns))


def _scaled(lengths: np.ndarray, scale: float) -> list[int]:
    if scale == 1.0:
        return lengths.tolist()
    return np.maximum(1, np.rint(lengths * scale)).astype(np.int64).tolist()


def generate_sessions(n_sessions: int, config: SessionGenConfig | None = None, seed: int = 0,
                      id_prefix: str = "s") -> list[Session]:
    """``n_sessions`` sessions; the same (config, seed) always gives the same sessions.

    The first session arrives at t = 0, the next ones after exponential gaps.
    """
    cfg = config or SessionGenConfig()
    if n_sessions < 0:
        raise ValueError(f"n_sessions must be >= 0, got {n_sessions}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / cfg.rate, n_sessions)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n_sessions else gaps
    n_turns = np.minimum(rng.geometric(1.0 / cfg.mean_turns, n_sessions), cfg.max_turns)
    n_later = int(n_turns.sum()) - n_sessions
    first = _scaled(cfg.first_input.sample(rng, n_sessions), cfg.length_scale)
    later = _scaled(cfg.later_input.sample(rng, n_later), cfg.length_scale)
    outputs = _scaled(cfg.output.sample(rng, n_sessions + n_later), cfg.length_scale)
    think = np.exp(math.log(cfg.think_s.median)
                   + cfg.think_s.sigma * rng.standard_normal(n_later)).tolist()
    # drawn after everything above, so a config without bursts or prefixes gives the same
    # sessions it always did
    if cfg.burst_size > 1 and n_sessions:
        arrivals = _burst_arrivals(rng, n_sessions, cfg)
    docs, doc_len = _prefixes(rng, n_sessions, cfg)
    sessions, i_later, i_out = [], 0, 0
    for i in range(n_sessions):
        turns = [Turn(first[i], outputs[i_out])]
        i_out += 1
        for _ in range(int(n_turns[i]) - 1):
            turns.append(Turn(later[i_later], outputs[i_out], round(think[i_later], 6)))
            i_later += 1
            i_out += 1
        d = docs[i]
        sessions.append(Session(f"{id_prefix}{i}", round(float(arrivals[i]), 6), turns,
                                *((f"doc{d}", doc_len[d]) if d >= 0 else ())))
    return sessions


def _burst_arrivals(rng: np.random.Generator, n: int, cfg: SessionGenConfig) -> np.ndarray:
    """Bursts start as a Poisson process at rate / burst_size (the same sessions/s); each
    holds a geometric number of sessions with mean burst_size, exponential burst_gap_s apart."""
    sizes = rng.geometric(1.0 / cfg.burst_size, n)  # at most n bursts are needed
    starts = np.cumsum(rng.exponential(cfg.burst_size / cfg.rate, n))
    starts -= starts[0]
    gaps = rng.exponential(cfg.burst_gap_s, n) if cfg.burst_gap_s > 0 else np.zeros(n)
    out, b = np.empty(n), 0
    i = 0
    while i < n:
        k = min(int(sizes[b]), n - i)
        out[i:i + k] = starts[b] + np.concatenate([[0.0], np.cumsum(gaps[i + 1:i + k])])
        i, b = i + k, b + 1
    return np.sort(out)


def _prefixes(rng: np.random.Generator, n: int, cfg: SessionGenConfig
              ) -> tuple[list[int], list[int]]:
    """(document index per session, -1 for none; length per document)."""
    if cfg.prefix_share <= 0 or not n:
        return [-1] * n, []
    doc_len = _scaled(cfg.prefix_len.sample(rng, cfg.prefix_docs), cfg.length_scale)
    uses = rng.random(n) < cfg.prefix_share
    which = rng.integers(0, cfg.prefix_docs, n)
    return [int(d) if u else -1 for u, d in zip(uses, which)], doc_len
