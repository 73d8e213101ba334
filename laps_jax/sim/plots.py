"""Figures of the simulation study (PNG). Pure functions over result rows (sweep.run_points)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

COLORS = {"mixed": "tab:gray", "laps": "tab:blue", "laps-spatial": "tab:green",
          "round-robin": "tab:gray", "least-load": "tab:orange", "length-aware": "tab:blue",
          "fcfs": "tab:gray", "hrrn": "tab:orange", "srpt": "tab:red"}
SWEEP_METRICS = (("prefill_latency_ms_mean", "mean prefill latency (ms)", True),
                 ("ttft_ms_p90", "TTFT p90 (ms)", True),
                 ("slo_violation_rate", "SLO violation rate", False))
SCREEN_METRICS = (("ttft_short_ms_p90", "short TTFT p90 (ms)", True),
                  ("ttft_long_ms_p90", "long TTFT p90 (ms)", True),
                  ("slo_violation_rate", "SLO violation rate", False))


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: str, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series(rows: list[dict], key, x: str, y: str) -> dict:
    out = defaultdict(list)
    for r in rows:
        if r.get(y) is not None and r.get(x) is not None:
            out[key(r)].append((r[x], r[y]))
    return {k: sorted(v) for k, v in out.items()}


def load_sweep(rows: list[dict], path: str, title: str = "", by: str = "mode",
               x: str = "load", metrics=SWEEP_METRICS,
               xlabel: str = "offered load (new tokens / physical limit)") -> None:
    """Single instance: a column per workload, a row per metric, a line per `by` (a mode, or a
    policy of the single-queue screen) against `x`."""
    plt = _plt()
    rows = [r for r in rows if r["instances"] == 1 and r.get(x) is not None]
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(len(metrics), len(names), figsize=(4.2 * len(names), 9),
                             squeeze=False)
    for j, name in enumerate(names):
        sub = [r for r in rows if r["workload"] == name]
        for i, (key, label, log) in enumerate(metrics):
            ax = axes[i][j]
            for mode, pts in _series(sub, lambda r: r[by], x, key).items():
                xs, ys = zip(*pts)
                ax.plot(xs, ys, "o-", ms=3, label=mode, color=COLORS.get(mode))
            ax.set(yscale="log" if log else "linear", ylabel=label if j == 0 else None)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(name)
            if i == len(metrics) - 1:
                ax.set_xlabel(xlabel)
        drawn = [ax for ax in (row[j] for row in axes) if ax.get_legend_handles_labels()[0]]
        if drawn:  # the first panel with a line (no short requests: the short row is empty)
            drawn[0].legend(fontsize=8)
    _save(plt, fig, path, title)


def router(rows: list[dict], path: str, load: float, title: str = "") -> None:
    """Multi-instance at one load: SLO violations and TTFT p90 vs instance count, per policy
    and instance mode."""
    plt = _plt()
    rows = [r for r in rows if r["instances"] > 1 and r.get("load") == load]
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(names), figsize=(4.4 * len(names), 7), squeeze=False)
    for j, name in enumerate(names):
        sub = [r for r in rows if r["workload"] == name]
        for i, (key, label) in enumerate((("slo_violation_rate", "SLO violation rate"),
                                          ("ttft_ms_p90", "TTFT p90 (ms)"))):
            ax = axes[i][j]
            for (pol, mode), pts in _series(sub, lambda r: (r["policy"], r["mode"]),
                                            "instances", key).items():
                xs, ys = zip(*pts)
                ax.plot(xs, ys, "o-" if mode != "mixed" else "s--", ms=4,
                        label=f"{pol} / {mode}", color=COLORS.get(pol))
            ax.set(xticks=sorted({r["instances"] for r in sub}),
                   ylabel=label if j == 0 else None, yscale="log" if i else "linear")
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"{name} (load {load})")
            else:
                ax.set_xlabel("instances")
        axes[0][j].legend(fontsize=7)
    _save(plt, fig, path, title)


def concurrency(rows: list[dict], path: str, title: str = "") -> None:
    """Prefill throughput vs concurrency per mode, computed and cached tokens apart, with the
    physical limit of computed tokens drawn in."""
    plt = _plt()
    rows = [r for r in rows if r.get("concurrency")]
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for j, name in enumerate(names):
        ax = axes[0][j]
        sub = [r for r in rows if r["workload"] == name]
        for mode, pts in _series(sub, lambda r: r["mode"], "concurrency", "computed_tok_s").items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "o-", ms=3, label=f"{mode} computed", color=COLORS.get(mode))
        for mode, pts in _series(sub, lambda r: r["mode"], "concurrency", "prompt_tok_s").items():
            xs, ys = zip(*pts)
            if max(ys) > 1.01 * max(y for _, y in _series(sub, lambda r: r["mode"], "concurrency",
                                                           "computed_tok_s")[mode]):
                ax.plot(xs, ys, ":", label=f"{mode} computed + cached", color=COLORS.get(mode))
        limits = [r["physical_limit_tok_s"] for r in sub if r.get("physical_limit_tok_s")]
        if limits:
            ax.axhline(max(limits), color="k", lw=1, ls="--", label="physical limit (computed)")
        for mode, pts in _series(sub, lambda r: r["mode"], "concurrency", "padded_tok_s").items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "x--", ms=3, lw=0.8, label=f"{mode} padding", color=COLORS.get(mode))
        ax.set(xscale="log", xlabel="concurrent requests", title=name, ylim=(0, None),
               ylabel="prefill tokens/s" if j == 0 else None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path, title)


def validation(result: dict, path: str) -> None:
    """Real vs simulated TTFT p50/p90 per mode and pool."""
    plt = _plt()
    rows = [r for r in result["rows"] if r["real_p50_ms"] is not None]
    labels = [f"{r['mode'].replace('laps-spatial', 'spatial')}\n{r['pool']}" for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(rows)) * 1.4, 4))
    for ax, q in zip(axes, ("p50", "p90")):
        real = [r[f"real_{q}_ms"] or 0 for r in rows]
        sim = [r[f"sim_{q}_ms"] or 0 for r in rows]
        ax.bar(x - 0.2, real, 0.4, label="real (compare_modes)", color="tab:gray")
        ax.bar(x + 0.2, sim, 0.4, label="simulated", color="tab:blue")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set(ylabel=f"TTFT {q} (ms)", title=f"TTFT {q}: real vs simulated")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
