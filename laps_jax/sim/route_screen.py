"""Screening the routers on the trace family: every policy behind N laps instances, per member,
instance count and load, reported as the router issue's goals are set.

Each cell (member, N, load, seed) runs every policy on the same arrivals. A cell's band is
round-robin's SLO miss rate there: light (< 20%), medium (20-50%), heavy (> 50%), as
bench_routers.py groups its live blocks. Violations are pooled over a band's cells (counts,
not a mean of rates), and each laps variant is set against round-robin and against `prefix`
(the SGLang gateway's cache_aware decisions), per member and for the worst member.

One seed per cell is not enough to rank these routers: the single-seed screen had
laps-adaptive meeting every goal, and five seeds pooled (`--seed`, then `--from-rows` over
the runs) put it at 0.94x prefix in medium load and 1.01x under overload. Rows carry their
seed, so cells of different seeds pool by band, not replace each other.

A count of misses says nothing about how late the misses are, and a router can buy a lower
count by letting one instance fall far behind (its requests miss by seconds, the others'
meet). So rows also carry each cell's TTFT p90, p99 and mean, and the report sets each
candidate's tails against the baselines: the geometric mean over a band's cells of the
per-cell ratio (percentiles of different cells do not pool).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from laps_jax.sim.load_bands import GROUPS, group_of as band_of
from laps_jax.sim.miss_split import line as split_line
from laps_jax.sim.sweep import Point, run_point

POLICIES = ("round-robin", "least-load", "prefix", "bucket", "laps", "laps-adaptive",
            "laps-inflow", "laps-inflow+hold")
CANDIDATES = ("laps", "laps-adaptive", "laps-inflow", "laps-inflow+hold")
BANDS = tuple(name for name, _, _ in GROUPS)
TAILS = ("ttft_ms_p90", "ttft_ms_p99", "ttft_ms_mean")
FEW = 5  # under this many misses on both sides a ratio decides nothing (shown, not judged)
# (band, against) -> the goal on pooled violations (issue: light and medium <= 0.72x RR and
# <= 0.88x cache_aware; heavy <= 0.95x RR and <= 1.0x cache_aware)
GOALS = {("light", "round-robin"): 0.72, ("medium", "round-robin"): 0.72,
         ("heavy", "round-robin"): 0.95, ("light", "prefix"): 0.88,
         ("medium", "prefix"): 0.88, ("heavy", "prefix"): 1.0}


def screen(members: list[str], counts: list[int], loads: list[float], src, inst, sources,
           base, requests: int, log: Callable[[str], None] = print,
           checkpoint: str | None = None, policies=POLICIES, split: bool = False) -> list[dict]:
    """One row per (member, N, load, policy): its SLO misses, requests and tok/s, and the
    seed of the member's workload source (with `split`, also where the misses are, logged
    and kept in the row: `miss_split.py`)."""
    rows = []
    for m in members:
        for n in counts:
            for x in loads:
                for pol in policies:
                    r = run_point(Point(m, "laps", n, pol, load=x, requests=requests),
                                  src, inst, sources, base, split)
                    row = {"member": m, "n": n, "load": x, "policy": pol,
                           "seed": sources[m].seed,
                           "completed": r.get("completed") or 0,
                           "violations": round((r.get("slo_violation_rate") or 0.0)
                                               * (r.get("completed") or 0)),
                           "tok_s": r.get("prompt_tok_s") or 0.0, "wall_s": r["wall_s"]}
                    row.update({k: r[k] for k in TAILS if r.get(k) is not None})
                    if split:
                        row["miss_split"] = r["miss_split"]
                        log(f"  {pol}: {split_line(r['miss_split'])}")
                    rows.append(row)
                    if checkpoint:
                        with open(checkpoint, "a") as f:
                            f.write(json.dumps(row) + "\n")
                done = rows[-len(policies):]
                log(f"{m} N={n} load {x}: " + ", ".join(
                    f"{r['policy']} {r['violations']}/{r['completed']}" for r in done))
    return rows


def merge_rows(paths: list[str]) -> list[dict]:
    """The rows of several rows.jsonl files; a later row replaces an earlier one of the same
    member, N, load, policy and seed (0 where a row has none)."""
    out: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    out[(r["member"], r["n"], r["load"], r["policy"], r.get("seed", 0))] = r
    return list(out.values())


def cells(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(member, N, load, seed) -> policy -> row."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["member"], r["n"], r["load"], r.get("seed", 0)), {})[r["policy"]] = r
    return out


def band_cells(rows: list[dict]):
    """(member, band, policy -> row) per cell with a round-robin row that completed any."""
    for (m, *_), by in cells(rows).items():
        rr = by.get("round-robin")
        if rr is not None and rr["completed"]:
            yield m, band_of(rr["violations"] / rr["completed"]), by


def pooled(rows: list[dict]) -> dict:
    """Per (member or 'all', band): each policy's pooled violations, requests and tok/s."""
    out: dict[tuple, dict[str, list[float]]] = {}
    for m, band, by in band_cells(rows):
        for key in ((m, band), ("all members", band)):
            for pol, r in by.items():
                acc = out.setdefault(key, {}).setdefault(pol, [0, 0, 0.0])
                acc[0] += r["violations"]
                acc[1] += r["completed"]
                acc[2] += r["tok_s"]
    return out


def tails(rows: list[dict], against: str = "prefix") -> dict:
    """Per (member or 'all members', band) and candidate: the geometric mean over the cells of
    the candidate's TTFT p90, p99 and mean over `against`'s, and the cells counted (cells
    without those figures, or with a zero, are left out)."""
    logs: dict[tuple, dict[str, list[list[float]]]] = {}
    for m, band, by in band_cells(rows):
        base = by.get(against)
        for c in CANDIDATES:
            r = by.get(c)
            if base is None or r is None or not all(r.get(k) and base.get(k) for k in TAILS):
                continue
            for key in ((m, band), ("all members", band)):
                acc = logs.setdefault(key, {}).setdefault(c, [[] for _ in TAILS])
                for a, k in zip(acc, TAILS):
                    a.append(math.log(r[k] / base[k]))
    return {key: {c: ([math.exp(sum(a) / len(a)) for a in acc], len(acc[0]))
                  for c, acc in by.items()} for key, by in logs.items()}


def _ratio(a: float, b: float) -> float | None:
    return (1.0 if a == 0 else None) if b == 0 else a / b


def markdown(rows: list[dict]) -> str:
    """Per member and band: pooled violations per policy, the candidates' ratios and goals;
    then the worst member per band and candidate (rows without round-robin and prefix: only
    one line per row)."""
    ran = {r["policy"] for r in rows}
    every = set(ran)
    for by in cells(rows).values():
        every &= set(by)
    if not {"round-robin", "prefix"} <= every:
        return "\n".join(f"- {r['member']} N={r['n']} load {r['load']}: {r['policy']} "
                         f"{r['violations']}/{r['completed']}" for r in rows) + "\n"
    # a policy run on only some cells would be pooled over other cells than its baselines
    dropped = sorted(ran - every, key=lambda p: POLICIES.index(p))
    rows = [r for r in rows if r["policy"] in every]
    pol = sorted(every, key=lambda p: POLICIES.index(p))
    cands = [c for c in CANDIDATES if c in pol]
    head = (["member", "band (RR miss)", "cells"] + [f"{p} viol." for p in pol]
            + [f"{c}/{b}" for c in cands for b in ("RR", "prefix")]
            + [f"{c} tok/s / max(RR, prefix)" for c in cands])
    out = ([f"Left out, as not run on every cell: {', '.join(dropped)}.", ""] if dropped else [])
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = pooled(rows)
    n_cells = {}
    for m, b, _ in band_cells(rows):
        for key in ((m, b), ("all members", b)):
            n_cells[key] = n_cells.get(key, 0) + 1
    worst: dict[tuple, tuple[float, str]] = {}
    for (m, b), by in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all members",
                                                             kv[0][0], BANDS.index(kv[0][1]))):
        line = [m, b, str(n_cells[(m, b)])]
        line += [f"{by[p][0]:.0f}/{by[p][1]:.0f}" for p in pol]
        for c in cands:
            for base in ("round-robin", "prefix"):
                if max(by[c][0], by[base][0]) < FEW:
                    line.append(f"few ({by[c][0]:.0f} vs {by[base][0]:.0f})")
                    continue
                r = _ratio(by[c][0] / max(by[c][1], 1), by[base][0] / max(by[base][1], 1))
                goal = GOALS[(b, base)]
                line.append("-" if r is None else f"{r:.2f}{'' if r <= goal else ' ✗'}")
                if r is not None and m != "all members":
                    k = (c, base, b)
                    if k not in worst or r > worst[k][0]:
                        worst[k] = (r, m)
        for c in cands:
            t = _ratio(by[c][2], max(by["round-robin"][2], by["prefix"][2]))
            line.append("-" if t is None else f"{t:.3f}")
        out.append("| " + " | ".join(line) + " |")
    out.append("")
    for (c, base, b), (r, m) in sorted(worst.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                      BANDS.index(kv[0][2]))):
        goal = GOALS[(b, base)]
        out.append(f"- {c} / {base}, {b} blocks: worst member {m} {r:.2f} (goal <= {goal}: "
                   f"{'met' if r <= goal else 'missed'})")
    t = tails(rows)
    if t:
        out += ["", "TTFT tails against prefix: geometric mean over the cells of the per-cell "
                "ratio (under 1: the candidate's are shorter)", "",
                "| member | band | " + " | ".join(f"{c} {k} / prefix" for c in cands
                                                  for k in ("p90", "p99", "mean")) + " |",
                "|---|---|" + "---|" * (3 * len(cands))]
        for (m, b), by in sorted(t.items(), key=lambda kv: (kv[0][0] == "all members",
                                                          kv[0][0], BANDS.index(kv[0][1]))):
            line = [m, f"{b} ({max(n for _, n in by.values())} cells)"]
            for c in cands:
                line += [f"{x:.2f}" for x in by[c][0]] if c in by else ["-"] * 3
            out.append("| " + " | ".join(line) + " |")
    return "\n".join(out) + "\n"
