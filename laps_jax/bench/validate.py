"""Validation: does the simulator predict a real `compare_modes` run on this machine?

Part of the harness (bench imports sim, never the reverse): each mode of a compare_modes output
directory is replayed on simulated instances (`sim_replay`) whose steps last what the run's own
latency model (its CPU profile) predicts, calibrated to the run's measured step times if asked.
Then real and simulated TTFT p50/p90, overall and per pool, go side by side with the relative
error (`cells`).
"""

from __future__ import annotations

import dataclasses
import json
import os

from laps_jax.bench import report
from laps_jax.bench.cells import POOLS, by_pool, compare_row, real_requests, run_rounds, verdict
from laps_jax.bench.lane_timings import (host_seconds_per_step, num_steps, step_seconds,
                                         submit_lateness)
from laps_jax.bench.sim_replay import (ValidationOptions, calibrate_kinds, fit_overlap,
                                       simulate_mode, step_model)
from laps_jax.bench.variants import SETTINGS
from laps_jax.sim.executor import Calibration
from laps_jax.sim.summary import summarize_requests


def _load_round(vo: ValidationOptions) -> tuple[dict, dict[str, list[dict]]]:
    """The run's comparison.json with `metrics` and the per-mode summaries set to round
    `vo.round`'s, and that round's requests per mode."""
    with open(os.path.join(vo.run_dir, "comparison.json")) as f:
        comp = json.load(f)
    real = real_requests(vo.run_dir, vo.round)
    if not real:
        raise ValueError(f"{vo.run_dir} holds no requests of round {vo.round} "
                         f"({run_rounds(comp)} kept)")
    if "metrics_rounds" in comp:
        comp = dict(comp, metrics=comp["metrics_rounds"][vo.round - 1])
    if "rounds" in comp:  # the top-level summaries are round 1's
        comp = dict(comp, **comp["rounds"][vo.round - 1])
    return comp, real


def cell_gains(rows: list[dict], d: float, slow_fast: list[dict]) -> None:
    """Adds `gain_p50`/`gain_p90` to each row: the relative change of the simulated cell per
    relative change of every step time, from simulations with steps 1 - d and 1 + d times as
    long (`slow_fast`: their `by_pool` results). Near saturation a cell's gain grows like
    1 / (1 - utilization): a prediction within a tolerance then needs step times within
    tolerance / gain, whatever the scheduler -- the condition of the test, beside its
    result."""
    lo, hi = slow_fast
    for row in rows:
        for q in ("p50", "p90"):
            y, a, b = row[f"sim_{q}_ms"], lo[row["pool"]][q], hi[row["pool"]][q]
            row[f"gain_{q}"] = (b - a) / (2 * d * y) if y and a is not None and b is not None \
                else None


def validate(vo: ValidationOptions) -> dict:
    comp, real = _load_round(vo)
    run = comp["run"]
    model = step_model(vo, run)
    rows, factors, overlap, host, lateness = [], {}, None, {}, {}
    cals: dict[str, Calibration] = {}
    base = vo  # `vo` below: these options plus this mode's measured host overhead
    base_of = lambda m: run.get("variants", {}).get(m, {}).get("mode", m)
    spatial = lambda m: base_of(m) == "laps-spatial"
    for mode in sorted(real, key=spatial):  # spatial last: it needs laps'
        rs = real[mode]
        measured = step_seconds(comp["metrics"][mode]["lanes"])
        h = host_seconds_per_step(comp["metrics"][mode]["lanes"])
        vo = base
        if vo.calibrate and h is not None:  # the measured loop overhead joins each sim step
            vo = dataclasses.replace(base, host_overhead_s=h)
            measured += h * num_steps(comp["metrics"][mode]["lanes"])
            host[mode] = h
        late = submit_lateness(rs) if vo.calibrate else None
        if late is not None:  # the real replay's timers fired this late on average
            vo = dataclasses.replace(vo, submit_late_s=late)
            lateness[mode] = late
        used = (model, vo)  # the model and options this mode's prediction was simulated with
        if vo.calibrate and vo.calibrate_by in ("kind", "bucket") and not spatial(mode):
            cal, stats, lanes = calibrate_kinds(mode, run, model, vo,
                                                comp["metrics"][mode]["lanes"])
            cals[mode], factors[mode] = cal, dataclasses.asdict(cal)
            used = (model, dataclasses.replace(vo, calibration=cal))
        elif vo.calibrate and vo.fit_overlap and spatial(mode) and "laps" in factors:
            # the machine's speed as laps saw it; the sharing is fitted
            m, v = ((model, dataclasses.replace(vo, calibration=cals["laps"])) if "laps" in cals
                    else (model.scaled(factors["laps"]), vo))
            overlap = fit_overlap(run, m, v, measured)
            used = (m, dataclasses.replace(v, spatial_overlap=overlap))
            stats, lanes = simulate_mode(mode, run, *used)
            factors[mode] = factors["laps"]
        elif vo.calibrate:  # the machine's speed during this mode, from its own step timings:
            # mean seconds per step, real over simulated (totals would let a simulation that
            # runs more, cheaper steps than the real one look calibrated)
            stats, lanes = simulate_mode(mode, run, model, vo)
            real_mean = measured / max(1, num_steps(comp["metrics"][mode]["lanes"]))
            f = 1.0
            for _ in range(3):
                f *= real_mean / (step_seconds(lanes) / max(1, num_steps(lanes)))
                stats, lanes = simulate_mode(mode, run, model.scaled(f), vo)
            factors[mode] = f
            used = (model.scaled(f), vo)
        else:
            stats, lanes = simulate_mode(mode, run, model, vo)
        a, b = by_pool(rs), by_pool([s.to_dict() for s in stats])
        mode_rows = [compare_row(mode, pool, a[pool], b[pool]) for pool in POOLS]
        if base.sensitivity > 0:
            cell_gains(mode_rows, base.sensitivity, [
                by_pool([s.to_dict() for s in simulate_mode(mode, run, used[0].scaled(f),
                                                            used[1])[0]])
                for f in (1.0 - base.sensitivity, 1.0 + base.sensitivity)])
        rows += mode_rows
    return {"run_dir": vo.run_dir, "round": vo.round, "options": dataclasses.asdict(vo),
            "rows": rows,
            **verdict(rows, vo.min_samples, vo.tolerance),
            "speed_factors": factors, "spatial_overlap_fitted": overlap,
            "host_overhead_s": host, "submit_lateness_s": lateness,
            "others_cpu_share": {m: comp[m].get("others_cpu_share") for m in real},
            "run": {k: run.get(k) for k in ("model", "trace", "trace_format", "requests",
                                            "length_scale", "time_scale", "threshold",
                                            "max_output", "slo_scale")}}


def same_speed(vo: ValidationOptions, laps_settings: dict | None = None,
               trace: str | None = None) -> dict:
    """laps / mixed of one round as if the machine had run both modes at mixed's speed: mixed's
    calibration (per-kind factors, jitter, host time, lateness) replays both modes. A real
    run's ratio mixes the policy with the machine's drift between the modes' turns; where the
    calibrated simulation predicts each mode of a round, this separates the two.
    `laps_settings` (keys of variants.SETTINGS) change laps' scheduler settings from the
    run's; `trace` replays another trace of the same format on this round's calibration."""
    bad = set(laps_settings or {}) - set(SETTINGS)
    if bad:
        raise ValueError(f"unknown laps settings {sorted(bad)}; known: {sorted(SETTINGS)}")
    comp, real = _load_round(vo)
    run = comp["run"]
    if "mixed" not in real or "laps" not in real:
        raise ValueError(f"{vo.run_dir}: same-speed ratios need mixed and laps in the run")
    model = step_model(vo, run)
    lanes = comp["metrics"]["mixed"]["lanes"]
    vo = dataclasses.replace(vo, host_overhead_s=host_seconds_per_step(lanes) or 0.0,
                             submit_late_s=submit_lateness(real["mixed"]) or 0.0)
    cal, mixed, _ = calibrate_kinds("mixed", run, model, vo, lanes)
    vo_cal = dataclasses.replace(vo, calibration=cal)
    if trace:
        run = dict(run, trace=trace)
        mixed, _ = simulate_mode("mixed", run, model, vo_cal)
    laps, _ = simulate_mode("laps", run, model, vo_cal, laps_settings)
    a, b = summarize_requests(mixed), summarize_requests(laps)
    return {"round": vo.round, "mixed": a, "laps": b, "ratio": report.ratio(b, a),
            "calibration": dataclasses.asdict(cal), "laps_settings": laps_settings or {},
            "trace": run["trace"]}

