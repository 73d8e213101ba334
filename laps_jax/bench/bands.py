"""Violations by new-token band: which requests a router wins or loses. The shortest wait out
the step in progress (and decode steps), the longest wait for queues; one overall violation
rate hides which. Counted per replay (`by_band`), pooled over rounds (`pooled_bands`) and shown
as a table (`band_markdown`) in bench_routers.py's routers.md.
"""

from __future__ import annotations

import numpy as np

# new-token edges of the bands a replay's violations are counted in: where a router wins or
# loses (the shortest requests wait out steps in progress, the longest wait for queues)
BAND_EDGES = (64, 256, 1024)


def band_of(new_tokens: int, edges: tuple[int, ...] = BAND_EDGES) -> str:
    lo = 1
    for hi in edges:
        if new_tokens <= hi:
            return f"{lo}-{hi}"
        lo = hi + 1
    return f"over {edges[-1]}"


def over_target(r, target) -> float:
    """TTFT / the request's target (inf for a failure or no first token): > 1 is a violation."""
    ok = r.status == 200 and r.ttft_s is not None
    return r.ttft_s * 1000 / target(r) if ok else float("inf")


def by_band(reqs, target) -> dict[str, dict]:
    """Per new-token band (`band_of`, by the trace's new tokens as the target is): requests,
    violations of their own targets, and the median of TTFT / target (a failure counts as
    over any target: None when the median is one)."""
    groups: dict[str, list[float]] = {}
    for r in reqs:
        groups.setdefault(band_of(max(r.new_tokens, 1)), []).append(over_target(r, target))
    out = {}
    for band in sorted(groups, key=_band_start):
        xs = groups[band]
        m = float(np.median(xs))
        out[band] = {"requests": len(xs), "violations": sum(x > 1 for x in xs),
                     "ttft_over_target_p50": m if np.isfinite(m) else None}
    return out


def _band_start(band: str) -> int:
    return int(band.split()[-1]) + 1 if band.startswith("over") else int(band.split("-")[0])


def pooled_bands(rows: list[dict]) -> dict[str, dict]:
    """Per band, violations and requests summed over rounds, and the median over rounds of
    each round's median TTFT / target (rounds without band counts are left out)."""
    out: dict[str, dict] = {}
    for row in rows:
        for band, b in row.get("bands", {}).items():
            o = out.setdefault(band, {"requests": 0, "violations": 0, "over": []})
            o["requests"] += b["requests"]
            o["violations"] += b["violations"]
            o["over"].append(b["ttft_over_target_p50"])
    for o in out.values():
        xs = [x for x in o.pop("over") if x is not None]
        o["ttft_over_target_p50"] = float(np.median(xs)) if xs else None
    return dict(sorted(out.items(), key=lambda kv: _band_start(kv[0])))


def band_markdown(summary: dict) -> str:
    """Violations by new-token band, pooled over rounds: `violations / requests (median TTFT /
    its target)` per router; empty when no round counted bands (no isolated targets)."""
    bands = summary.get("bands")
    if not bands:
        return ""
    labels = sorted({b for per in bands.values() for b in per}, key=_band_start)
    head = ["router"] + [f"{b} new tokens" for b in labels]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, per in bands.items():
        cells = [name]
        for b in labels:
            x = per.get(b)
            if x is None:
                cells.append("-")
                continue
            m = x["ttft_over_target_p50"]
            cells.append(f"{x['violations']} / {x['requests']} "
                         f"({'failed' if m is None else f'{m:.2f}'})")
        lines.append("| " + " | ".join(cells) + " |")
    return ("Violations by new tokens, pooled over rounds (median TTFT / its target):\n\n"
            + "\n".join(lines) + "\n")
