"""How fast each instance has lately been turning work into first tokens (laps, on by default).

The router's load is pending prefill tokens; what it cannot see is how fast an instance gets
through them now: three instances on two shared cores run at whatever the OS gives them, and
one that decodes a full batch runs its prefill steps further apart. `Pace` measures it from the
router's own streams: a request sent when `ahead` tokens were pending there, with `new` of its
own, whose first token came back `seconds` later, gives seconds per token of
`ahead + new + overhead_tokens` (the overhead stands for a step's fixed cost, so a tiny
request on an idle instance does not read as slow). An exponential mean over the samples
(`weight` per sample) tracks it; `relative_speeds` turns the paces of the instances into
factors around 1 for the `laps` rule (slower than the others: over 1), each pulled back to 1 as
its last sample ages (`forget_s`), so an instance that looked slow and got no work since is
not shunned for good.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence as Seq

OVERHEAD_TOKENS = 64.0   # a step's fixed cost, in tokens (bench-cpu: ~18 ms at ~0.27 ms/token)
FORGET_S = 2.0           # a pace this old counts for 1/e of its difference from the others
CLIP = (0.5, 2.0)        # relative speed factors are kept within these
PACE_WEIGHT = 0.3        # router.py's default weight per sample (docs/BENCHMARKS.md, "Router")


@dataclasses.dataclass
class Pace:
    weight: float                       # of each new sample in the mean (0 < weight <= 1)
    overhead_tokens: float = OVERHEAD_TOKENS
    value: float | None = None          # seconds per token, None until a sample
    t: float | None = None              # when the last sample came

    def __post_init__(self) -> None:
        if not (0 < self.weight <= 1):
            raise ValueError(f"pace weight must be in (0, 1], got {self.weight!r}")

    def observe(self, seconds: float, ahead: float, new: float, now: float) -> None:
        """A first token `seconds` after sending, with `ahead` pending tokens and `new` own."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        x = seconds / (max(ahead, 0.0) + max(new, 0.0) + self.overhead_tokens)
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)
        self.t = now

    def clear(self) -> None:
        self.value = self.t = None


def relative_speeds(paces: Seq[Pace | None], now: float,
                    forget_s: float = FORGET_S) -> list[float]:
    """Each instance's pace over the mean of those with one (1.0 where none, or no `Pace`),
    pulled toward 1 as its last sample ages, within `CLIP`."""
    known = [p.value for p in paces if p is not None and p.value is not None]
    if len(known) < 2:
        return [1.0] * len(paces)
    mean = sum(known) / len(known)
    out = []
    for p in paces:
        if p is None or p.value is None or mean <= 0:
            out.append(1.0)
            continue
        fresh = math.exp(-max(now - p.t, 0.0) / forget_s) if forget_s > 0 else 0.0
        f = 1.0 + (p.value / mean - 1.0) * fresh
        out.append(min(max(f, CLIP[0]), CLIP[1]))
    return out
