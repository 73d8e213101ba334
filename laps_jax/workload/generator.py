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


@dataclasses.dataclass(frozen=True)
class SessionGenConfig:
    """Session arrivals (Poisson, ``rate`` per second), turns (geometric), lengths, think times."""

    rate: float = 1.0
    mean_turns: float = 3.0
    max_turns: int = 16
    first_input: LengthMixture = LMSYS_FIRST_TURN
    later_input: LengthMixture = LMSYS_LATER_TURN
    output: LengthMixture = LMSYS_OUTPUT
    think_s: LogNormal = LogNormal(4.0, 0.8)
    length_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 sessions/s, got {self.rate}")
        if not self.mean_turns >= 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")


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
    sessions, i_later, i_out = [], 0, 0
    for i in range(n_sessions):
        turns = [Turn(first[i], outputs[i_out])]
        i_out += 1
        for _ in range(int(n_turns[i]) - 1):
            turns.append(Turn(later[i_later], outputs[i_out], round(think[i_later], 6)))
            i_later += 1
            i_out += 1
        sessions.append(Session(f"{id_prefix}{i}", round(float(arrivals[i]), 6), turns))
    return sessions
