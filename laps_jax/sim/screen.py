"""Screening on the trace family: laps against FCFS and a well-ordered single queue, per member.

For each member of `workload/family.py` the simulator first finds FCFS's capacity as the
offered load at which FCFS misses half its TTFT SLOs (bisection on the load; sweep.py's load
counts compute only, which overshoots where short, memory-bound requests dominate), then runs
every policy at `fractions` of it (0.5, 0.7, 0.9 by default): the same arrivals per load, the
same engine, budget and buckets. laps is compared with FCFS, and on each figure with the better
of HRRN and SRPT (mixed's one queue ordered by response ratio, or by fewest remaining tokens
with the wait bound), against the goals of the single-queue issue.
"""

from __future__ import annotations

import math
from typing import Callable

from laps_jax.sim.sweep import Point, run_point

# policy -> (mode, SchedulerConfig settings)
POLICIES: dict[str, tuple[str, tuple]] = {
    "fcfs": ("mixed", ()),
    "hrrn": ("mixed", (("queue_order", "ratio"),)),
    "srpt": ("mixed", (("queue_order", "srpt"),)),
    "laps": ("laps", ()),
}
FIGURES = ("ttft_short_ms_p90", "prefill_latency_ms_mean", "slo_violation_rate",
           "ttft_long_ms_p90", "throughput_tokens_per_s")
HIGHER_IS_BETTER = {"throughput_tokens_per_s"}
GOALS_FCFS = {"ttft_short_ms_p90": 0.5, "prefill_latency_ms_mean": 0.7,
              "slo_violation_rate": 0.72, "ttft_long_ms_p90": 1.1,
              "throughput_tokens_per_s": 0.95}
GOALS_BEST = {"ttft_short_ms_p90": 0.8, "slo_violation_rate": 0.9, "ttft_long_ms_p90": 1.15,
              "throughput_tokens_per_s": 0.97}


def capacity_load(run: Callable[[float], float], target: float = 0.5, lo: float = 0.02,
                  hi: float = 3.0, steps: int = 6) -> float:
    """The load at which `run(load)` (FCFS's SLO violation rate) crosses `target`: geometric
    bisection between `lo` and `hi` (`hi` when it never gets there)."""
    if run(hi) < target:
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if run(mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def best_of(rows: list[dict], figure: str) -> float | None:
    vals = [r.get(figure) for r in rows if r.get(figure) is not None]
    if not vals:
        return None
    return max(vals) if figure in HIGHER_IS_BETTER else min(vals)


def met(ratios: dict, goals: dict) -> bool:
    """Every figure of `goals` known and on the right side of its goal."""
    return all(ratios[f] is not None and (ratios[f] >= g if f in HIGHER_IS_BETTER
                                          else ratios[f] <= g) for f, g in goals.items())


def compare(by_policy: dict[str, dict]) -> dict:
    """laps / fcfs and laps / the better of hrrn and srpt, per figure, and the goals met."""
    laps, fcfs = by_policy["laps"], by_policy["fcfs"]
    single = [by_policy[p] for p in ("hrrn", "srpt") if p in by_policy]
    vs_fcfs = {f: ratio(laps.get(f), fcfs.get(f)) for f in FIGURES}
    vs_best = {f: ratio(laps.get(f), best_of(single, f)) for f in FIGURES}
    return {"vs_fcfs": vs_fcfs, "vs_best": vs_best, "met_fcfs": met(vs_fcfs, GOALS_FCFS),
            "met_best": met(vs_best, GOALS_BEST)}


def worst(cells: list[dict], key: str) -> dict:
    """Per figure, the worst ratio over `cells` (each {"member", "fraction", key: ratios}) and
    where it was."""
    out = {}
    for f in FIGURES:
        have = [(c[key][f], c) for c in cells if c[key].get(f) is not None]
        if have:
            pick = min if f in HIGHER_IS_BETTER else max
            v, c = pick(have, key=lambda x: x[0])
            out[f] = (v, c["member"], c["fraction"])
    return out


def screen(members: list[str], fractions: list[float], policies: dict, src, inst, sources,
           base, log: Callable[[str], None] = print, requests: int | None = None,
           capacity: dict[str, float] | None = None) -> dict:
    """Capacity per member (found, or as given), every policy at each fraction of it, and the
    comparisons."""
    rows, cells, capacity = [], [], dict(capacity or {})
    for m in members:
        fcfs_mode, fcfs_set = policies["fcfs"]
        viol = lambda load: run_point(Point(m, fcfs_mode, load=load, requests=requests,
                                            settings=fcfs_set), src, inst, sources,
                                      base)["slo_violation_rate"] or 0.0
        if m not in capacity:
            capacity[m] = capacity_load(viol)
        log(f"{m}: FCFS misses half its SLOs at load {capacity[m]:.3f}")
        for x in fractions:
            by = {}
            for name, (mode, settings) in policies.items():
                r = run_point(Point(m, mode, load=x * capacity[m], requests=requests,
                                    settings=settings), src, inst, sources, base)
                r.update(policy=name, fraction=x)
                by[name] = r
                rows.append(r)
            cells.append({"member": m, "fraction": x, **compare(by)})
            c = cells[-1]
            log(f"  {x:.1f}: laps/fcfs SLO {c['vs_fcfs']['slo_violation_rate']}, "
                f"laps/best SLO {c['vs_best']['slo_violation_rate']}")
    return {"capacity_load": capacity, "rows": rows, "cells": cells}


_SHORT = {"ttft_short_ms_p90": "short p90", "prefill_latency_ms_mean": "mean prefill",
          "slo_violation_rate": "SLO viol.", "ttft_long_ms_p90": "long p90",
          "throughput_tokens_per_s": "tok/s"}


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(result: dict, capacity: str = "FCFS capacity: load {:.3f}") -> str:
    """One table per member (a row per load) and the worst-case lines; `capacity` formats
    each member's capacity in its heading."""
    out = []
    by_member: dict[str, list[dict]] = {}
    for c in result["cells"]:
        by_member.setdefault(c["member"], []).append(c)
    viol = {(r["workload"], r["fraction"], r["policy"]): r.get("slo_violation_rate")
            for r in result["rows"]}
    head = (["load (x FCFS capacity)", "SLO viol. fcfs / hrrn / srpt / laps"]
            + [f"laps/fcfs {_SHORT[f]}" for f in FIGURES]
            + [f"laps/best {_SHORT[f]}" for f in GOALS_BEST] + ["goals fcfs / best"])
    for m, cells in by_member.items():
        out.append(f"\n#### {m} ({capacity.format(result['capacity_load'][m])})\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for c in cells:
            v = " / ".join(_f(viol.get((m, c["fraction"], p))) for p in
                           ("fcfs", "hrrn", "srpt", "laps"))
            out.append("| " + " | ".join(
                [f"{c['fraction']:.1f}", v] + [_f(c["vs_fcfs"][f]) for f in FIGURES]
                + [_f(c["vs_best"][f]) for f in GOALS_BEST]
                + [f"{'yes' if c['met_fcfs'] else 'no'} / {'yes' if c['met_best'] else 'no'}"])
                + " |")
    for x in sorted({c["fraction"] for c in result["cells"]}):
        out += worst_lines([c for c in result["cells"] if c["fraction"] == x], f"at load {x:.1f}")
    return "\n".join(out) + "\n"


def worst_lines(cells: list[dict], where: str) -> list[str]:
    """The worst member over `cells` per figure, against FCFS and against the best single
    queue, with the goals met."""
    out = []
    for key, goals, name in (("vs_fcfs", GOALS_FCFS, "laps/fcfs"),
                             ("vs_best", GOALS_BEST, "laps/best of hrrn, srpt")):
        w = worst(cells, key)
        parts = [f"{_SHORT[f]} {v:.2f} ({m}; goal {'>=' if f in HIGHER_IS_BETTER else '<='}"
                 f" {goals[f]})" for f, (v, m, _) in w.items() if f in goals]
        out.append(f"\nworst member {where}, {name}: " + "; ".join(parts)
                   + f". Goals met on {sum(c['met_' + key[3:]] for c in cells)} of {len(cells)}.")
    return out
