"""Violations by block load: at what load a router wins. Each block (or round) of a
bench_routers.py run is put in a group by the share of SLOs round-robin missed in it -- light
(under 20%), medium (20-50%), heavy (over 50%) -- and every router's violations are pooled per
group, with their ratios to the references, as one table in routers.md (`load_markdown`).
"""

from __future__ import annotations

from laps_jax.sim.load_bands import GROUPS, group_of

BY = "round-robin"  # the router whose misses set a block's load: plain data parallelism


def _count(row: dict) -> tuple[int, int]:
    n = row["completed"] + row["failed"]
    v = row["slo_violations"] if "slo_violations" in row \
        else round(row["slo_violation_rate"] * n)
    return v, n


def by_load(rounds: list[dict[str, dict]], by: str = BY) -> dict[str, dict]:
    """{group: {"blocks": n, "routers": {router: {"violations", "requests"}}}} over the rounds
    (blocks) where `by` ran; empty when it ran in none."""
    out: dict[str, dict] = {}
    for r in rounds:
        if by not in r:
            continue
        v, n = _count(r[by])
        g = out.setdefault(group_of(v / n if n else 0.0), {"blocks": 0, "routers": {}})
        g["blocks"] += 1
        for name, row in r.items():
            v, n = _count(row)
            c = g["routers"].setdefault(name, {"violations": 0, "requests": 0})
            c["violations"] += v
            c["requests"] += n
    return {name: out[name] for name, _, _ in GROUPS if name in out}


def load_markdown(groups: dict[str, dict], references=("round-robin", "smg:cache_aware")) -> str:
    """One row per router and group: pooled violations and the ratio of its rate to each
    reference's in the same blocks."""
    if not groups:
        return ""
    refs = [r for r in references if any(r in g["routers"] for g in groups.values())]
    count = lambda n: f"{n} block" + ("" if n == 1 else "s")  # noqa: E731
    head = ["router"] + [f"{g} ({count(groups[g]['blocks'])})" for g in groups] \
        + [f"{g}: / {r}" for r in refs for g in groups]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    rate = lambda c: c["violations"] / c["requests"] if c and c["requests"] else None
    names = list(dict.fromkeys(n for g in groups.values() for n in g["routers"]))
    for name in names:
        row = [name]
        for g in groups.values():
            c = g["routers"].get(name)
            row.append(f"{c['violations']} / {c['requests']}" if c else "-")
        for ref in refs:
            for g in groups.values():
                a, b = rate(g["routers"].get(name)), rate(g["routers"].get(ref))
                row.append(f"{a / b:.2f}" if a is not None and b else "-")
        lines.append("| " + " | ".join(row) + " |")
    return (f"Violations by block load ({BY} missed under 20%, 20-50%, over 50% of a block's "
            "SLOs), pooled per group:\n\n" + "\n".join(lines) + "\n")
