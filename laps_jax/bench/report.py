"""What compare_modes makes of its replays: the laps/mixed ratios against issue 4's goals, a
markdown table, TTFT plots and the comparison's files. Each mode's numbers come from
`sim.summary.summarize_requests` (the simulator reports the same fields)."""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import numpy as np

from laps_jax.scheduler.request import LONG, SHORT, RequestStats

# The fields comparison.json promises (README, compare_modes.py), and which way is better for each.
FIELDS = ("ttft_ms_p50", "ttft_ms_p90", "ttft_short_ms_p90", "ttft_long_ms_p90",
          "prefill_latency_ms_mean", "slo_violation_rate", "throughput_tokens_per_s",
          "completed", "failed")
# Issue 4's goals for laps / mixed.
GOALS = {"ttft_short_ms_p90": ("<=", 0.5), "prefill_latency_ms_mean": ("<=", 0.7),
         "slo_violation_rate": ("<=", 0.72), "ttft_long_ms_p90": ("<=", 1.1),
         "throughput_tokens_per_s": (">=", 1.0)}


def ratio(a: dict, b: dict, fields: Sequence[str] = FIELDS) -> dict:
    """a / b for every numeric field both have (None where undefined)."""
    out = {}
    for k in fields:
        x, y = a.get(k), b.get(k)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y:
            out[k] = x / y
        elif isinstance(x, (int, float)) and x == 0 and y == 0:
            out[k] = 1.0
        else:
            out[k] = None
    return out


def goals_met(r: dict) -> dict:
    met = {}
    for k, (op, v) in GOALS.items():
        x = r.get(k)
        met[k] = None if x is None else (x <= v if op == "<=" else x >= v)
    return met


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def median_ratio(rounds: list[dict]) -> dict:
    """Per field, the median of several rounds' ratios (fields undefined in a round skipped)."""
    keys = {k for r in rounds for k in r}
    out = {}
    for k in keys:
        xs = [r[k] for r in rounds if r.get(k) is not None]
        out[k] = float(np.median(xs)) if xs else None
    return out


def markdown(results: dict, ratios: dict) -> str:
    """Per-mode rows and the ratio rows, one column per field."""
    cols = list(FIELDS)
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode, s in results.items():
        lines.append(f"| {mode} | " + " | ".join(_fmt(s.get(c)) for c in cols) + " |")
    for name, r in ratios.items():
        lines.append(f"| **{name}** | " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    goal = [f"{GOALS[c][0]} {GOALS[c][1]}" if c in GOALS else "" for c in cols]
    lines.append("| goal (laps/mixed) | " + " | ".join(goal) + " |")
    return "\n".join(lines) + "\n"


def plot(per_mode: dict[str, list[RequestStats]], path_cdf: str, path_split: str,
         title: str = "") -> None:
    """TTFT CDF per mode; and short vs long TTFT CDFs side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cdf(ax, xs, label):
        xs = np.sort(np.asarray(xs) * 1e3)
        if len(xs):
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{label} (n={len(xs)})")

    def ok(s):
        return s.ttft is not None and s.finish_reason in ("length", "stop")

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, stats in per_mode.items():
        cdf(ax, [s.ttft for s in stats if ok(s)], mode)
    ax.set(xscale="log", xlabel="TTFT (ms)", ylabel="fraction of requests", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path_cdf, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, pool in zip(axes, (SHORT, LONG)):
        for mode, stats in per_mode.items():
            cdf(ax, [s.ttft for s in stats if ok(s) and s.pool == pool], mode)
        ax.set(xscale="log", xlabel="TTFT (ms)", title=f"{pool} requests {title}")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("fraction of requests")
    fig.tight_layout()
    fig.savefig(path_split, dpi=120)
    plt.close(fig)


def busy_note(rounds: list[dict], bound: float | None) -> str:
    """A line naming the runs repeated because others (processes, the hypervisor) took the CPU,
    and the runs kept although they still did (their ratios are suspect); empty if none."""
    rerun, kept = [], []
    for i, summary in enumerate(rounds, 1):
        for mode, r in summary.items():
            if r.get("busy_reruns"):
                rerun.append(f"round {i} {mode} ({r['busy_reruns']}x)")
            share = r.get("others_cpu_share")
            if bound is not None and share is not None and share > bound:
                kept.append(f"round {i} {mode} ({100 * share:.0f}%)")
    parts = []
    if rerun:
        parts.append("Run again because others took the CPU: " + ", ".join(rerun) + ".")
    if kept:
        parts.append(f"Kept with others over {100 * bound:.0f}% of the CPU (suspect): "
                     + ", ".join(kept) + ".")
    return " ".join(parts) + "\n\n" if parts else ""


def write_outputs(out_dir: str, out: dict, rounds: list[dict], results: dict, ratios: dict,
                  every: list[tuple[int, str, list[RequestStats]]],
                  per_mode: dict[str, list[RequestStats]], title: str,
                  log: Callable[[str], None]) -> None:
    """A comparison's files: comparison.json (`out`), comparison.md (round 1's rows, the
    ratios' medians), requests.jsonl (every request of every round) and the TTFT plots."""
    with open(os.path.join(out_dir, "comparison.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(os.path.join(out_dir, "comparison.md"), "w") as f:
        label = f" (median of {len(rounds)} rounds)" if len(rounds) > 1 else ""
        if label:
            f.write(f"Mode rows: round 1 of {len(rounds)}. Ratio rows: median over the rounds' "
                    "ratios (every round in comparison.json, `rounds`).\n\n")
        f.write(busy_note(rounds, out.get("run", {}).get("max_others_cpu")))
        f.write(markdown(results, {k + label: v for k, v in ratios.items()}))
    with open(os.path.join(out_dir, "requests.jsonl"), "w") as f:
        for rnd, mode, stats in every:
            for s in stats:
                f.write(json.dumps({"mode": mode, "round": rnd, **s.to_dict()}) + "\n")
    try:
        plot(per_mode, os.path.join(out_dir, "ttft_cdf.png"),
             os.path.join(out_dir, "ttft_short_long.png"), title)
    except ImportError:
        log("matplotlib is not installed: no PNG plots (pip install 'laps_jax[plots]')")
