"""Short and long groups that follow the work (the `laps` routing policy's groups).

Each group is sized by its share of the recent prefill *compute* (predicted seconds, not token
or request counts): the router reports every request it routes (`observe`), and the shares are
exponentially decayed sums over `share_tau_s`, plus what is pending now. The target short count
is `n x short share`, rounded, with at least one instance per group. An instance moves only when
the target is more than `hysteresis` instances away from the current split, at most one move
per `move_interval_s`, and never an instance that moved less than `dwell_s` ago.

A moving instance drains: until its pending work of its old kind is done it takes no new work
(unless nothing else can), so a long instance that joins the short group does not make the
short requests sent to it wait behind its long chunks. Plain state and numbers, no clock of
its own: the caller passes `now`, so tests drive it with fake time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence as Seq

from laps_jax.scheduler.request import LONG, SHORT

DRAINED_S = 1e-9  # pending work of the old kind at or under this: drained


@dataclasses.dataclass
class GroupSettings:
    share_tau_s: float = 10.0      # memory of the compute shares
    hysteresis: float = 0.5        # instances the split may lag the target before a move
    dwell_s: float = 10.0          # an instance stays this long in a group after a move
    move_interval_s: float = 2.0   # at most one move per interval

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")


@dataclasses.dataclass
class Move:
    t: float
    instance: int
    to: str


@dataclasses.dataclass
class Groups:
    """Group of each instance, when it last moved, which ones drain, and the compute shares."""

    group: list[str]
    settings: GroupSettings = dataclasses.field(default_factory=GroupSettings)
    moved_at: list[float | None] = dataclasses.field(default_factory=list)
    draining: list[bool] = dataclasses.field(default_factory=list)
    work: dict[str, float] = dataclasses.field(default_factory=lambda: {SHORT: 0.0, LONG: 0.0})
    t_work: float | None = None
    last_move: float | None = None
    moves: list[Move] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.group)
        self.moved_at = self.moved_at or [None] * n
        self.draining = self.draining or [False] * n

    @classmethod
    def split(cls, n: int, short_fraction: float, settings: GroupSettings) -> Groups:
        n_short = min(max(1, round(n * short_fraction)), n - 1) if n > 1 else 1
        return cls([SHORT if i < n_short else LONG for i in range(n)], settings)

    def sizes(self) -> tuple[int, int]:
        s = sum(g == SHORT for g in self.group)
        return s, len(self.group) - s

    def _decay(self, now: float) -> None:
        if self.t_work is not None and now > self.t_work:
            f = math.exp(-(now - self.t_work) / max(self.settings.share_tau_s, 1e-9))
            self.work = {k: v * f for k, v in self.work.items()}
        self.t_work = now if self.t_work is None else max(self.t_work, now)

    def observe(self, kind: str, cost: float, now: float) -> None:
        """A request of `kind` and predicted `cost` was routed at `now`."""
        self._decay(now)
        self.work[kind] += max(cost, 0.0)

    def short_share(self, pending_short: float, pending_long: float, now: float) -> float:
        """Short work's share of recent + pending compute (0.5 before any work)."""
        self._decay(now)
        s, l = self.work[SHORT] + pending_short, self.work[LONG] + pending_long
        return s / (s + l) if s + l > 0 else 0.5

    def update_draining(self, old_kind_left: Callable[[int], float]) -> None:
        """An instance stops draining once its work of the old kind is done."""
        for i, d in enumerate(self.draining):
            if d and old_kind_left(i) <= DRAINED_S:
                self.draining[i] = False

    def rebalance(self, now: float, share: float, ok: Seq[bool],
                  pending_of: Callable[[int, str], float]) -> Move | None:
        """Moves at most one eligible instance toward `n x share` short instances."""
        st = self.settings
        if self.last_move is not None and now - self.last_move < st.move_interval_s:
            return None
        n = len(self.group)
        if n < 2:
            return None
        target = n * share
        n_short = self.sizes()[0]
        if target > n_short + 0.5 + st.hysteresis and n_short < n - 1:
            frm, to = LONG, SHORT
        elif target < n_short - 0.5 - st.hysteresis and n_short > 1:
            frm, to = SHORT, LONG
        else:
            return None
        movable = [i for i, g in enumerate(self.group) if g == frm and ok[i]
                   and not self.draining[i]
                   and (self.moved_at[i] is None or now - self.moved_at[i] >= st.dwell_s)]
        if not movable:
            return None
        i = min(movable, key=lambda k: (pending_of(k, frm), k))  # least to drain
        self.group[i], self.moved_at[i], self.last_move = to, now, now
        self.draining[i] = pending_of(i, frm) > DRAINED_S
        move = Move(now, i, to)
        self.moves.append(move)
        return move
