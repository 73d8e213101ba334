"""One trace, every mode, one process: the measurement behind `scripts/compare_modes.py`.

Steps: build the engine(s) and warm every bucket; take the latency model from a profile (or
profile now); measure mixed's capacity by replaying the first requests all at once; scale
arrivals so mixed runs at `load` of that capacity; replay the trace in each mode on the same
engines (prefix cache cleared, counters reset between modes); write comparison.json, a markdown
table and TTFT plots. A request's TTFT SLO is `slo_scale` x the latency model's isolated prefill
latency of its new tokens in the default bucket grid (the same SLO in every mode and ablation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from typing import Callable

from laps_jax.config import EngineConfig
from laps_jax.engine.engine import Engine
from laps_jax.engine.executables import BucketGrid, enable_persistent_cache
from laps_jax.engine.runner import RunnerStats
from laps_jax.scheduler import report
from laps_jax.scheduler.clock import RealClock
from laps_jax.scheduler.dispatcher import Dispatcher
from laps_jax.scheduler.latency_model import LatencyModel
from laps_jax.scheduler.policy import SchedulerConfig
from laps_jax.scheduler.profiling import kv_block_of, plan_shapes, profile
from laps_jax.scheduler.replay import (OpenRequest, natural_rate, open_requests, replay_open,
                                       replay_sessions, session_arrivals)
from laps_jax.scheduler.window import WindowConfig
from laps_jax.workload.records import TraceOptions
from laps_jax.workload.sessions import SessionTrace, read_sessions_jsonl
from laps_jax.workload.traces import read_azure_csv, read_mooncake_jsonl


@dataclasses.dataclass
class CompareOptions:
    model: str
    trace: str
    trace_format: str
    output_dir: str
    ecfg: EngineConfig
    modes: tuple[str, ...] = ("mixed", "laps", "laps-spatial")
    max_requests: int | None = None
    load: float = 0.8
    length_scale: float = 1.0
    slo_scale: float = 5.0
    threshold: int | None = None       # None: the latency model's crossover
    window: WindowConfig = dataclasses.field(default_factory=WindowConfig)
    buckets: bool = True               # False: one prefill executable (1 x max_chunk)
    time_scale: float | None = None    # None: from the measured capacity and `load`
    profile: str | None = None
    capacity_requests: int = 24
    max_output: int | None = None      # cap on output tokens per request (decode is costly here)
    dtype: str = "float32"
    seed: int = 0
    compile_cache: str | None = None


def _engines(o: CompareOptions, log) -> tuple[Engine, Engine | None, object]:
    from laps_jax.models.loader import load_model
    enable_persistent_cache(o.compile_cache)
    loaded = load_model(o.model, o.dtype, o.seed)
    ecfg = o.ecfg if o.buckets else dataclasses.replace(o.ecfg, min_chunk=o.ecfg.max_chunk,
                                                       max_prefill_batch=1)
    made = []
    for i in range(2 if "laps-spatial" in o.modes else 1):
        t0 = time.perf_counter()
        e = Engine(loaded.cfg, loaded.params, dataclasses.replace(ecfg))
        e.warmup()
        log(f"engine {i}: {len(e.runner.executables)} executables ready in "
            f"{time.perf_counter() - t0:.1f} s")
        made.append(e)
    return made[0], (made[1] if len(made) > 1 else None), loaded


def _latency_model(o: CompareOptions, engine: Engine, log) -> LatencyModel:
    if o.profile:
        return LatencyModel.load(o.profile, engine.cfg)
    log("no --profile: timing 24 shapes for the latency model")
    samples = profile(engine, plan_shapes(engine, 24, seed=o.seed), reps=2)
    engine.kv.clear_prefix_cache()
    return LatencyModel.fit(engine.cfg, engine.runner.k_cache.dtype.itemsize,
                            [s.shape for s in samples], [s.seconds for s in samples],
                            kv_block_of(engine), "quick-profile")


def _workload(o: CompareOptions, vocab: int, max_len: int):
    opts = TraceOptions(max_requests=o.max_requests, length_scale=o.length_scale,
                        vocab_size=vocab, max_len=max_len, seed=o.seed)
    cap = o.max_output or 1 << 30
    if o.trace_format == "sessions":
        st = read_sessions_jsonl(o.trace, opts)
        for s in st.sessions:
            s.turns = [dataclasses.replace(t, output_tokens=min(t.output_tokens, cap))
                       for t in s.turns]
        return st
    reader = read_azure_csv if o.trace_format == "azure" else read_mooncake_jsonl
    reqs = open_requests(reader(o.trace, opts))
    for r in reqs:
        r.max_tokens = min(r.max_tokens, cap)
    return reqs


def _subset(work, n: int):
    if isinstance(work, SessionTrace):
        picked, count = [], 0
        for s in work.sessions:
            if count >= n:
                break
            picked.append(s)
            count += len(s.turns)
        return dataclasses.replace(work, sessions=picked)
    return work[:n]


def _reset(engines) -> None:
    for e in engines:
        e.kv.clear_prefix_cache()
        e.runner.stats = RunnerStats()


async def _run(mode: str, engine, long_engine, model, cfg: SchedulerConfig, work,
               time_scale: float, slo_fn, max_len: int):
    clock = RealClock()
    d = Dispatcher(engine, mode, cfg, long_engine=long_engine if mode == "laps-spatial" else None,
                   clock=clock, latency_model=model)
    await d.start()
    if isinstance(work, SessionTrace):
        stats = await replay_sessions(d, work, time_scale, slo_fn, clock, max_len)
    else:
        stats = await replay_open(d, work, time_scale, slo_fn, clock)
    await d.stop(drain=True)
    return stats, d.metrics()


def run_comparison(o: CompareOptions, log: Callable[[str], None] = print) -> dict:
    os.makedirs(o.output_dir, exist_ok=True)
    engine, long_engine, loaded = _engines(o, log)
    engines = [e for e in (engine, long_engine) if e is not None]
    model = _latency_model(o, engine, log)
    max_len = engine.ecfg.max_model_len
    ref_grid = BucketGrid.default(o.ecfg.max_chunk, o.ecfg.max_prefill_batch,
                                  o.ecfg.max_decode_batch, o.ecfg.min_chunk,
                                  o.ecfg.max_batch_tokens)
    slo_fn = lambda new, cached: o.slo_scale * model.predict_prefill(max(new, 1), cached, ref_grid)
    work = _workload(o, loaded.cfg.vocab_size, max_len)
    n_req = work.num_requests if isinstance(work, SessionTrace) else len(work)
    cfg = SchedulerConfig(threshold=o.threshold, window=o.window)

    capacity = None
    time_scale = o.time_scale
    if time_scale is None:
        _reset(engines)
        sub = _subset(work, o.capacity_requests)
        t0 = time.perf_counter()
        stats, _ = asyncio.run(_run("mixed", engine, None, model, cfg, sub, 0.0, slo_fn, max_len))
        capacity = len(stats) / (time.perf_counter() - t0)
        arrivals = (session_arrivals(work) if isinstance(work, SessionTrace)
                    else [r.arrival_s for r in work])
        time_scale = natural_rate(arrivals) / (o.load * capacity)
        log(f"mixed capacity {capacity:.2f} requests/s ({len(stats)} at once); trace rate "
            f"{natural_rate(arrivals):.2f}/s -> time scale {time_scale:.3f}")

    results, per_mode, metrics = {}, {}, {}
    for mode in o.modes:
        _reset(engines)
        t0 = time.perf_counter()
        stats, m = asyncio.run(_run(mode, engine, long_engine, model, cfg, work, time_scale,
                                    slo_fn, max_len))
        per_mode[mode], metrics[mode] = stats, m.to_dict()
        results[mode] = report.summarize(stats)
        results[mode]["wall_s"] = time.perf_counter() - t0
        log(f"{mode}: {len(stats)} requests in {results[mode]['wall_s']:.0f} s, TTFT p50 "
            f"{results[mode]['ttft_ms_p50']} ms p90 {results[mode]['ttft_ms_p90']} ms")

    ratios = {}
    if "mixed" in results:
        for mode in results:
            if mode != "mixed":
                ratios[f"{mode}/mixed"] = report.ratio(results[mode], results["mixed"])
    out = dict(results)
    if "laps/mixed" in ratios:
        out["ratio"] = ratios["laps/mixed"]
        out["goals_met"] = report.goals_met(ratios["laps/mixed"])
    if "laps-spatial/mixed" in ratios:
        out["ratio_spatial"] = ratios["laps-spatial/mixed"]
    out["run"] = {
        "model": o.model, "trace": o.trace, "trace_format": o.trace_format,
        "requests": n_req, "load": o.load, "length_scale": o.length_scale,
        "max_output": o.max_output,
        "slo_scale": o.slo_scale, "time_scale": time_scale,
        "mixed_capacity_rps": capacity, "threshold": o.threshold or "auto",
        "threshold_at_0_cached": min(model.threshold(0), engine.grid.max_chunk)
        if o.threshold is None else o.threshold,
        "window": dataclasses.asdict(o.window), "buckets": o.buckets,
        "engine": dataclasses.asdict(engine.ecfg), "latency_model": model.to_dict(),
    }
    out["metrics"] = metrics
    with open(os.path.join(o.output_dir, "comparison.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    with open(os.path.join(o.output_dir, "comparison.md"), "w") as f:
        f.write(report.markdown(results, ratios))
    with open(os.path.join(o.output_dir, "requests.jsonl"), "w") as f:
        for mode, stats in per_mode.items():
            for s in stats:
                f.write(json.dumps({"mode": mode, **s.to_dict()}) + "\n")
    title = os.path.basename(o.trace)
    report.plot(per_mode, os.path.join(o.output_dir, "ttft_cdf.png"),
                os.path.join(o.output_dir, "ttft_short_long.png"), title)
    return out
