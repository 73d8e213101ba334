"""Real against predicted TTFT cells (p50 and p90, per mode and pool): the tables, the
verdicts and the noise floors the simulator's validation is judged by.

A cell is within tolerance when |predicted - real| / real <= tolerance; pools with fewer than
`min_samples` requests are shown, not judged. Besides one round against its prediction, two
noise floors: a real round against the next one, and for a --repeats run the odd rounds'
median against the even rounds'. With a sensitivity, a third gauge: each cell's gain (its
relative change per relative change of every step time), which says how exactly the step
times must be known for the cell to pass at all.
"""

from __future__ import annotations

import gzip
import json
import os

import numpy as np

POOLS = ("all", "short", "long")


def _percentiles(ttfts: list[float]) -> dict:
    if not ttfts:
        return {"n": 0, "p50": None, "p90": None}
    return {"n": len(ttfts), "p50": 1e3 * float(np.percentile(ttfts, 50)),
            "p90": 1e3 * float(np.percentile(ttfts, 90))}


def by_pool(rows: list[dict]) -> dict:
    ok = [r for r in rows if r.get("ttft") is not None and r.get("finish_reason") in
          ("length", "stop")]
    return {p: _percentiles([r["ttft"] for r in ok if p == "all" or r["pool"] == p])
            for p in POOLS}


def real_requests(run_dir: str, rnd: int = 1) -> dict[str, list[dict]]:
    """One round's requests per mode (runs recorded before rounds were kept: round 1 only).
    Reads `requests.jsonl`, or `requests.jsonl.gz` (how docs/data keeps runs)."""
    real: dict[str, list[dict]] = {}
    path = os.path.join(run_dir, "requests.jsonl")
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            r = json.loads(line)
            if r.get("round", 1) == rnd:
                real.setdefault(r["mode"], []).append(r)
    return real


def run_rounds(comp: dict) -> int:
    """Rounds whose requests and lane metrics a compare_modes run kept."""
    return len(comp.get("metrics_rounds", [])) or 1


def compare_row(mode: str, pool: str, a: dict, b: dict) -> dict:
    row = {"mode": mode, "pool": pool, "n_real": a["n"], "n_sim": b["n"]}
    for q in ("p50", "p90"):
        x, y = a[q], b[q]
        row.update({f"real_{q}_ms": x, f"sim_{q}_ms": y,
                    f"err_{q}": (y - x) / x if x and y is not None else None})
    return row


def _errors(rows: list[dict], min_samples: int) -> list[float]:
    return [abs(r[f"err_{q}"]) for r in rows for q in ("p50", "p90")
            if r[f"err_{q}"] is not None and r["n_real"] >= min_samples]


def verdict(rows: list[dict], min_samples: int, tolerance: float) -> dict:
    errs = _errors(rows, min_samples)
    return {"worst_abs_error": max(errs, default=0.0),
            "median_abs_error": float(np.median(errs)) if errs else 0.0,
            "cells_within_tolerance": sum(e <= tolerance for e in errs), "cells": len(errs),
            "within_tolerance": max(errs, default=0.0) <= tolerance}


def repeatability(dir_a: str, dir_b: str, tolerance: float = 0.20, min_samples: int = 5,
                  rounds: tuple[int, int] = (1, 1)) -> dict:
    """Two real runs of the same settings side by side (b in the 'sim' columns), or two rounds
    of one run: the noise floor any prediction of one real run is up against on this machine."""
    a, b = real_requests(dir_a, rounds[0]), real_requests(dir_b, rounds[1])
    rows = [compare_row(m, p, by_pool(a[m])[p], by_pool(b[m])[p])
            for m in a if m in b for p in POOLS]
    return {"run_dir": dir_a, "repeat_dir": dir_b, "rounds": list(rounds), "rows": rows,
            **verdict(rows, min_samples, tolerance),
            "options": {"tolerance": tolerance, "min_samples": min_samples}}


def _cells(results: list[dict], side: str) -> dict[tuple, list[float]]:
    """(mode, pool, q) -> that cell's value in each round where it has enough samples."""
    out: dict[tuple, list[float]] = {}
    for r in results:
        for row in r["rows"]:
            for q in ("p50", "p90"):
                v = row.get(f"{side}_{q}" if side == "gain" else f"{side}_{q}_ms")
                if v is not None and row["n_real"] >= r["options"]["min_samples"]:
                    out.setdefault((row["mode"], row["pool"], q), []).append(v)
    return out


def _median_rows(a: dict[tuple, list[float]], b: dict[tuple, list[float]],
                 n: dict[tuple, int]) -> list[dict]:
    rows = []
    for mode, pool in dict.fromkeys((m, p) for m, p, _ in a):
        side = lambda d: {"n": n.get((mode, pool), 0),
                          **{q: (float(np.median(d[(mode, pool, q)]))
                                 if d.get((mode, pool, q)) else None) for q in ("p50", "p90")}}
        rows.append(compare_row(mode, pool, side(a), side(b)))
    return rows


def over_rounds(results: list[dict], tolerance: float = 0.20) -> dict:
    """What a compare_modes run with --repeats reports is a median over its rounds: each cell's
    median over the rounds, real against simulated (each round simulated at that round's
    calibration). Beside it the noise floor of such a median on this machine: the real median
    of the odd rounds against that of the even rounds."""
    n = {(row["mode"], row["pool"]): row["n_real"] for row in results[0]["rows"]}
    rows = _median_rows(_cells(results, "real"), _cells(results, "sim"), n)
    gains = _cells(results, "gain")
    for row in rows:
        for q in ("p50", "p90"):
            g = gains.get((row["mode"], row["pool"], q))
            if g:
                row[f"gain_{q}"] = float(np.median(g))
    odd, even = results[0::2], results[1::2]
    floor = _median_rows(_cells(odd, "real"), _cells(even, "real"), n) if even else []
    opts = {"tolerance": tolerance, "min_samples": results[0]["options"]["min_samples"]}
    return {"rounds": len(results), "rows": rows, **verdict(rows, 0, tolerance),
            "options": opts, "halves": {"rows": floor, **verdict(floor, 0, tolerance),
                                        "options": opts}}


def markdown(result: dict, names: tuple[str, str] = ("real", "sim")) -> str:
    f = lambda x: "-" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    e = lambda x: "-" if x is None else f"{100 * x:+.0f}%"
    a, b = names
    gains = any("gain_p50" in r for r in result["rows"])
    g = lambda x: "-" if x is None else f"{x:.1f}"
    lines = [f"| mode | pool | n | {a} p50 ms | {b} p50 ms | err | {a} p90 ms | {b} p90 ms | err |"
             + (" gain p50 | gain p90 |" if gains else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if gains else "")]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['pool']} | {r['n_real']} | {f(r['real_p50_ms'])} | "
                     f"{f(r['sim_p50_ms'])} | {e(r['err_p50'])} | {f(r['real_p90_ms'])} | "
                     f"{f(r['sim_p90_ms'])} | {e(r['err_p90'])} |"
                     + (f" {g(r.get('gain_p50'))} | {g(r.get('gain_p90'))} |" if gains else ""))
    if gains:
        lines.append("\ngain: the simulated cell's relative change per relative change of every "
                     "step time; a cell of gain G passes only if the step times are known within "
                     "tolerance / G.")
    lines.append(f"\n{result['cells_within_tolerance']}/{result['cells']} cells within "
                 f"{100 * result['options']['tolerance']:.0f}%; median |error| "
                 f"{100 * result['median_abs_error']:.0f}%, worst "
                 f"{100 * result['worst_abs_error']:.0f}%: "
                 f"{'PASS' if result['within_tolerance'] else 'FAIL'}")
    return "\n".join(lines) + "\n"
