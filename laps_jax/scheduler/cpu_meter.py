"""How much of the machine's CPU other processes took while something ran.

The CPU here is shared: a busy neighbour slows one mode of a comparison and not another, so
compare_modes records the share per mode and round (`others_cpu_share`).
"""

from __future__ import annotations

import os
import time


class CpuMeter:
    """`with CpuMeter() as m: ...`; then `m.others`: the share of all cores' time that other
    processes used meanwhile (0..1)."""

    def __enter__(self):
        self.t, self.busy, self.ours = time.perf_counter(), _busy_jiffies(), _our_seconds()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t
        busy = (_busy_jiffies() - self.busy) / os.sysconf("SC_CLK_TCK")
        self.others = max(0.0, busy - (_our_seconds() - self.ours)) / (wall * os.cpu_count())


def _busy_jiffies() -> float:
    try:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4]  # all but idle and iowait
    except OSError:
        return 0.0


def _our_seconds() -> float:
    t = os.times()
    return t.user + t.system
