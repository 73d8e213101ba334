"""compare_modes at several loads, and the regime a comparison ran in.

One load says little: near saturation every ratio swings, far below it nothing queues.
`run_loads` replays the trace at each fraction of mixed's measured capacity (capacity measured
once, at the first load; the others scale the same arrivals' time scale) and `loads_markdown`
puts every mode's ratios to mixed side by side with mixed's own SLO miss rate, so a reader sees
where the load lands. `regime` says whether the short/long cut sits below or above the device's
compute/memory crossover and whether any request was short at all: with `--threshold auto` on a
CPU whose crossover is a few dozen tokens, laps has nearly nothing to separate.

A fraction of measured capacity can still land past saturation when prompts are long (the burst
that measures capacity is not the trace). `find_target_load` instead probes mixed (FCFS) alone
until its SLO miss rate lands in a band (20-40% by default): a load defined by what FCFS users
feel, the same on every trace.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

DEFAULT_LOADS = (0.5, 0.7, 0.9)
TARGET_BAND = (0.2, 0.4)
FIGURES = ("ttft_short_ms_p90", "prefill_latency_ms_mean", "slo_violation_rate",
           "ttft_long_ms_p90", "throughput_tokens_per_s")
NAMES = ("short p90", "mean prefill", "SLO viol.", "long p90", "tok/s")


def regime(threshold: int | None, crossover: int, results: dict[str, dict]) -> dict:
    """The cut used, the device's crossover (new tokens at 0 cached), and per mode how many
    requests were short."""
    cut = crossover if threshold is None else threshold
    return {"threshold": cut, "crossover": crossover,
            "cut_vs_crossover": "at" if cut == crossover else
            ("below" if cut < crossover else "above"),
            "short_requests": {m: r.get("short_requests") for m, r in results.items()},
            "requests": {m: (r.get("short_requests") or 0) + (r.get("long_requests") or 0)
                         for m, r in results.items()}}


def describe(reg: dict) -> str:
    shorts = ", ".join(f"{m} {reg['short_requests'][m]} of {reg['requests'][m]}"
                       for m in reg["short_requests"])
    none = all(not v for v in reg["short_requests"].values())
    return (f"regime: short/long cut {reg['threshold']} new tokens, {reg['cut_vs_crossover']} "
            f"this device's compute/memory crossover ({reg['crossover']} new tokens, nothing "
            f"cached); short requests: {shorts}"
            + (" -- none was short: laps cannot separate anything here" if none else ""))


def run_loads(o, loads: list[float], run: Callable, log: Callable[[str], None]) -> dict:
    """{load: comparison} for each load, each in its own DIR/load_X.XX; `run` is
    `run_comparison`. Capacity is measured at the first load only (unless a time scale is
    given): the others replay the same arrivals at time scale x first load / load."""
    out, scale0 = {}, None
    for x in loads:
        sub = dataclasses.replace(o, load=x, output_dir=os.path.join(o.output_dir,
                                                                     f"load_{x:.2f}"))
        if o.time_scale is None and scale0 is not None:
            sub = dataclasses.replace(sub, time_scale=scale0 * loads[0] / x)
        log(f"== load {x:.2f} of mixed's capacity ==")
        out[x] = run(sub, log)
        if scale0 is None:
            scale0 = out[x]["run"]["time_scale"]
    return out


@dataclasses.dataclass
class TargetLoad:
    load: float                  # the chosen fraction of mixed's capacity
    time_scale: float            # the arrivals' time scale at that load
    miss: float                  # mixed's SLO miss rate there
    in_band: bool                # False: no probe landed in the band; the closest is kept
    probes: list[tuple[float, float]]  # (load, mixed's miss rate) in the order probed


def _next_load(x: float, miss: float, band: tuple[float, float], below: float | None,
               above: float | None) -> float:
    """Geometric bisection between the highest load that missed too little and the lowest that
    missed too much; before both are known, steps of 1.4x (the miss rate turns steeply near
    saturation, so small steps there)."""
    if below is not None and above is not None:
        return (below * above) ** 0.5
    return x * 1.4 if miss < band[0] else x / 1.4


def find_target_load(o, band: tuple[float, float], run: Callable, log: Callable[[str], None],
                     start: float = 0.7, max_probes: int = 6) -> TargetLoad:
    """Probe mixed alone (one round, its own DIR/target_probes/load_X.XX) until its SLO miss
    rate lies in `band`; capacity is measured once, at the first probe, and later probes replay
    the same arrivals faster or slower. `run` is `run_comparison`."""
    lo, hi = band
    probes: list[tuple[float, float, float]] = []  # (load, miss, time scale)
    below = above = None
    x, scale0 = start, None
    for _ in range(max_probes):
        sub = dataclasses.replace(o, load=x, modes=("mixed",), variants=(), repeats=1,
                                  output_dir=os.path.join(o.output_dir, "target_probes",
                                                          f"load_{x:.2f}"))
        if scale0 is not None:
            sub = dataclasses.replace(sub, time_scale=scale0 * start / x)
        out = run(sub, log)
        ts = out["run"]["time_scale"]
        scale0 = scale0 if scale0 is not None else ts * x / start
        miss = out["mixed"].get("slo_violation_rate") or 0.0  # None: nothing completed
        probes.append((x, miss, ts))
        log(f"target probe: mixed at load {x:.2f} misses {miss:.0%} of SLOs "
            f"(band {lo:.0%}-{hi:.0%})")
        if lo <= miss <= hi:
            return TargetLoad(x, ts, miss, True, [(p[0], p[1]) for p in probes])
        if miss < lo:
            below = x if below is None else max(below, x)
        else:
            above = x if above is None else min(above, x)
        x = _next_load(x, miss, band, below, above)
    mid = (lo + hi) / 2
    best = min(probes, key=lambda p: abs(p[1] - mid))
    log(f"target probe: no load put mixed's miss rate in {lo:.0%}-{hi:.0%} in {max_probes} "
        f"probes; the closest, load {best[0]:.2f} ({best[1]:.0%}), is used")
    return TargetLoad(best[0], best[2], best[1], False, [(p[0], p[1]) for p in probes])


def loads_markdown(by_load: dict[float, dict]) -> str:
    """A row per load and mode: its ratios to mixed (median over rounds) and mixed's SLO miss
    rate at that load."""
    head = ["load", "mixed SLO viol.", "mode"] + [f"/ mixed {n}" for n in NAMES]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for x, out in by_load.items():
        ratios = dict(out.get("ratio_variants", {}))
        if "ratio" in out:
            ratios = {"laps": out["ratio"], **ratios}
        if "ratio_spatial" in out:
            ratios["laps-spatial"] = out["ratio_spatial"]
        miss = (out.get("mixed") or {}).get("slo_violation_rate")
        for mode, r in ratios.items():
            cells = ["-" if r.get(f) is None else f"{r[f]:.2f}" for f in FIGURES]
            lines.append("| " + " | ".join([f"{x:.2f}", "-" if miss is None else f"{miss:.0%}",
                                           mode] + cells) + " |")
    return "\n".join(lines) + "\n"
