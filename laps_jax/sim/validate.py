"""Validation: does the simulator predict a real `compare_modes` run on this machine?

Takes a compare_modes output directory, rebuilds the exact workload it replayed (same reader,
options and time scale, via `scheduler.compare`), and replays it through the *same* replay code
(`scheduler.replay`) against simulated instances whose steps last what the run's own latency
model (its CPU profile) predicts. laps-spatial's two lanes share this machine's cores in the real
run, so in the simulation they share one device (processor sharing). Then it puts real and
simulated TTFT p50/p90, overall and per pool, side by side with the relative error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.executables import BucketGrid
from laps_jax.scheduler import compare, report
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.scheduler.latency_model import LatencyModel
from laps_jax.scheduler.policy import SchedulerConfig
from laps_jax.scheduler.replay import replay_open, replay_sessions
from laps_jax.scheduler.variants import SETTINGS, apply_to_run
from laps_jax.scheduler.window import WindowConfig
from laps_jax.sim.executor import Calibration, FastGrid
from laps_jax.sim.hardware import from_profile
from laps_jax.sim.instance import InstanceSpec, build_dispatcher
from laps_jax.workload.sessions import SessionTrace

POOLS = ("all", "short", "long")


@dataclasses.dataclass
class ValidationOptions:
    run_dir: str
    profile: str | None = None        # None: the latency model recorded in the run
    spatial_overlap: float = 0.0      # laps-spatial lanes on the shared CPU
    host_overhead_s: float = 0.0      # per-step cost outside the executables
    calibrate: bool = False           # scale step times to the run's own measured step time
    fit_overlap: bool = False         # laps-spatial: laps' speed factor + fitted lane overlap
    tolerance: float = 0.20
    min_samples: int = 5              # pools with fewer requests are shown, not judged
    round: int = 1                    # which round of a --repeats run to predict
    calibrate_by: str = "kind"        # "bucket": a factor per compiled shape (else per kind);
                                      # "kind": per step kind; "step": one per mode
    calibration: Calibration | None = None  # set by the calibration (speed, jitter per kind)
    jitter: bool = True               # calibrate_by kind/bucket: the real run's step jitter too
    submit_late_s: float = 0.0        # the replay submits this late (calibration: measured)


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


def _options(run: dict) -> compare.CompareOptions:
    ecfg = EngineConfig(**run["engine"])
    th = run.get("threshold", "auto")
    return compare.CompareOptions(
        model=run["model"], trace=run["trace"], trace_format=run["trace_format"],
        output_dir="", ecfg=ecfg, max_requests=run["requests"],
        length_scale=run["length_scale"], slo_scale=run["slo_scale"],
        threshold=None if th in (None, "auto") else int(th),
        window=WindowConfig(**run["window"]), time_scale=run["time_scale"],
        max_output=run.get("max_output"), seed=run.get("seed", 0))


def step_seconds(lanes: list[dict]) -> float:
    return sum(l["counters"]["prefill_seconds"] + l["counters"]["decode_seconds"] for l in lanes)


def num_steps(lanes: list[dict]) -> int:
    return sum(l["counters"]["prefill_steps"] + l["counters"]["decode_steps"] for l in lanes)


KINDS = ("prefill", "decode")


def kind_seconds_per_step(lanes: list[dict], kind: str) -> float | None:
    steps = sum(l["counters"][f"{kind}_steps"] for l in lanes)
    return sum(l["counters"][f"{kind}_seconds"] for l in lanes) / steps if steps else None


def submit_lateness(rows: list[dict]) -> float | None:
    """Mean seconds from a request's stamped arrival to its submit in a real run (None for runs
    recorded before requests carried `submitted`)."""
    late = [r["submitted"] - r["arrival"] for r in rows if r.get("submitted") is not None]
    return float(np.mean(late)) if late else None


def _bucket_sums(lanes: list[dict]) -> dict[str, list[float]]:
    """Per compiled shape ("decode 8x1"), over the lanes: [steps, seconds, seconds^2] (empty for
    runs recorded before lanes kept them)."""
    acc: dict[str, list[float]] = {}
    for l in lanes:
        for key, sums in l["counters"].get("bucket_seconds", {}).items():
            a = acc.setdefault(key, [0, 0.0, 0.0])
            for i in range(3):
                a[i] += sums[i]
    return acc


def bucket_seconds_per_step(lanes: list[dict], min_steps: int = 5) -> dict[str, float]:
    """Mean seconds per step of each compiled shape run at least min_steps times."""
    return {k: s1 / n for k, (n, s1, _) in _bucket_sums(lanes).items() if n >= min_steps}


def calibrate_kinds(mode: str, run: dict, model: LatencyModel, vo: ValidationOptions,
                    real_lanes: list[dict]):
    """Speed factors so that the simulated mean seconds per prefill step and per decode step
    equal the real run's (host time per step is added on both sides) -- with calibrate_by
    "bucket", per compiled shape the real run ran often enough too."""
    scale = {k: 1.0 for k in KINDS}
    stats, lanes = simulate_mode(mode, run, model, vo)
    for _ in range(3):
        real_b, sim_b = bucket_seconds_per_step(real_lanes), bucket_seconds_per_step(lanes, 1)
        pairs = [(k, kind_seconds_per_step(real_lanes, k), kind_seconds_per_step(lanes, k))
                 for k in KINDS]
        if vo.calibrate_by == "bucket":
            pairs += [(k, t, sim_b.get(k)) for k, t in real_b.items()]
            scale.update({k: scale[k.split()[0]] for k in real_b if k not in scale})
        for k, real, sim in pairs:
            if real and sim and sim > vo.host_overhead_s:
                scale[k] *= real / (sim - vo.host_overhead_s)
        cal = Calibration(dict(scale))
        stats, lanes = simulate_mode(mode, run, model, dataclasses.replace(vo, calibration=cal))
    if vo.jitter:
        cal.jitter = {k: step_jitter(real_lanes, lanes, k) for k in KINDS}
        stats, lanes = simulate_mode(mode, run, model, dataclasses.replace(vo, calibration=cal))
    return cal, stats, lanes


def _bucket_cv2(lanes: list[dict], kind: str) -> dict[str, tuple[int, float]]:
    """Per compiled shape of one kind: (steps, squared coefficient of variation of its time)."""
    out = {}
    for key, (n, s1, s2) in _bucket_sums(lanes).items():
        if key.startswith(kind + " "):
            mean = s1 / n
            out[key] = (int(n), max(0.0, s2 / n - mean * mean) / (mean * mean) if mean > 0
                        else 0.0)
    return out


def step_jitter(real_lanes: list[dict], sim_lanes: list[dict], kind: str,
                min_steps: int = 5) -> float:
    """The real run's step-to-step spread that the simulation does not already have: per
    shape, the real squared coefficient of variation of step time less the simulated one (which
    comes from contexts differing within a shape), averaged over steps; 0 for runs recorded
    before lanes kept per-shape times."""
    real, sim = _bucket_cv2(real_lanes, kind), _bucket_cv2(sim_lanes, kind)
    pairs = [(n, max(0.0, cv2 - sim.get(key, (0, 0.0))[1]))
             for key, (n, cv2) in real.items() if n >= min_steps]
    steps = sum(n for n, _ in pairs)
    return math.sqrt(sum(n * x for n, x in pairs) / steps) if steps else 0.0


def host_seconds_per_step(lanes: list[dict]) -> float | None:
    """The real lanes' loop time around steps (admission, planning, thread hops) per step;
    None for runs recorded before lanes counted it."""
    if not all("host_seconds" in l["counters"] for l in lanes):
        return None
    steps = num_steps(lanes)
    return sum(l["counters"]["host_seconds"] for l in lanes) / steps if steps else 0.0


def simulate_mode(mode: str, run: dict, model: LatencyModel,
                  vo: ValidationOptions) -> tuple[list, list[dict]]:
    """One mode of the recorded run, replayed on simulated instances: its RequestStats and
    the lanes' metrics. A variant of the run (`run["variants"]`) replays its base mode with
    its settings."""
    variant = run.get("variants", {}).get(mode)
    if variant:
        mode, run = variant["mode"], apply_to_run(run, variant["settings"])
    o = _options(run)
    cfg = PRESETS[run["model"]]
    ecfg = o.ecfg
    max_len = min(ecfg.max_model_len, cfg.max_position_embeddings)
    grid = FastGrid.of(BucketGrid.default(ecfg.max_chunk, ecfg.max_prefill_batch,
                                          ecfg.max_decode_batch, ecfg.min_chunk,
                                          ecfg.max_batch_tokens))
    ref = ecfg if run.get("buckets", True) else dataclasses.replace(ecfg, min_chunk=16,
                                                                    max_prefill_batch=8)
    ref_grid = BucketGrid.default(ref.max_chunk, ref.max_prefill_batch, ref.max_decode_batch,
                                  ref.min_chunk, ref.max_batch_tokens)
    slo_model = LatencyModel.from_dict(run["latency_model"], cfg)
    slo_fn = lambda new, cached: o.slo_scale * slo_model.predict_prefill(max(new, 1), cached,
                                                                         ref_grid)
    work = compare._workload(o, cfg.vocab_size, max_len)
    spec = InstanceSpec(mode=mode, kv_cache_tokens=ecfg.kv_cache_tokens,
                        page_size=ecfg.page_size, max_model_len=max_len,
                        scheduler=SchedulerConfig(threshold=o.threshold, window=o.window,
                                                  cross_pool=run.get("cross_pool", "short-first"),
                                                  order=run.get("order", "ratio"),
                                                  decode_gap_s=run.get("decode_gap_s", 0.0),
                                                  long_budget_tokens=run.get("long_budget_tokens"),
                                                  aging_tokens_per_s=run.get("aging_tokens_per_s"),
                                                  max_postpone_s=run.get("max_postpone_s"),
                                                  max_wait_s=run.get("max_wait_s")),
                        spatial_devices=1, spatial_overlap=vo.spatial_overlap,
                        host_overhead_s=vo.host_overhead_s, calibration=vo.calibration,
                        prefix_cache=ecfg.enable_prefix_cache)

    async def main():
        clock = SimClock()
        d = build_dispatcher(spec, cfg, model, clock, mode, grid, plan_model=slo_model)
        await d.start()
        if isinstance(work, SessionTrace):
            stats = await replay_sessions(d, work, o.time_scale, slo_fn, clock, max_len,
                                          vo.submit_late_s)
        else:
            stats = await replay_open(d, work, o.time_scale, slo_fn, clock, vo.submit_late_s)
        await d.stop(drain=True)
        return stats, [dataclasses.asdict(l) for l in d.metrics().lanes]
    return run_simulated(main())


def real_requests(run_dir: str, rnd: int = 1) -> dict[str, list[dict]]:
    """One round's requests per mode (runs recorded before rounds were kept: round 1 only)."""
    real: dict[str, list[dict]] = {}
    with open(os.path.join(run_dir, "requests.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("round", 1) == rnd:
                real.setdefault(r["mode"], []).append(r)
    return real


def run_rounds(comp: dict) -> int:
    """Rounds whose requests and lane metrics a compare_modes run kept."""
    return len(comp.get("metrics_rounds", [])) or 1


def _row(mode: str, pool: str, a: dict, b: dict) -> dict:
    row = {"mode": mode, "pool": pool, "n_real": a["n"], "n_sim": b["n"]}
    for q in ("p50", "p90"):
        x, y = a[q], b[q]
        row.update({f"real_{q}_ms": x, f"sim_{q}_ms": y,
                    f"err_{q}": (y - x) / x if x and y is not None else None})
    return row


def _errors(rows: list[dict], min_samples: int) -> list[float]:
    return [abs(r[f"err_{q}"]) for r in rows for q in ("p50", "p90")
            if r[f"err_{q}"] is not None and r["n_real"] >= min_samples]


def _summary(rows: list[dict], min_samples: int, tolerance: float) -> dict:
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
    rows = [_row(m, p, by_pool(a[m])[p], by_pool(b[m])[p]) for m in a if m in b for p in POOLS]
    return {"run_dir": dir_a, "repeat_dir": dir_b, "rounds": list(rounds), "rows": rows,
            **_summary(rows, min_samples, tolerance),
            "options": {"tolerance": tolerance, "min_samples": min_samples}}


def _cells(results: list[dict], side: str) -> dict[tuple, list[float]]:
    """(mode, pool, q) -> that cell's value in each round where it has enough samples."""
    out: dict[tuple, list[float]] = {}
    for r in results:
        for row in r["rows"]:
            for q in ("p50", "p90"):
                v = row[f"{side}_{q}_ms"]
                if v is not None and row["n_real"] >= r["options"]["min_samples"]:
                    out.setdefault((row["mode"], row["pool"], q), []).append(v)
    return out


def _median_rows(a: dict[tuple, list[float]], b: dict[tuple, list[float]],
                 n: dict[tuple, int]) -> list[dict]:
    rows = []
    for mode, pool in dict.fromkeys((m, p) for m, p, _ in a):
        cell = lambda d, q: (float(np.median(d[(mode, pool, q)]))
                             if d.get((mode, pool, q)) else None)
        rows.append(_row(mode, pool, {"n": n.get((mode, pool), 0), "p50": cell(a, "p50"),
                                      "p90": cell(a, "p90")},
                         {"n": n.get((mode, pool), 0), "p50": cell(b, "p50"),
                          "p90": cell(b, "p90")}))
    return rows


def over_rounds(results: list[dict], tolerance: float = 0.20) -> dict:
    """What a compare_modes run with --repeats reports is a median over its rounds: each cell's
    median over the rounds, real against simulated (each round simulated at that round's
    calibration). Beside it the noise floor of such a median on this machine: the real median
    of the odd rounds against that of the even rounds."""
    n = {(row["mode"], row["pool"]): row["n_real"] for row in results[0]["rows"]}
    rows = _median_rows(_cells(results, "real"), _cells(results, "sim"), n)
    odd, even = results[0::2], results[1::2]
    floor = _median_rows(_cells(odd, "real"), _cells(even, "real"), n) if even else []
    opts = {"tolerance": tolerance, "min_samples": results[0]["options"]["min_samples"]}
    return {"rounds": len(results), "rows": rows, **_summary(rows, 0, tolerance),
            "options": opts, "halves": {"rows": floor, **_summary(floor, 0, tolerance),
                                        "options": opts}}


def fit_overlap(run: dict, model: LatencyModel, vo: ValidationOptions, measured: float) -> float:
    """The shared-device overlap at which simulated laps-spatial spends the measured step
    seconds (concurrent steps take longer the less they overlap): bisection on (-0.9, 1)."""
    lo, hi = -0.9, 1.0
    for _ in range(8):
        mid = (lo + hi) / 2
        _, lanes = simulate_mode("laps-spatial", run, model,
                                 dataclasses.replace(vo, spatial_overlap=mid))
        lo, hi = (mid, hi) if step_seconds(lanes) > measured else (lo, mid)
    return (lo + hi) / 2


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


def step_model(vo: ValidationOptions, run: dict) -> LatencyModel:
    """What simulated steps cost: `--profile` if given, else the model the run recorded (the
    scheduler always plans with the recorded one, as the real run did)."""
    if vo.profile:
        return from_profile(vo.profile, run["model"]).model
    return LatencyModel.from_dict(run["latency_model"], PRESETS[run["model"]])


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
        if vo.calibrate and vo.calibrate_by in ("kind", "bucket") and not spatial(mode):
            cal, stats, lanes = calibrate_kinds(mode, run, model, vo,
                                                comp["metrics"][mode]["lanes"])
            cals[mode], factors[mode] = cal, dataclasses.asdict(cal)
        elif vo.calibrate and vo.fit_overlap and spatial(mode) and "laps" in factors:
            # the machine's speed as laps saw it; the sharing is fitted
            m, v = ((model, dataclasses.replace(vo, calibration=cals["laps"])) if "laps" in cals
                    else (model.scaled(factors["laps"]), vo))
            overlap = fit_overlap(run, m, v, measured)
            stats, lanes = simulate_mode(mode, run, m, dataclasses.replace(v, spatial_overlap=overlap))
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
        else:
            stats, lanes = simulate_mode(mode, run, model, vo)
        a, b = by_pool(rs), by_pool([s.to_dict() for s in stats])
        rows += [_row(mode, pool, a[pool], b[pool]) for pool in POOLS]
    return {"run_dir": vo.run_dir, "round": vo.round, "options": dataclasses.asdict(vo),
            "rows": rows,
            **_summary(rows, vo.min_samples, vo.tolerance),
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
    laps, _ = simulate_mode("laps", apply_to_run(run, laps_settings or {}), model, vo_cal)
    a, b = report.summarize(mixed), report.summarize(laps)
    return {"round": vo.round, "mixed": a, "laps": b, "ratio": report.ratio(b, a),
            "calibration": dataclasses.asdict(cal), "laps_settings": laps_settings or {},
            "trace": run["trace"]}


def markdown(result: dict, names: tuple[str, str] = ("real", "sim")) -> str:
    f = lambda x: "-" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    e = lambda x: "-" if x is None else f"{100 * x:+.0f}%"
    a, b = names
    lines = [f"| mode | pool | n | {a} p50 ms | {b} p50 ms | err | {a} p90 ms | {b} p90 ms | err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['pool']} | {r['n_real']} | {f(r['real_p50_ms'])} | "
                     f"{f(r['sim_p50_ms'])} | {e(r['err_p50'])} | {f(r['real_p90_ms'])} | "
                     f"{f(r['sim_p90_ms'])} | {e(r['err_p90'])} |")
    lines.append(f"\n{result['cells_within_tolerance']}/{result['cells']} cells within "
                 f"{100 * result['options']['tolerance']:.0f}%; median |error| "
                 f"{100 * result['median_abs_error']:.0f}%, worst "
                 f"{100 * result['worst_abs_error']:.0f}%: "
                 f"{'PASS' if result['within_tolerance'] else 'FAIL'}")
    return "\n".join(lines) + "\n"
