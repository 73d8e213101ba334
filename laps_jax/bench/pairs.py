"""One router against another over the rounds of several bench_routers.py runs: how many rounds
it takes to tell two routers apart on a noisy machine.

A live replay on three instances sharing two cores swings 2-3x from round to round (slow spells
of the machine, queues that build or do not), so one run's 3-5 rounds rarely order two routers
that differ by 10-30%. Rounds of runs made with the same settings are comparable pairs (each
round replays the same arrivals through both routers, the targets are each run's own), so
pooling the pairs of several runs is a fair way to get more of them. For each pair the ratio of
SLO violations (router / reference); over all pairs the median, the geometric mean, the ratio of
pooled counts, the rounds won, and a bootstrap interval of the pooled ratio (pairs resampled
with replacement) that says whether the order is settled. A run made with `--block` records
one pair per block (every router replayed the block before the next began); its blocks are the
pairs here, and its runs pool only with runs of the same block size. The blocks of one round
ran minutes apart on the same machine and share its slow or fast spell, so they are not
independent draws: a second interval resamples whole rounds (all their blocks together), the
honest one when the machine's speed drifts between rounds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

from laps_jax.bench.bands import over_target
from laps_jax.bench.routers import replay_records, run_targets

SPEED = "instances_prefill_ms_per_request"  # a replay's own measure of the machine's speed

# settings two runs must share for their rounds to be pooled (routers.json's `args`)
SAME = ("max_requests", "length_scale", "time_scale", "sample", "instances", "model",
        "max_model_len", "serve_args", "pin_cpus", "slo_scale", "slo_ms", "short_threshold",
        "seed", "block")


@dataclasses.dataclass
class Pair:
    run: str
    round_no: int
    router: int      # SLO violations of the router in that round (or block)
    reference: int   # and of the reference
    block_no: int = 0  # the block of the round (0: the round replayed the trace whole)

    @property
    def ratio(self) -> float:
        return self.router / self.reference if self.reference else \
            (1.0 if not self.router else math.inf)


def settings(run: dict, trace: str) -> dict:
    """The settings that decide a trace's load in a run (per-trace overrides applied)."""
    a = run["args"]
    out = {k: a.get(k) for k in SAME}
    out["block"] = out["block"] or 0  # runs from before --block replayed whole traces
    # the trace file itself (a kind names a format, two runs may replay different files)
    # (runs before traces had names recorded [kind, path]; later ones [name, kind, path])
    out["trace_file"] = [t[-1] for t in a.get("trace") or [] if t[0] == trace]
    for k in ("max_requests", "length_scale", "time_scale", "sample"):
        per = a.get(f"{k}_for") or {}  # bench_routers.py's --KEY-for KIND=VALUE, parsed
        if trace in per:
            out[k] = per[trace]
    return out


def blocks_per_round(run: dict, trace: str) -> int:
    """How many pairs one round of `trace` holds in a run: its `blocks_per_round` entry, or for
    a finished block run from before that entry its pairs over its rounds; else 1."""
    n = (run.get("blocks_per_round") or {}).get(trace)
    if n:
        return int(n)
    a, rows = run.get("args", {}), run.get("traces", {}).get(trace, {}).get("rounds", [])
    if a.get("block") and run.get("complete") and a.get("rounds") and rows:
        return max(len(rows) // int(a["rounds"]), 1)
    return 1


def pairs(runs: dict[str, dict], trace: str, router: str, reference: str) -> list[Pair]:
    """Every round (or block) of every run where both routers replayed `trace`, with its
    violations."""
    out = []
    for name, run in runs.items():
        per = blocks_per_round(run, trace)
        for k, row in enumerate(run.get("traces", {}).get(trace, {}).get("rounds", [])):
            a, b = row.get(router), row.get(reference)
            if a and b and a.get("slo_violations") is not None \
                    and b.get("slo_violations") is not None:
                out.append(Pair(name, k // per + 1, int(a["slo_violations"]),
                                int(b["slo_violations"]), k % per + 1 if per > 1 else 0))
    return out


def speed_adjusted(run_dirs: dict[str, str], runs: dict[str, dict], trace: str, router: str,
                   reference: str) -> list[Pair]:
    """`pairs`, with each replay's misses recounted against targets scaled by how slow the
    instances ran in it: target x its prefill ms per request / the pair's mean. The routers
    of the runs measured here leave the instances the same steps (bench/instance_steps.py),
    yet a replay's compute per request drifts by a tenth or more within a run, and its misses
    follow that drift; scaled targets take the drift out, and with it the part of the speed
    a router's placement causes (two busy instances slow each other: behind laps-inflow the
    instances computed 1.04x smg cache_aware's prefill ms per request over 20 paired
    rounds). That part favours the router that slows the instances, so read this beside
    the raw counts. Rounds without the speed or the per-request records (runs made before
    either, blocks) are left out."""
    out = []
    for name, run in runs.items():
        target = run_targets(run)
        if target is None or blocks_per_round(run, trace) > 1:
            continue
        for k, row in enumerate(run.get("traces", {}).get(trace, {}).get("rounds", [])):
            a, b = row.get(router) or {}, row.get(reference) or {}
            if not a.get(SPEED) or not b.get(SPEED):
                continue
            mean = (a[SPEED] + b[SPEED]) / 2
            misses = []
            for who, speed in ((router, a[SPEED]), (reference, b[SPEED])):
                recs = replay_records(run_dirs[name], trace, k + 1, who)
                if recs is None:
                    break
                slow = speed / mean
                misses.append(sum(over_target(r, lambda r: slow * target(r)) > 1 for r in recs))
            if len(misses) == 2:
                out.append(Pair(name, k + 1, misses[0], misses[1]))
    return out


def mismatched(runs: dict[str, dict], trace: str) -> dict[str, list]:
    """Settings that differ between the runs: {setting: [value per run]} (empty: poolable)."""
    s = [settings(r, trace) for r in runs.values()]
    return {k: [x[k] for x in s] for k in s[0] if len({json.dumps(x[k]) for x in s}) > 1}


def interval90(groups: list[list[Pair]], draws: int, seed: int) -> tuple[float, float]:
    """90% bootstrap interval of the pooled ratio, resampling the groups whole."""
    rng = random.Random(seed)
    sums = [(sum(p.router for p in g), sum(p.reference for p in g)) for g in groups]
    boot = []
    for _ in range(draws):
        sample = [sums[rng.randrange(len(sums))] for _ in sums]
        boot.append(sum(a for a, _ in sample) / max(sum(b for _, b in sample), 1))
    boot.sort()
    return boot[int(0.05 * (draws - 1))], boot[int(0.95 * (draws - 1))]


def summary(ps: list[Pair], draws: int = 10000, seed: int = 0) -> dict:
    """Median and geometric mean of per-pair ratios, pooled ratio, pairs won, and 90%
    bootstrap intervals of the pooled ratio over pairs and over whole rounds."""
    if not ps:
        raise ValueError("no round has both routers")
    ratios = [p.ratio for p in ps]
    finite = [r for r in ratios if 0 < r < math.inf]
    total, ref_total = sum(p.router for p in ps), sum(p.reference for p in ps)
    whole: dict[tuple[str, int], list[Pair]] = {}
    for p in ps:
        whole.setdefault((p.run, p.round_no), []).append(p)
    return {"rounds": len(ps), "whole_rounds": len(whole),
            "won": sum(p.router < p.reference for p in ps),
            "lost": sum(p.router > p.reference for p in ps),
            "median": statistics.median(ratios),
            "geomean": math.exp(statistics.fmean(map(math.log, finite))) if finite else None,
            "pooled": total / max(ref_total, 1), "router_total": total,
            "reference_total": ref_total,
            "interval90": interval90([[p] for p in ps], draws, seed),
            "interval90_rounds": interval90(list(whole.values()), draws, seed)}


def markdown(ps: list[Pair], s: dict, router: str, reference: str) -> str:
    lines = [f"| run | round | {router} | {reference} | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {p.run} | {p.round_no}{f'.{p.block_no}' if p.block_no else ''} | {p.router} "
              f"| {p.reference} | {p.ratio:.2f} |" for p in ps]
    lo, hi = s["interval90"]
    geo = "—" if s["geomean"] is None else f"{s['geomean']:.2f}"
    blocked = s["whole_rounds"] < s["rounds"]
    unit = "blocks" if blocked else "rounds"
    lines += ["", f"{s['rounds']} {unit}: {router} won {s['won']}, lost {s['lost']}; "
              f"per-{unit[:-1]} ratio median {s['median']:.2f}, geometric mean {geo}; pooled "
              f"{s['router_total']} / {s['reference_total']} = {s['pooled']:.2f}, 90% bootstrap "
              f"interval [{lo:.2f}, {hi:.2f}]"]
    if blocked:
        lo, hi = s["interval90_rounds"]
        lines += [f"resampling the {s['whole_rounds']} rounds whole (their blocks share the "
                  f"machine's spell): [{lo:.2f}, {hi:.2f}]"]
    return "\n".join(lines) + "\n"
