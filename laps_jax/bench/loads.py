"""compare_modes at several loads, and the regime a comparison ran in.

One load says little: near saturation every ratio swings, far below it nothing queues.
`run_loads` replays the trace at each fraction of mixed's measured capacity (capacity measured
once, at the first load; the others scale the same arrivals' time scale) and `loads_markdown`
puts every mode's ratios to mixed side by side with mixed's own SLO miss rate, so a reader sees
where the load lands. `regime` says whether the short/long cut sits below or above the device's
compute/memory crossover and whether any request was short at all: with `--threshold auto` on a
CPU whose crossover is a few dozen tokens, laps has nearly nothing to separate.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

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
