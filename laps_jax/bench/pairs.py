"""One router against another over the rounds of several bench_routers.py runs: how many rounds
it takes to tell two routers apart on a noisy machine.

A live replay on three instances sharing two cores swings 2-3x from round to round (slow spells
of the machine, queues that build or do not), so one run's 3-5 rounds rarely order two routers
that differ by 10-30%. Rounds of runs made with the same settings are comparable pairs (each
round replays the same arrivals through both routers, the targets are each run's own), so
pooling the pairs of several runs is a fair way to get more of them. For each pair the ratio of
SLO violations (router / reference); over all pairs the median, the geometric mean, the ratio of
pooled counts, the rounds won, and a bootstrap interval of the pooled ratio (rounds resampled
with replacement) that says whether the order is settled. A run made with `--block` records
one pair per block (every router replayed the block before the next began); its blocks count
as rounds here, and its runs pool only with runs of the same block size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics

# settings two runs must share for their rounds to be pooled (routers.json's `args`)
SAME = ("max_requests", "length_scale", "time_scale", "sample", "instances", "model",
        "max_model_len", "serve_args", "pin_cpus", "slo_scale", "slo_ms", "short_threshold",
        "seed", "block")


@dataclasses.dataclass
class Pair:
    run: str
    round_no: int
    router: int      # SLO violations of the router in that round
    reference: int   # and of the reference

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
    out["trace_file"] = [path for kind, path in a.get("trace") or [] if kind == trace]
    for k in ("max_requests", "length_scale", "time_scale", "sample"):
        per = a.get(f"{k}_for") or {}  # bench_routers.py's --KEY-for KIND=VALUE, parsed
        if trace in per:
            out[k] = per[trace]
    return out


def pairs(runs: dict[str, dict], trace: str, router: str, reference: str) -> list[Pair]:
    """Every round of every run where both routers replayed `trace`, with its violations."""
    out = []
    for name, run in runs.items():
        for k, row in enumerate(run.get("traces", {}).get(trace, {}).get("rounds", [])):
            a, b = row.get(router), row.get(reference)
            if a and b and a.get("slo_violations") is not None \
                    and b.get("slo_violations") is not None:
                out.append(Pair(name, k + 1, int(a["slo_violations"]),
                                int(b["slo_violations"])))
    return out


def mismatched(runs: dict[str, dict], trace: str) -> dict[str, list]:
    """Settings that differ between the runs: {setting: [value per run]} (empty: poolable)."""
    s = [settings(r, trace) for r in runs.values()]
    return {k: [x[k] for x in s] for k in s[0] if len({json.dumps(x[k]) for x in s}) > 1}


def summary(ps: list[Pair], draws: int = 10000, seed: int = 0) -> dict:
    """Median and geometric mean of per-round ratios, pooled ratio, rounds won, and a 90%
    bootstrap interval of the pooled ratio over rounds."""
    if not ps:
        raise ValueError("no round has both routers")
    ratios = [p.ratio for p in ps]
    finite = [r for r in ratios if 0 < r < math.inf]
    total, ref_total = sum(p.router for p in ps), sum(p.reference for p in ps)
    rng = random.Random(seed)
    boot = []
    for _ in range(draws):
        sample = [ps[rng.randrange(len(ps))] for _ in ps]
        boot.append(sum(p.router for p in sample) / max(sum(p.reference for p in sample), 1))
    boot.sort()
    return {"rounds": len(ps), "won": sum(p.router < p.reference for p in ps),
            "lost": sum(p.router > p.reference for p in ps),
            "median": statistics.median(ratios),
            "geomean": math.exp(statistics.fmean(map(math.log, finite))) if finite else None,
            "pooled": total / max(ref_total, 1), "router_total": total,
            "reference_total": ref_total,
            "interval90": (boot[int(0.05 * (draws - 1))], boot[int(0.95 * (draws - 1))])}


def markdown(ps: list[Pair], s: dict, router: str, reference: str) -> str:
    lines = [f"| run | round | {router} | {reference} | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {p.run} | {p.round_no} | {p.router} | {p.reference} | {p.ratio:.2f} |"
              for p in ps]
    lo, hi = s["interval90"]
    geo = "—" if s["geomean"] is None else f"{s['geomean']:.2f}"
    lines += ["", f"{s['rounds']} rounds: {router} won {s['won']}, lost {s['lost']}; "
              f"per-round ratio median {s['median']:.2f}, geometric mean {geo}; pooled "
              f"{s['router_total']} / {s['reference_total']} = {s['pooled']:.2f}, 90% bootstrap "
              f"interval [{lo:.2f}, {hi:.2f}]"]
    return "\n".join(lines) + "\n"
