"""A recorded compare_modes run replayed on the simulator's instances: the options of a
validation, one mode's replay, and the calibration of simulated steps to the run's measured ones.

The workload is rebuilt exactly as the run read it (same reader, options and time scale, via
`bench.compare`) and goes through the *same* replay code (`bench.replay`, sessions through
`workload.driver`), so only the device differs. laps-spatial's two lanes share this machine's
cores in the real run, so in the simulation they share one device (processor sharing).
"""

from __future__ import annotations

import dataclasses
import os

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.buckets import BucketGrid
from laps_jax.bench import compare
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.scheduler.latency_model import LatencyModel, StepShape
from laps_jax.scheduler.policy import SchedulerConfig
from laps_jax.bench.replay import replay_open, replay_sessions
from laps_jax.bench.variants import apply
from laps_jax.scheduler.window import WindowConfig
from laps_jax.sim.executor import Calibration, FastGrid
from laps_jax.sim.hardware import from_profile
from laps_jax.sim.instance import InstanceSpec, build_dispatcher
from laps_jax.bench.lane_timings import (KINDS, bucket_seconds_per_step,
                                         kind_seconds_per_step, step_jitter, step_seconds)
from laps_jax.workload.sessions import SessionTrace


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
    calibrate_by: str = "bucket"      # "bucket": a factor per compiled shape the run ran 5+
                                      # times, else per kind (the default since 2026-12-01:
                                      # under load the shape mix moves); "kind": per step
                                      # kind; "step": one per mode
    calibration: Calibration | None = None  # set by the calibration (speed, jitter per kind)
    jitter: bool = True               # calibrate_by kind/bucket: the real run's step jitter too
    submit_late_s: float = 0.0        # the replay submits this late (calibration: measured)
    sensitivity: float = 0.0          # > 0: also simulate every step this much slower and
                                      # faster; each cell gets its gain (validate.cell_gains)


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trace_path(path: str) -> str:
    """A run's trace as recorded (relative to where compare_modes ran), else the same path from
    the repository's root, else the file of that name in docs/data (where committed runs keep
    their generated traces): committed runs replay from a clean clone, from any directory."""
    for p in (path, os.path.join(_REPO, path),
              os.path.join(_REPO, "docs", "data", os.path.basename(path))):
        if os.path.exists(p):
            return p
    return path  # the reader names it in its error


def _options(run: dict) -> compare.CompareOptions:
    ecfg = EngineConfig(**run["engine"])
    th = run.get("threshold", "auto")
    return compare.CompareOptions(
        model=run["model"], trace=trace_path(run["trace"]), trace_format=run["trace_format"],
        output_dir="", ecfg=ecfg, max_requests=run["requests"],
        length_scale=run["length_scale"], slo_scale=run["slo_scale"],
        threshold=None if th in (None, "auto") else int(th),
        window=WindowConfig(**run["window"]), time_scale=run["time_scale"],
        max_output=run.get("max_output"), seed=run.get("seed", 0))


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


def simulate_mode(mode: str, run: dict, model: LatencyModel, vo: ValidationOptions,
                  settings: dict | None = None) -> tuple[list, list[dict]]:
    """One mode of the recorded run, replayed on simulated instances: its RequestStats and
    the lanes' metrics. A variant of the run (`run["variants"]`) replays its base mode with
    its settings; `settings` (variants.SETTINGS keys) change the scheduler's further."""
    variant = run.get("variants", {}).get(mode)
    if variant:
        mode, settings = variant["mode"], {**variant["settings"], **(settings or {})}
    o = _options(run)
    cfg = PRESETS[run["model"]]
    ecfg = o.ecfg
    max_len = min(ecfg.max_model_len, cfg.max_context)
    grid = FastGrid.of(BucketGrid.of_settings(ecfg))
    ref = ecfg if run.get("buckets", True) else dataclasses.replace(ecfg, min_chunk=16,
                                                                    max_prefill_batch=8)
    ref_grid = BucketGrid.of_settings(ref)
    slo_model = LatencyModel.from_dict(run["latency_model"], cfg)
    slo_fn = lambda new, cached: o.slo_scale * slo_model.predict_prefill(max(new, 1), cached,
                                                                         ref_grid)
    work = compare._workload(o, cfg.vocab_size, max_len)
    gap, long_budget = run.get("decode_gap_s", 0.0), run.get("long_budget_tokens")
    if "long_chunk_ratio" not in run and gap is None and long_budget:
        # a run from before long_chunk_ratio: its decode gap was the predicted long chunk
        gap = slo_model.predict(StepShape.exact((min(long_budget, ecfg.max_chunk),)))
    scheduler = SchedulerConfig(threshold=o.threshold, window=o.window,
                                cross_pool=run.get("cross_pool", "short-first"),
                                order=run.get("order", "ratio"),
                                decode_gap_s=gap, long_budget_tokens=long_budget,
                                long_chunk_ratio=run.get("long_chunk_ratio"),
                                aging_tokens_per_s=run.get("aging_tokens_per_s"),
                                max_postpone_s=run.get("max_postpone_s"),
                                max_wait_s=run.get("max_wait_s"),
                                # runs recorded before fill_rows ran without it
                                fill_rows=run.get("fill_rows", False),
                                fill_slack=run.get("fill_slack", 0.0),
                                # runs recorded before finish_slack filled long steps
                                finish_slack=run.get("finish_slack"),
                                # runs recorded before the overload mode ran without it,
                                # and before its padding check without the check
                                overload_requests=run.get("overload_requests"),
                                overload_check=run.get("overload_check", False))
    spec = InstanceSpec(mode=mode, kv_cache_tokens=ecfg.kv_cache_tokens,
                        page_size=ecfg.page_size, max_model_len=max_len,
                        scheduler=apply(scheduler, settings or {}),
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


def step_model(vo: ValidationOptions, run: dict) -> LatencyModel:
    """What simulated steps cost: `--profile` if given, else the model the run recorded (the
    scheduler always plans with the recorded one, as the real run did)."""
    if vo.profile:
        return from_profile(vo.profile, run["model"]).model
    return LatencyModel.from_dict(run["latency_model"], PRESETS[run["model"]])
