"""The live single-queue check on the trace family: compare_modes runs, one per member, read
back as the simulated screen reads its cells.

Each member's run (`compare_modes.py --modes mixed,laps --variant hrrn=mixed:order=ratio
--variant srpt=mixed:order=srpt [--variant CANDIDATE=laps:...] --repeats R`) holds every round's
figures per mode. Per round, laps (or a candidate) is set against FCFS (mixed) and against the
better of HRRN and SRPT on each figure (`sim/screen.compare`); a member's ratio is the median of
its rounds' ratios, so one slow round on a shared machine moves it less than a pooled figure
would. The tables and worst-member lines are the screen's own (`sim/screen.markdown`).
"""

from __future__ import annotations

import glob
import json
import os
import statistics

from laps_jax.sim.screen import FIGURES, GOALS_BEST, GOALS_FCFS, compare, met

MODES = {"fcfs": "mixed", "hrrn": "hrrn", "srpt": "srpt"}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def member_cell(member: str, comparison: dict, laps: str = "laps") -> tuple[dict, list[dict]]:
    """One member at one load: the median-of-rounds comparison cell and a row per policy (its
    figures, medians over rounds)."""
    rounds = comparison.get("rounds") or [comparison]
    names = {**MODES, "laps": laps}
    missing = [m for m in names.values() if m not in rounds[0]]
    if missing:
        raise ValueError(f"{member}: the run has no {', '.join(missing)} (compare_modes "
                         f"--modes mixed,laps --variant hrrn=mixed:order=ratio --variant "
                         f"srpt=mixed:order=srpt, and the judged mode or variant)")
    per_round = [compare({p: r[m] for p, m in names.items()}) for r in rounds]
    cell = {"member": member, "fraction": comparison["run"]["load"], "rounds": len(rounds)}
    for key in ("vs_fcfs", "vs_best"):
        cell[key] = {f: _median([c[key][f] for c in per_round]) for f in FIGURES}
    cell["met_fcfs"], cell["met_best"] = (met(cell["vs_fcfs"], GOALS_FCFS),
                                          met(cell["vs_best"], GOALS_BEST))
    rows = [{"workload": member, "fraction": cell["fraction"], "policy": p,
             **{f: _median([r[m].get(f) for r in rounds]) for f in FIGURES}}
            for p, m in names.items()]
    return cell, rows


def _capacity(d: str, member: str, comparison: dict) -> float:
    """mixed's measured requests/s: the run's own, or, for a --target-violation run (which
    replays at the time scale its probes found), its first probe's."""
    cap = comparison["run"].get("mixed_capacity_rps")
    probes = sorted(glob.glob(os.path.join(d, member, "target_probes", "*", "comparison.json")))
    if cap is None and probes:
        with open(probes[0]) as f:
            cap = json.load(f)["run"].get("mixed_capacity_rps")
    return float("nan") if cap is None else cap


def read_runs(dirs: list[str], laps: str = "laps") -> dict:
    """Every DIR/MEMBER[/load_X.XX]/comparison.json under `dirs` (a member is a folder
    named after its trace), as the screen's result: cells, rows, capacity (mixed's requests/s)
    and `skipped` (a line per run without every mode needed)."""
    cells, rows, capacity, skipped = [], [], {}, []
    for d in dirs:
        paths = sorted(glob.glob(os.path.join(d, "*", "comparison.json"))
                       + glob.glob(os.path.join(d, "*", "load_*", "comparison.json")))
        if not paths:
            raise FileNotFoundError(f"no MEMBER/comparison.json or MEMBER/load_X/comparison.json "
                                    f"under {d}")
        for path in paths:
            rel = os.path.relpath(path, d).split(os.sep)
            member = rel[0]
            with open(path) as f:
                comparison = json.load(f)
            try:
                cell, r = member_cell(member, comparison, laps)
            except ValueError as e:
                skipped.append(str(e))
                continue
            cells.append(cell)
            rows += r
            capacity[member] = _capacity(d, member, comparison)
    if not cells:
        raise ValueError("no run holds every mode needed: " + "; ".join(skipped))
    return {"cells": cells, "rows": rows, "capacity_load": capacity, "skipped": skipped}
