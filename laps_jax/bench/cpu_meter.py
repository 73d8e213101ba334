"""How much of the machine's CPU others took while something ran.

The CPU here is shared: a busy neighbour slows one mode of a comparison and not another, so
compare_modes records the share per mode and round (`others_cpu_share`) and runs a mode again
when it is high. "Others" are other processes and, on a VM, the hypervisor's steal (time our
virtual cores were ready but the host ran someone else: it slows us just the same).
"""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

T = TypeVar("T")
_clock = time.perf_counter


class CpuMeter:
    """`with CpuMeter() as m: ...`; then `m.others`: the share of all cores' time that others
    took meanwhile (0..1), `m.steal`: the hypervisor's part of it, `m.wall`: seconds it took."""

    def __enter__(self):
        self.t, self.ours = _clock(), _our_seconds()
        self.busy, self.stolen = _busy_jiffies()
        return self

    def __exit__(self, *exc):
        self.wall = wall = _clock() - self.t
        busy, stolen = _busy_jiffies()
        tick, cores = os.sysconf("SC_CLK_TCK"), wall * os.cpu_count()
        self.steal = (stolen - self.stolen) / tick / cores
        busy = (busy - self.busy) / tick
        self.others = max(0.0, busy - (_our_seconds() - self.ours)) / cores


def run_unbusy(fn: Callable[[], T], max_others: float | None, reruns: int,
               on_rerun: Callable[[float], None] = lambda share: None,
               meter: Callable[[], CpuMeter] = CpuMeter) -> tuple[T, CpuMeter, int]:
    """Run `fn`, again (at most `reruns` more times) while others (processes, steal) took more
    than `max_others` of the CPU meanwhile (None: once). Returns the last result, its meter and
    how many times it was run again; `on_rerun(share)` is told before each rerun."""
    attempt, last = 0, max(0, reruns)
    while True:
        with meter() as m:
            result = fn()
        if max_others is None or m.others <= max_others or attempt == last:
            return result, m, attempt
        on_rerun(m.others)
        attempt += 1


def _busy_jiffies() -> tuple[float, float]:
    """(all cores' busy jiffies since boot, steal's part of them); zeros where unknown."""
    try:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal guest guest_nice; guest time is
        # already counted in user
        return sum(v[:8]) - v[3] - v[4], (v[7] if len(v) > 7 else 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def _our_seconds() -> float:
    t = os.times()
    return t.user + t.system


def process_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used so far; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
