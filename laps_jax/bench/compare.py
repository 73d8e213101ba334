"""One trace, every mode, one process: the measurement behind `scripts/compare_modes.py`.

Steps: build the engine(s) and warm every bucket; take the latency model from a profile (or
profile now); measure mixed's capacity by replaying the first requests all at once ("serving":
requests/s with their decode interleaved as when serving; "prefill": one output token each);
scale arrivals so mixed runs at `load` of that capacity; replay the trace in each mode on the same
engines (prefix cache cleared, counters reset between modes); write comparison.json, a markdown
table and TTFT plots. With `simulate` the same dispatcher runs on `SimExecutor`s in virtual time
with the profile's latency model (no engine, no noise from a shared CPU). A request's TTFT SLO is `slo_scale` x the latency model's isolated prefill
latency of its new tokens in the default bucket grid (the same SLO in every mode and ablation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
from typing import TYPE_CHECKING, Callable

from laps_jax.config import EngineConfig, resolve_model
from laps_jax.engine.buckets import BucketGrid
from laps_jax.engine.settings import resolve as resolve_settings
from laps_jax.bench import report
from laps_jax.scheduler.clock import RealClock, SimClock, run_simulated
from laps_jax.bench.cpu_meter import run_unbusy
from laps_jax.scheduler.dispatcher import Dispatcher
from laps_jax.scheduler.latency_model import LatencyModel
from laps_jax.scheduler.policy import SchedulerConfig
from laps_jax.scheduler.profiling import (attention_blocks_of, load_profile, plan_shapes,
                                          profile)
from laps_jax.sim.engine import SimEngine, SimExecutor
from laps_jax.sim.summary import summarize_requests
from laps_jax.bench.replay import (OpenRequest, natural_rate, open_requests, replay_open,
                                       replay_sessions, session_arrivals)
from laps_jax.bench.loads import describe, regime
from laps_jax.bench.order import round_order
from laps_jax.bench.variants import Variant, apply
from laps_jax.scheduler.window import WindowConfig
from laps_jax.workload.load import load as load_trace
from laps_jax.workload.records import TraceOptions
from laps_jax.workload.sessions import SessionTrace
from laps_jax.workload.traces import detect_format

if TYPE_CHECKING:  # the engine (JAX) is imported only where a real run builds one
    from laps_jax.engine.engine import Engine


@dataclasses.dataclass
class CompareOptions:
    model: str
    trace: str
    trace_format: str | None           # None: detected from the file
    output_dir: str
    ecfg: EngineConfig
    modes: tuple[str, ...] = ("mixed", "laps", "laps-spatial")
    max_requests: int | None = None
    load: float = 0.8
    length_scale: float = 1.0
    sample: float = 1.0                # fraction of the trace's conversations kept
    slo_scale: float = 5.0
    threshold: int | None = None       # None: the latency model's crossover
    window: WindowConfig = dataclasses.field(default_factory=WindowConfig)
    cross_pool: str = "short-first"
    order: str = SchedulerConfig.order
    long_order: str | None = SchedulerConfig.long_order  # laps' long pool (None: `order`)
    decode_gap_s: float | None = None  # None: one full prefill step (SchedulerConfig)
    long_budget_tokens: int | None = None  # laps long-chunk budget (None: long_chunk_ratio)
    aging_tokens_per_s: float | None = None  # order "aging": credit per second waited (None:
                                             # derived; 0: shortest remaining first)
    max_wait_s: float | None = None          # order "srpt": wait after which a request goes
                                             # first (None: derived)
    repeats: int = 1  # rounds of all modes on the same arrivals, order alternating each round
    buckets: bool = True               # False: one prefill executable (1 x max_chunk)
    time_scale: float | None = None    # None: from the measured capacity and `load`
    profile: str | None = None
    rescale_profile: bool = True       # time some of the profile's shapes now; scale the model
    capacity_requests: int = 24
    capacity_repeats: int = 3          # bursts measured; the median sets the time scale
    max_output: int | None = None      # cap on output tokens per request (decode is costly here)
    capacity_mode: str = "serving"     # "serving": prefill + interleaved decode; "prefill": 1 token
    dtype: str = "float32"
    seed: int = 0
    compile_cache: str | None = None
    simulate: bool = False  # SimExecutors on virtual time with the profile's latency model
    variants: tuple[Variant, ...] = ()  # more modes: a base mode with settings changed
    max_others_cpu: float | None = 0.1  # a mode's run in which others (processes, steal) took
                                        # more of the CPU is run again (None: never)
    busy_reruns: int = 2                # at most this many times per mode and round

    def all_modes(self) -> tuple[str, ...]:
        return self.modes + tuple(v.name for v in self.variants if v.name not in self.modes)

    def base_modes(self) -> set[str]:
        return set(self.modes) | {v.mode for v in self.variants}


_BUILT: dict[str, tuple] = {}  # engines built in this process, by their settings


def _engines(o: CompareOptions, log) -> tuple[Engine, Engine | None]:
    """The engine, and laps-spatial's second one on the same device (no tokenizer: replays
    stop at their trace's output lengths, never at an EOS). Built once per process and
    settings: a run at several loads compiles once."""
    from laps_jax.builder import EngineBuild, build  # JAX: only for real (not simulated) runs
    ecfg = o.ecfg if o.buckets else dataclasses.replace(o.ecfg, min_chunk=o.ecfg.max_chunk,
                                                       max_prefill_batch=1)
    spec = EngineBuild(o.model, ecfg, o.dtype, o.seed,
                       engines=2 if "laps-spatial" in o.base_modes() else 1,
                       tokenizer=False, compile_cache=o.compile_cache)
    key = repr(spec)
    if key not in _BUILT:
        built = build(spec, log=log)
        _BUILT[key] = (built.engine, built.long_engine)
    return _BUILT[key]


def _latency_model(o: CompareOptions, engine: Engine, log) -> tuple[LatencyModel, float | None]:
    """(model, speed factor applied to the profile or None)."""
    if o.profile:
        model, f = load_profile(o.profile, engine, o.rescale_profile)
        if o.rescale_profile:
            log(f"profile rescaled to this machine now: its shapes run {f:.2f}x their profiled "
                f"time" if f is not None else "profile kept: none of its shapes is a bucket here")
        return model, f
    log("no --profile: timing 24 shapes for the latency model")
    samples = profile(engine, plan_shapes(engine, 24, seed=o.seed), reps=2)
    engine.kv.clear_prefix_cache()
    return LatencyModel.fit(engine.cfg, engine.runner.kv_dtype.itemsize,
                            [s.shape for s in samples], [s.seconds for s in samples],
                            attention_blocks_of(engine), "quick-profile"), None


def _workload(o: CompareOptions, vocab: int, max_len: int):
    opts = TraceOptions(max_requests=o.max_requests, length_scale=o.length_scale,
                        vocab_size=vocab, max_len=max_len, seed=o.seed, sample=o.sample)
    cap = o.max_output or 1 << 30
    work = load_trace(o.trace_format, o.trace, opts)
    if isinstance(work, SessionTrace):
        for s in work.sessions:
            s.turns = [dataclasses.replace(t, output_tokens=min(t.output_tokens, cap))
                       for t in s.turns]
        return work
    reqs = open_requests(work)
    for r in reqs:
        r.max_tokens = min(r.max_tokens, cap)
    return reqs


def _capacity_work(work, n: int) -> list[OpenRequest]:
    """The first n requests as one burst. A session turn counts as its new input only: its
    history is cached when served, and a closed-loop burst would measure concurrency instead."""
    if not isinstance(work, SessionTrace):
        return work[:n]
    turns = sorted(((s.arrival_s + k, s, k) for s in work.sessions for k in range(len(s.turns))),
                   key=lambda x: x[0])[:n]
    return [OpenRequest(f"{s.session_id}/{k}", 0.0, s.new_input_ids(k, work.token_space),
                        max(1, s.turns[k].output_tokens), s.turns[k].new_input_tokens)
            for _, s, k in turns]


def measure_capacity(burst: Callable[[], tuple], repeats: int) -> list[float]:
    """Requests/s of `repeats` (>= 1) replays of one burst; the caller takes the median, and
    the load every goal is measured at follows it. A single burst right after start-up once
    measured 7.1 req/s where the next two gave 11.2 (XLA's slow first runs, since primed at
    warm-up), and this shared VM's speed drifts between bursts too."""
    measured = []
    for _ in range(max(1, repeats)):
        stats, _, seconds = burst()
        measured.append(len(stats) / seconds)
    return measured


def _one_token(work: list[OpenRequest]) -> list[OpenRequest]:
    return [dataclasses.replace(r, max_tokens=1) for r in work]


def _reset(engines) -> None:
    for e in engines:
        e.kv.clear_prefix_cache()
        e.runner.reset_stats()


async def _run(mode: str, engine, long_engine, model, cfg: SchedulerConfig, work,
               time_scale: float, slo_fn, max_len: int, clock=None):
    clock = clock or RealClock()
    d = Dispatcher(engine, mode, cfg, long_engine=long_engine if mode == "laps-spatial" else None,
                   clock=clock, latency_model=model)
    await d.start()
    t0 = clock.now()
    if isinstance(work, SessionTrace):
        stats = await replay_sessions(d, work, time_scale, slo_fn, clock, max_len)
    else:
        stats = await replay_open(d, work, time_scale, slo_fn, clock)
    await d.stop(drain=True)
    return stats, d.metrics(), clock.now() - t0


def _executor(o: CompareOptions, sim: bool, engines, model):
    """run(mode, work, time_scale) on the real engines, or on simulated ones in virtual time."""
    engine, long_engine = engines

    def real(mode, work, ts, cfg, slo_fn, max_len):
        _reset([e for e in engines if e is not None])
        return asyncio.run(_run(mode, engine, long_engine, model, cfg, work, ts, slo_fn,
                                max_len))

    def simulated(mode, work, ts, cfg, slo_fn, max_len):
        e = o.ecfg
        grid = BucketGrid.of_settings(e if o.buckets
                                      else dataclasses.replace(e, min_chunk=e.max_chunk))
        clock = SimClock()
        make = lambda name: SimExecutor(SimEngine(grid, e.num_pages, e.page_size,
                                                  e.max_model_len, model.cfg.vocab_size,
                                                  e.enable_prefix_cache), model, clock, name)
        return run_simulated(_run(mode, make("short"), make("long"), model, cfg, work, ts,
                                  slo_fn, max_len, clock))
    return simulated if sim else real


def run_comparison(o: CompareOptions, log: Callable[[str], None] = print) -> dict:
    if len({v.name for v in o.variants}) != len(o.variants):
        raise ValueError("two variants share a name")
    os.makedirs(o.output_dir, exist_ok=True)
    o = dataclasses.replace(o, ecfg=resolve_settings(o.ecfg, resolve_model(o.model)[0]),
                            trace_format=o.trace_format or detect_format(o.trace))
    if o.simulate:
        if not o.profile:
            raise ValueError("--simulate needs --profile (the latency model to simulate with)")
        model_cfg, _ = resolve_model(o.model)
        engine = long_engine = None
        model, speed = LatencyModel.load(o.profile, model_cfg), None
        max_len = min(o.ecfg.max_model_len, model_cfg.max_context)
        vocab = model_cfg.vocab_size
    else:
        engine, long_engine = _engines(o, log)
        model, speed = _latency_model(o, engine, log)
        max_len, vocab = engine.ecfg.max_model_len, engine.cfg.vocab_size
    execute = _executor(o, o.simulate, (engine, long_engine), model)
    ref_grid = BucketGrid.of_settings(o.ecfg)
    slo_fn = lambda new, cached: o.slo_scale * model.predict_prefill(max(new, 1), cached, ref_grid)
    work = _workload(o, vocab, max_len)
    n_req = work.num_requests if isinstance(work, SessionTrace) else len(work)
    cfg = SchedulerConfig(threshold=o.threshold, window=o.window, cross_pool=o.cross_pool,
                          order=o.order, long_order=o.long_order,
                          decode_gap_s=o.decode_gap_s,
                          long_budget_tokens=o.long_budget_tokens,
                          aging_tokens_per_s=o.aging_tokens_per_s, max_wait_s=o.max_wait_s)

    capacity, measured = None, []
    time_scale = o.time_scale
    if time_scale is None:
        sub = _capacity_work(work, o.capacity_requests)
        if o.capacity_mode == "prefill":
            sub = _one_token(sub)
        measured = measure_capacity(lambda: execute("mixed", sub, 0.0, cfg, slo_fn, max_len),
                                    1 if o.simulate else o.capacity_repeats)  # virtual: exact
        capacity = statistics.median(measured)
        arrivals = (session_arrivals(work) if isinstance(work, SessionTrace)
                    else [r.arrival_s for r in work])
        time_scale = natural_rate(arrivals) / (o.load * capacity)
        log(f"mixed {o.capacity_mode} capacity {capacity:.2f} requests/s ({len(sub)} at once; "
            f"median of {', '.join(f'{c:.2f}' for c in measured)}); trace rate "
            f"{natural_rate(arrivals):.2f}/s -> time scale {time_scale:.3f}")

    modes = o.all_modes()
    variants = {v.name: v for v in o.variants}

    def run_mode(mode: str):
        v = variants.get(mode)
        return execute(v.mode if v else mode, work, time_scale,
                       apply(cfg, v.settings) if v else cfg, slo_fn, max_len)

    rounds: list[dict] = []                  # per round: mode -> summary
    round_metrics: list[dict] = []           # per round: mode -> lane metrics
    every: list[tuple[int, str, list]] = []  # (round, mode, stats) of every round
    for rnd in range(max(1, o.repeats)):
        order = round_order(modes, rnd)
        summary, round_metrics_now = {}, {}
        for mode in order:
            again = lambda share, mode=mode: log(
                f"round {rnd + 1}: {mode}: others took {100 * share:.0f}% of the CPU (over "
                f"{100 * o.max_others_cpu:.0f}%): running it again")
            (stats, m, _), cpu, reruns = run_unbusy(
                lambda: run_mode(mode), None if o.simulate else o.max_others_cpu,
                o.busy_reruns, again)
            r = summary[mode] = summarize_requests(stats)
            r["wall_s"] = cpu.wall  # the run kept
            r["others_cpu_share"] = None if o.simulate else cpu.others
            r["steal_cpu_share"] = None if o.simulate else cpu.steal
            r["busy_reruns"] = reruns
            every.append((rnd + 1, mode, stats))
            round_metrics_now[mode] = m.to_dict()
            busy = "" if o.simulate else (f"; others took {100 * cpu.others:.0f}% of the CPU "
                                          f"meanwhile (the hypervisor's steal "
                                          f"{100 * cpu.steal:.0f}%)")
            tag = f"round {rnd + 1}: " if o.repeats > 1 else ""
            log(f"{tag}{mode}: {len(stats)} requests in {r['wall_s']:.0f} s, TTFT p50 "
                f"{r['ttft_ms_p50']:.0f} ms p90 {r['ttft_ms_p90']:.0f} ms{busy}")
        rounds.append(summary)
        round_metrics.append(round_metrics_now)
    results = {m: rounds[0][m] for m in modes}  # tables and plots show round 1
    metrics = round_metrics[0]
    per_mode = {mode: stats for rnd, mode, stats in every if rnd == 1}

    ratios = {}
    if "mixed" in results:
        for mode in results:
            if mode != "mixed":
                per_round = [report.ratio(r[mode], r["mixed"]) for r in rounds]
                ratios[f"{mode}/mixed"] = (per_round[0] if len(rounds) == 1
                                           else report.median_ratio(per_round))
    out = dict(results)
    if "laps/mixed" in ratios:
        out["ratio"] = ratios["laps/mixed"]
        out["goals_met"] = report.goals_met(ratios["laps/mixed"])
    if "laps-spatial/mixed" in ratios:
        out["ratio_spatial"] = ratios["laps-spatial/mixed"]
    if variants and "mixed" in results:
        out["ratio_variants"] = {n: ratios[f"{n}/mixed"] for n in variants}
        out["goals_met_variants"] = {n: report.goals_met(r)
                                     for n, r in out["ratio_variants"].items()}
    out["run"] = {
        "model": o.model, "trace": o.trace, "trace_format": o.trace_format,
        "requests": n_req, "load": o.load, "length_scale": o.length_scale,
        "max_output": o.max_output,
        "slo_scale": o.slo_scale, "time_scale": time_scale,
        "mixed_capacity_rps": capacity, "capacity_rps_measured": measured,
        "capacity_mode": o.capacity_mode, "threshold": o.threshold or "auto",
        "threshold_at_0_cached": min(model.threshold(0), o.ecfg.max_chunk)
        if o.threshold is None else o.threshold,
        "window": dataclasses.asdict(o.window), "buckets": o.buckets,
        "cross_pool": o.cross_pool, "order": o.order, "long_order": o.long_order,
        "decode_gap_s": o.decode_gap_s,
        "long_budget_tokens": o.long_budget_tokens, "long_chunk_ratio": cfg.long_chunk_ratio,
        "fill_rows": cfg.fill_rows, "fill_slack": cfg.fill_slack,
        "finish_slack": cfg.finish_slack,
        "overload_requests": cfg.overload_requests, "overload_check": cfg.overload_check,
        "aging_tokens_per_s": o.aging_tokens_per_s, "max_wait_s": o.max_wait_s,
        "engine": dataclasses.asdict(engine.ecfg if engine else o.ecfg),
        "latency_model": model.to_dict(), "simulated": o.simulate,
        "profile": o.profile, "profile_speed_factor": speed,
        "variants": {v.name: v.to_dict() for v in o.variants},
        "max_others_cpu": o.max_others_cpu, "busy_reruns": o.busy_reruns,
    }
    out["run"]["regime"] = regime(o.threshold, min(model.threshold(0), o.ecfg.max_chunk),
                                  results)
    log(describe(out["run"]["regime"]))
    out["metrics"] = metrics
    if len(rounds) > 1:  # every round's summaries; `ratio` above is the median over rounds
        out["rounds"] = rounds
        out["metrics_rounds"] = round_metrics
        out["run"]["repeats"] = len(rounds)
    report.write_outputs(o.output_dir, out, rounds, results, ratios, every, per_mode,
                         os.path.basename(o.trace), log)
    return out
