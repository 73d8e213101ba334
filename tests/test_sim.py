"""The simulator on cases small enough to check by hand, determinism, and the router's policies.

Everything runs on virtual time (no model, no compiles): each test takes milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from laps_jax.config import PRESETS
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel, StepShape
from laps_jax.scheduler.policy import SchedulerConfig
from laps_jax.scheduler.router import Router, RouterConfig
from laps_jax.scheduler.window import WindowConfig
from laps_jax.sim import hardware
from laps_jax.sim import workload as wl
from laps_jax.sim.driver import RunSpec, simulate
from laps_jax.sim.executor import SharedDevice
from laps_jax.sim.instance import GridSpec, InstanceSpec, build_dispatcher
from laps_jax.sim.summary import summarize

CFG = PRESETS["tiny"]
MODEL = LatencyModel(CFG, 4, DeviceSpec("toy", 1e9, 1e12, 0.010))  # compute-bound past ~1 token
GRID = GridSpec(max_chunk=256, min_chunk=16, max_prefill_batch=8, max_decode_batch=8)


def step(rows: list[int], width: int) -> float:
    """Predicted latency of one prefill step in the (rows, width) bucket."""
    b = 1 << (len(rows) - 1).bit_length()
    return MODEL.predict(StepShape.bucketed(tuple(rows), (0,) * len(rows), b, width))


def spec(mode: str, threshold: int = 64, window: WindowConfig | None = None,
         long_chunk_ratio: float | None = None) -> InstanceSpec:
    """(Long chunks are the full budget unless a ratio is given: hand-checkable steps.)"""
    return InstanceSpec(mode, GRID, kv_cache_tokens=8192, max_model_len=2048,
                        scheduler=SchedulerConfig(threshold=threshold,
                                                  window=window or WindowConfig(mode="off"),
                                                  long_chunk_ratio=long_chunk_ratio))


def replay(inst: InstanceSpec, arrivals: list[tuple[float, int]]) -> list:
    """Submits (time, prompt length) requests with one output token; their stats in order."""
    async def main():
        clock = SimClock()
        d = build_dispatcher(inst, CFG, MODEL, clock)
        await d.start()
        handles = []
        for i, (t, n) in enumerate(arrivals):
            await clock.sleep(t - clock.now())
            handles.append(d.submit([10 + (i * 131 + j) % 400 for j in range(n)],
                                    SamplingParams(max_tokens=1), request_id=f"r{i}"))
        stats = [await h.result() for h in handles]
        await d.stop()
        return stats
    return run_simulated(main())


# -- hand-checkable cases --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["mixed", "laps", "laps-spatial"])
def test_one_request_ttft_is_one_predicted_step(mode):
    (st,) = replay(spec(mode), [(0.0, 20)])
    assert st.ttft == pytest.approx(step([20], 32))


def test_one_short_request_waits_out_a_static_window():
    (st,) = replay(spec("laps", window=WindowConfig(mode="static", static_s=0.05)), [(0.0, 20)])
    assert st.ttft == pytest.approx(0.05 + step([20], 32))


def test_a_window_that_expires_batches_what_came_in_time():
    inst = spec("laps", window=WindowConfig(mode="static", static_s=0.05))
    a, b = replay(inst, [(0.0, 20), (0.02, 30)])
    both = step([20, 30], 32)  # one step of two rows, dispatched when the window ends
    assert a.ttft == pytest.approx(0.05 + both)
    assert b.ttft == pytest.approx(0.03 + both)


def test_two_requests_in_a_known_order():
    """A long step runs; a long B and a short C arrive during it. mixed serves B first (FCFS),
    laps serves C first (short pool first). Steps are not preempted."""
    arrivals = [(0.0, 200), (0.001, 150), (0.002, 10)]
    da, db, dc = step([200], 256), step([150], 256), step([10], 16)
    _, b, c = replay(spec("mixed"), arrivals)
    assert b.ttft == pytest.approx(da + db - 0.001)
    assert c.ttft == pytest.approx(da + db + dc - 0.002)
    _, b, c = replay(spec("laps"), arrivals)
    assert c.ttft == pytest.approx(da + dc - 0.002)
    assert b.ttft == pytest.approx(da + dc + db - 0.001)


def test_a_short_request_waits_out_one_long_chunk_not_the_whole_prompt():
    """laps cuts long prompts into chunks predicted to take at most 5 cheapest steps: a short
    request arriving during a long prefill waits for the chunk that is running, no more."""
    cheapest = step([16], 16)
    w = max(t for t in (16, 32, 64, 128, 256) if step([t], t) <= 5 * cheapest)
    assert w < 200  # the toy device is compute-bound: 200 tokens are more than 5 small steps
    arrivals = [(0.0, 200), (0.001, 10)]
    _, c = replay(spec("laps", long_chunk_ratio=5.0), arrivals)
    assert c.ttft == pytest.approx(step([w], w) + step([10], 16) - 0.001)
    _, whole = replay(spec("laps"), arrivals)
    assert whole.ttft == pytest.approx(step([200], 256) + step([10], 16) - 0.001)


def test_shared_device_is_processor_sharing():
    async def main():
        dev, loop = SharedDevice(0.0), asyncio.get_running_loop()
        done = {}

        async def job(name, start, solo):
            await asyncio.sleep(start)
            await dev.run(solo)
            done[name] = loop.time()
        await asyncio.gather(job("a", 0.0, 1.0), job("b", 0.5, 1.0))
        return done
    done = run_simulated(main())
    assert done["a"] == pytest.approx(1.5)   # alone 0.5 s, then half speed for 1 s
    assert done["b"] == pytest.approx(2.0)


# -- whole runs -------------------------------------------------------------------------------
def _lmsys_run(seed: int, mode: str = "laps"):
    src = hardware.roofline("qwen2.5-32b")
    w = wl.load("lmsys", max_requests=60, seed=seed, rate=4.0)
    inst = InstanceSpec(mode, GridSpec(), kv_cache_tokens=200_000)
    rs = RunSpec(inst, rate=4.0)
    result = simulate(rs, src, w)
    return result, summarize(result, rs, src)


def test_same_seed_same_result_other_seed_other_result():
    r1, s1 = _lmsys_run(3)
    r2, s2 = _lmsys_run(3)
    r3, _ = _lmsys_run(4)
    key = lambda r: sorted((s.request_id, s.arrival, s.ttft, s.cached_tokens) for s in r.stats)
    assert key(r1) == key(r2) and s1 == s2
    assert key(r1) != key(r3)
    lo, hi = r1.window  # sessions are measured in their steady-state window
    assert s1["completed"] == sum(lo <= s.arrival <= hi for s in r1.stats) > 0
    assert s1["requests_per_s"] * s1["prefill_span_s"] == sum(
        lo <= s.prefill_done <= hi for s in r1.stats)
    assert s1["cached_tokens"] > 0  # later turns re-use their history


def test_physical_limit_of_qwen_32b_on_h200():
    cfg = PRESETS["qwen2.5-32b"]
    assert hardware.flops_per_token(cfg) == pytest.approx(65.5e9, rel=0.01)
    assert hardware.physical_limit_tokens_per_s(cfg, hardware.H200) == pytest.approx(12_060,
                                                                                     rel=0.01)
    assert 150_000 < hardware.kv_capacity_tokens(cfg, hardware.H200) < 300_000


# -- the router -------------------------------------------------------------------------------
def _router(n: int, policy: str, **kw):
    clock = SimClock()
    ds = [build_dispatcher(spec("laps"), CFG, MODEL, clock, f"i{i}") for i in range(n)]
    return Router(ds, RouterConfig(policy=policy, **kw), clock), clock


def _prompt(n: int, key: int) -> list[int]:
    return [10 + (key * 977 + j * 13) % 400 for j in range(n)]


def test_round_robin_cycles():
    async def main():
        r, _ = _router(4, "round-robin", affinity_ratio=None)
        await r.start()
        for i in range(6):
            r.submit(_prompt(20, i), SamplingParams(max_tokens=1))
        await r.stop()
        return r.stats.routed
    assert run_simulated(main()) == [2, 2, 1, 1]


def test_least_load_avoids_the_busy_instance():
    async def main():
        r, _ = _router(2, "least-load", affinity_ratio=None)
        await r.start()
        a = r.submit(_prompt(250, 1), SamplingParams(max_tokens=1))   # -> i0 (tie, first)
        b = r.submit(_prompt(20, 2), SamplingParams(max_tokens=1))    # i0 is loaded -> i1
        c = r.submit(_prompt(20, 3), SamplingParams(max_tokens=1))    # i1 holds less -> i1
        await r.stop()
        return [h.request.lane.executor.name.split("/")[0] for h in (a, b, c)]
    assert run_simulated(main()) == ["i0", "i1", "i1"]


def test_length_aware_groups_and_rebalancing():
    """Short and long requests go to their groups; pending work skewed to one group pulls an
    instance over (each group keeps one; one move per check)."""
    async def main():
        r, clock = _router(4, "length-aware", affinity_ratio=None, rebalance_interval_s=0.0,
                           rebalance_ratio=2.0, threshold=64)
        await r.start()
        long = r.submit(_prompt(250, 1), SamplingParams(max_tokens=1))   # to the long group
        short = r.submit(_prompt(20, 2), SamplingParams(max_tokens=1))   # long work pending,
        where = [h.request.lane.executor.name.split("/")[0] for h in (long, short)]  # none short
        await clock.sleep(10.0)  # all done: nothing pending anywhere
        for i in range(6):       # only short work now: instances move back to the short group
            r.submit(_prompt(30, 10 + i), SamplingParams(max_tokens=1))
        await r.stop()
        return where, [g[1:] for g in r.stats.groups], r.group
    where, sizes, groups = run_simulated(main())
    assert where[0] in ("i2", "i3") and where[1] in ("i0", "i1")
    assert sizes == [(2, 2), (1, 3), (2, 2), (3, 1)]   # (short, long) after each move
    assert groups.count("long") == 1


def test_affinity_sends_a_follow_up_turn_to_its_history():
    async def main():
        r, _ = _router(3, "round-robin", affinity_ratio=0.5)
        await r.start()
        history = _prompt(200, 7)
        first = r.submit(history, SamplingParams(max_tokens=1))
        await first.result()
        r.submit(_prompt(20, 8), SamplingParams(max_tokens=1))   # moves the RR pointer on
        follow = r.submit(history + _prompt(20, 9), SamplingParams(max_tokens=1))
        await follow.result()
        await r.stop()
        return first.request.lane, follow.request.lane, follow.stats.cached_tokens
    lane_a, lane_b, cached = run_simulated(main())
    assert lane_a is lane_b and cached == 192  # 12 full pages of 16 tokens


@pytest.mark.parametrize("spill_s, expected", [(None, ["i1", "i1", "i0"]),
                                               (float("inf"), ["i1", "i1", "i1"])])
def test_length_aware_spills_long_work_to_an_idle_short_group(spill_s, expected):
    """Group [short i0, long i1]; three long prompts of about one full step each. The third
    finds i1 more than a full step busier than the idle i0 and spills (unless spill_s = inf)."""
    async def main():
        r, _ = _router(2, "length-aware", affinity_ratio=None, threshold=64, spill_s=spill_s,
                       rebalance_interval_s=1e9)
        await r.start()
        hs = [r.submit(_prompt(250, 20 + i), SamplingParams(max_tokens=1)) for i in range(3)]
        await r.stop()
        return [h.request.lane.executor.name.split("/")[0] for h in hs]
    assert run_simulated(main()) == expected


def test_generated_sessions_keep_their_lengths_at_any_rate():
    a = wl.load("lmsys", max_requests=90, seed=5, rate=2.0)
    b, scale = a.at_rate(8.0)
    assert scale == 1.0 and list(a.new_token_counts()) == list(b.new_token_counts())
    starts = lambda w: [s.arrival_s for s in w.sessions.sessions]
    assert starts(b)[-1] == pytest.approx(starts(a)[-1] / 4)


def test_a_run_that_shared_the_cpu_is_run_again_and_a_kept_one_is_named():
    """compare_modes reruns a mode's replay while others (processes, steal) took more than the
    bound of the CPU (at most `reruns` more times), keeps the last result, and comparison.md
    names both the reruns and a run kept over the bound."""
    from laps_jax.scheduler.cpu_meter import run_unbusy
    from laps_jax.scheduler.report import busy_note

    def meters(shares):
        it = iter(shares)

        class Fake:
            def __enter__(self):
                self.others, self.wall = next(it), 1.0
                return self

            def __exit__(self, *exc):
                return False
        return Fake

    calls, told = [], []
    run = lambda: calls.append(len(calls)) or len(calls)
    out, m, n = run_unbusy(run, 0.1, 2, told.append, meters([0.3, 0.05, 0.9]))
    assert (out, m.others, n, told) == (2, 0.05, 1, [0.3])  # second run clean: kept
    calls.clear()
    told.clear()
    out, m, n = run_unbusy(run, 0.1, 2, told.append, meters([0.3, 0.2, 0.4, 0.0]))
    assert (out, m.others, n, told) == (3, 0.4, 2, [0.3, 0.2])  # out of reruns: last kept
    calls.clear()
    out, m, n = run_unbusy(run, None, 2, told.append, meters([0.9]))
    assert (out, n) == (1, 0)  # no bound: run once
    rounds = [{"mixed": {"others_cpu_share": 0.02, "busy_reruns": 0},
               "laps": {"others_cpu_share": 0.04, "busy_reruns": 1}},
              {"mixed": {"others_cpu_share": 0.35, "busy_reruns": 2},
               "laps": {"others_cpu_share": None, "busy_reruns": 0}}]
    note = busy_note(rounds, 0.1)
    assert "round 1 laps (1x)" in note and "round 2 mixed (2x)" in note
    assert "over 10% of the CPU (suspect): round 2 mixed (35%)." in note
    assert "round 1 mixed" not in note and busy_note(rounds[:1], None).count("round") == 1
    assert busy_note([{"mixed": {"others_cpu_share": 0.0, "busy_reruns": 0}}], 0.1) == ""


def test_cpu_meter_counts_others_and_steal_not_ourselves(monkeypatch):
    """Others' share = (busy jiffies of all cores - our own CPU seconds) / (wall x cores); the
    hypervisor's steal is busy time that is not ours (its share reported on its own)."""
    import os

    from laps_jax.scheduler import cpu_meter
    tick, cores = os.sysconf("SC_CLK_TCK"), os.cpu_count()
    clock, ours = iter([10.0, 12.0]), iter([1.0, 1.0 + 1.0 * cores])
    busy = iter([(0.0, 0.0), (1.5 * cores * tick, 0.4 * tick)])
    monkeypatch.setattr(cpu_meter, "_clock", lambda: next(clock))
    monkeypatch.setattr(cpu_meter, "_busy_jiffies", lambda: next(busy))
    monkeypatch.setattr(cpu_meter, "_our_seconds", lambda: next(ours))
    with cpu_meter.CpuMeter() as m:
        pass
    # 2 s of wall: each core busy 1.5 s of it, 1 s of that ours -> others 0.5 / 2 = 0.25
    assert m.wall == 2.0 and m.others == pytest.approx(0.25)
    assert m.steal == pytest.approx(0.4 / (2.0 * cores))


def test_median_ratio_skips_undefined_rounds():
    from laps_jax.scheduler.report import median_ratio
    got = median_ratio([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 2.0, "b": None}])
    assert got == {"a": 2.0, "b": 2.0}


def _simulated_compare(tmp_path, logs: list[str] | None = None, **changes) -> dict:
    """compare_modes --simulate --repeats 2 over 60 Azure requests into tmp_path."""
    from pathlib import Path

    from laps_jax.config import EngineConfig
    from laps_jax.scheduler.compare import CompareOptions, run_comparison
    repo = Path(__file__).resolve().parents[1]
    trace = next((p for p in (repo.parent / "shared" / "traces" / "azure_llm_2023_conv.csv",
                              Path("/work/shared/traces/azure_llm_2023_conv.csv")) if p.exists()),
                 None)
    if trace is None:
        pytest.skip("azure_llm_2023_conv.csv not found")
    o = CompareOptions(model="bench-cpu", trace=str(trace), trace_format="azure",
                       output_dir=str(tmp_path), modes=("mixed", "laps"),
                       ecfg=EngineConfig(max_chunk=512, max_decode_batch=16,
                                         kv_cache_tokens=32768),
                       max_requests=60, length_scale=0.1, threshold=26, time_scale=0.3,
                       profile=str(repo / "docs" / "data" / "profile_bench_cpu.json"),
                       simulate=True, repeats=2)
    o = dataclasses.replace(o, **changes)
    return run_comparison(o, (logs if logs is not None else []).append)


def test_round_order_reverses_each_pair_and_moves_every_mode_through_every_position():
    from itertools import permutations

    from laps_jax.scheduler.compare import round_order
    modes = ["mixed", "laps", "laps-spatial"]
    orders = [round_order(modes, k) for k in range(6)]
    assert sorted(map(tuple, orders)) == sorted(permutations(modes))  # all six, once each
    assert all(orders[k + 1] == orders[k][::-1] for k in (0, 2, 4))   # drift cancels by pairs
    assert round_order(modes, 6) == orders[0]
    two = [round_order(["a", "b"], k) for k in range(4)]
    assert [o[0] for o in two].count("a") == 2 and all(sorted(o) == ["a", "b"] for o in two)
    assert round_order(["a"], 3) == ["a"]


def test_compare_repeats_rounds_in_alternating_order(tmp_path):
    """compare_modes --simulate --repeats 2: both rounds recorded, modes alternate their order,
    and the reported ratio is the median of the rounds' (equal here: virtual time is exact)."""
    import os
    logs: list[str] = []
    out = _simulated_compare(tmp_path, logs)
    assert out["run"]["repeats"] == 2 and len(out["rounds"]) == 2
    order = [line.split(":")[1].strip() for line in logs if line.startswith("round")]
    assert order == ["mixed", "laps", "laps", "mixed"]
    assert out["rounds"][0]["laps"]["ttft_ms_p90"] == out["rounds"][1]["laps"]["ttft_ms_p90"]
    want = out["rounds"][0]["laps"]["ttft_ms_p90"] / out["rounds"][0]["mixed"]["ttft_ms_p90"]
    assert out["ratio"]["ttft_ms_p90"] == pytest.approx(want)
    assert os.path.exists(tmp_path / "comparison.json")
    # every round's requests and lane counters are kept, so each round can be validated
    import json
    rows = [json.loads(line) for line in open(tmp_path / "requests.jsonl")]
    assert sorted({(r["round"], r["mode"]) for r in rows}) == [
        (1, "laps"), (1, "mixed"), (2, "laps"), (2, "mixed")]
    assert len(rows) == 4 * 60
    assert [sorted(m) for m in out["metrics_rounds"]] == [["laps", "mixed"]] * 2
    from laps_jax.sim.cells import real_requests, run_rounds
    assert run_rounds(out) == 2
    assert {m: len(v) for m, v in real_requests(str(tmp_path), 2).items()} == {"mixed": 60,
                                                                                "laps": 60}


def test_a_variant_runs_its_mode_with_its_settings_beside_the_others(tmp_path):
    """--variant laps-ratio=laps:order=ratio,long_budget_tokens=512 runs in the same rounds as
    laps and mixed, with its own ratio and goals: its requests are exactly those of a run of laps
    with those settings (virtual time is exact), laps keeps its own, and validation replays the
    variant with its settings (every cell exact)."""
    from laps_jax.scheduler.variants import parse_variant
    from laps_jax.sim.validate import ValidationOptions, validate
    logs: list[str] = []
    out = _simulated_compare(tmp_path / "ab", logs,
                             variants=(parse_variant(
                                 "laps-ratio=laps:order=ratio,long_budget_tokens=512"),))
    order = [line.split(":")[1].strip() for line in logs if line.startswith("round")]
    assert order == ["mixed", "laps", "laps-ratio", "laps-ratio", "laps", "mixed"]
    alone = _simulated_compare(tmp_path / "ratio", order="ratio", long_budget_tokens=512)
    virtual = lambda r: {k: v for k, v in r.items() if k != "wall_s"}  # wall_s: real time
    assert virtual(out["rounds"][0]["laps-ratio"]) == virtual(alone["rounds"][0]["laps"])
    assert virtual(out["rounds"][0]["laps"]) != virtual(alone["rounds"][0]["laps"])
    assert out["ratio_variants"]["laps-ratio"] == alone["ratio"]
    assert out["goals_met_variants"]["laps-ratio"] == alone["goals_met"]
    assert out["run"]["variants"] == {"laps-ratio": {"mode": "laps",
                                                    "settings": {"order": "ratio",
                                                                 "long_budget_tokens": 512}}}
    r = validate(ValidationOptions(str(tmp_path / "ab"), calibrate=True, round=1))
    assert {row["mode"] for row in r["rows"]} == {"mixed", "laps", "laps-ratio"}
    assert r["worst_abs_error"] < 1e-6


def test_over_rounds_takes_each_cells_median_and_the_halves_noise_floor():
    """The median-over-rounds verdict: per cell, the median of the real values over the rounds
    against the median of the simulated ones; cells of pools under min_samples are shown, not
    judged; the noise floor compares the odd rounds' real median with the even rounds'."""
    from laps_jax.sim.cells import over_rounds

    def result(real50, sim50, real90, sim90, n=50):
        row = {"mode": "laps", "pool": "short", "n_real": n, "n_sim": n,
               "real_p50_ms": real50, "sim_p50_ms": sim50,
               "real_p90_ms": real90, "sim_p90_ms": sim90}
        tiny = dict(row, pool="long", n_real=2, real_p50_ms=1.0, sim_p50_ms=9.0)
        return {"rows": [row, tiny], "options": {"min_samples": 5, "tolerance": 0.2}}
    # round by round the p90 is off by 40-50%, but the medians agree within 10%
    rounds = [result(10, 11, 100, 150), result(20, 19, 200, 110), result(30, 30, 150, 200)]
    med = over_rounds(rounds, 0.2)
    short = next(r for r in med["rows"] if r["pool"] == "short")
    assert (short["real_p50_ms"], short["sim_p50_ms"]) == (20, 19)
    assert (short["real_p90_ms"], short["sim_p90_ms"]) == (150, 150)
    assert med["cells"] == 2 and med["within_tolerance"]  # the long pool (2 requests): not judged
    floor = next(r for r in med["halves"]["rows"] if r["pool"] == "short")
    assert (floor["real_p50_ms"], floor["sim_p50_ms"]) == (20, 20)   # rounds 1, 3 vs round 2
    assert floor["err_p90"] == pytest.approx(200 / 125 - 1)
    assert not med["halves"]["within_tolerance"]
    assert not over_rounds([result(10, 13, 100, 100)] * 3, 0.2)["within_tolerance"]


@pytest.mark.parametrize("text, match", [
    ("laps-srpt=laps", "NAME=MODE:KEY=VALUE"),
    ("laps=laps:order=srpt", "taken"),
    ("run=laps:order=srpt", "taken"),
    ("x=fcfs:order=srpt", "mode is one of"),
    ("x=laps:order=sjf", "order is one of"),
    ("x=laps:threshold=abc", "threshold wants a int"),
    ("x=laps:threshold=-4", ">= 0"),
    ("x=laps:budget=4", "KEY one of"),
    ("x=laps:", "changes no setting"),
    ("x=laps:long_chunk_ratio=0", "long_chunk_ratio must be > 0"),  # in range for the parser,
    ("x=laps:max_wait_s=0", "'x': max_wait_s must be > 0"),         # not for the scheduler
    ("x=laps:fill_rows=maybe", "fill_rows wants a flag"),
    ("x=laps:fill_slack=-0.1", ">= 0"),
    ("x=laps:overload_requests=2.5", "overload_requests wants a count_or_off"),
])
def test_a_bad_variant_is_refused_with_what_is_wrong(text, match):
    from laps_jax.scheduler.variants import parse_variant
    with pytest.raises(ValueError, match=match):
        parse_variant(text)


def test_a_variant_turns_the_overload_mark_off_or_moves_it():
    from laps_jax.scheduler.variants import parse_variant
    assert parse_variant("a=laps:overload_requests=off").settings == {"overload_requests": None}
    assert parse_variant("b=laps:overload_requests=8").settings == {"overload_requests": 8}
    assert parse_variant("c=laps:overload_check=off").settings == {"overload_check": False}


def test_capacity_is_measured_over_several_bursts():
    """compare's capacity: one rate per burst (requests / seconds), every burst run."""
    from laps_jax.scheduler.compare import measure_capacity
    seconds = iter([4.0, 2.0, 5.0])
    calls = []

    def burst():
        calls.append(1)
        return [object()] * 24, None, next(seconds)
    assert measure_capacity(burst, 3) == [6.0, 12.0, 4.8]
    assert len(calls) == 3
    assert measure_capacity(lambda: ([1, 2], None, 1.0), 0) == [2.0]  # at least one burst


# -- calibration against real runs (validation) --------------------------------------------------
def test_calibration_scales_each_kind_and_its_jitter_is_seeded():
    from laps_jax.sim.executor import Calibration
    inst = spec("mixed")
    inst.calibration = Calibration(scale={"prefill": 2.0})
    (st,) = replay(inst, [(0.0, 20)])
    assert st.ttft == pytest.approx(2.0 * step([20], 32))  # decode would not be scaled
    inst.calibration = Calibration(scale={"prefill": 2.0}, jitter={"prefill": 0.5}, seed=3)
    arrivals = [(0.5 * i, 20) for i in range(40)]           # one isolated step each
    a = [s.ttft for s in replay(inst, arrivals)]
    assert a == [s.ttft for s in replay(inst, arrivals)]    # same seed, same draws
    ratios = [t / (2.0 * step([20], 32)) for t in a]
    assert len(set(ratios)) == len(ratios)                  # every step drawn anew
    assert 0.75 < sum(ratios) / len(ratios) < 1.25           # mean 1 (CV 0.5, 40 draws)
    inst.calibration = Calibration(scale={"prefill": 2.0}, jitter={"prefill": 0.5}, seed=4)
    assert [s.ttft for s in replay(inst, arrivals)] != a


def test_step_jitter_is_the_real_spread_the_simulation_lacks():
    from laps_jax.sim.lane_timings import step_jitter

    def lanes(*buckets):  # (key, [step seconds ...]) -> lanes as comparison.json holds them
        acc = {k: [len(ts), sum(ts), sum(t * t for t in ts)] for k, ts in buckets}
        return [{"counters": {"bucket_seconds": acc}}]
    real = lanes(("decode 8x1", [1.0, 3.0] * 5), ("decode 1x1", [2.0] * 10),
                 ("prefill 1x16", [1.0, 3.0] * 5))
    # decode 8x1: CV 0.5 real, 0 simulated; decode 1x1: steady in both -> sqrt(0.25 / 2)
    sim = lanes(("decode 8x1", [2.0] * 10), ("decode 1x1", [2.0] * 10))
    assert step_jitter(real, sim, "decode") == pytest.approx((0.25 / 2) ** 0.5)
    # the simulation's own spread (contexts differing within a shape) is not added twice
    assert step_jitter(real, lanes(("decode 8x1", [1.0, 3.0] * 5)), "decode") == 0.0
    assert step_jitter(real, sim, "prefill") == pytest.approx(0.5)
    assert step_jitter([{"counters": {}}], sim, "decode") == 0.0  # older runs: none recorded


def test_validation_of_a_simulated_run_reproduces_it(tmp_path):
    """The calibrated validation replays a run the simulator itself made: speed factors 1, no
    jitter or lateness to add, every TTFT cell exact; and at the same speed laps/mixed is the
    run's own ratio."""
    import json

    from laps_jax.sim.validate import ValidationOptions, same_speed, validate
    out = _simulated_compare(tmp_path)
    comp = json.loads((tmp_path / "comparison.json").read_text())
    comp["rounds"][1]["laps"]["others_cpu_share"] = 0.25  # a busy neighbour in round 2 only
    (tmp_path / "comparison.json").write_text(json.dumps(comp))
    for rnd in (1, 2):
        r = validate(ValidationOptions(str(tmp_path), calibrate=True, round=rnd))
        assert r["cells"] >= 6 and r["worst_abs_error"] < 1e-6
        assert r["others_cpu_share"]["laps"] == (0.25 if rnd == 2 else None)  # that round's
        for mode in ("mixed", "laps"):
            cal = r["speed_factors"][mode]
            assert all(v == pytest.approx(1.0) for v in cal["scale"].values())
            assert all(v == pytest.approx(0.0, abs=1e-6) for v in cal["jitter"].values())
    same = same_speed(ValidationOptions(str(tmp_path), round=1))
    for k in ("ttft_short_ms_p90", "prefill_latency_ms_mean", "ttft_long_ms_p90"):
        assert same["ratio"][k] == pytest.approx(out["ratio"][k])
    # laps replayed with other settings: mixed (and its calibration) unchanged, laps not
    other = same_speed(ValidationOptions(str(tmp_path), round=1), {"long_budget_tokens": 32})
    assert other["mixed"] == same["mixed"] and other["laps"] != same["laps"]
    with pytest.raises(ValueError, match="unknown laps settings"):
        same_speed(ValidationOptions(str(tmp_path), round=1), {"budget": 1})
    no_window = same_speed(ValidationOptions(str(tmp_path), round=1), {"window_mode": "off"})
    assert no_window["mixed"] == same["mixed"]
    with pytest.raises(ValueError, match="window mode"):  # the setting reaches laps' window
        same_speed(ValidationOptions(str(tmp_path), round=1), {"window_mode": "bogus"})
    # the sensitivity leaves the prediction alone and gives each cell a gain; the tail of
    # all requests queues, so it grows at least in proportion with the step time (a small
    # pool's p50 may not move: windows and arrival gaps do not scale)
    first = validate(ValidationOptions(str(tmp_path), calibrate=True, round=1))
    sens = validate(ValidationOptions(str(tmp_path), calibrate=True, round=1, sensitivity=0.05))
    assert [r["sim_p50_ms"] for r in sens["rows"]] == [r["sim_p50_ms"] for r in first["rows"]]
    assert all(r["gain_p50"] is not None for r in sens["rows"] if r["n_real"] >= 5)
    assert all(r["gain_p90"] > 1.0 for r in sens["rows"] if r["pool"] == "all")
    # a run kept gzipped (how docs/data keeps runs) validates the same
    import gzip
    plain = tmp_path / "requests.jsonl"
    with gzip.open(f"{plain}.gz", "wt") as f:
        f.write(plain.read_text())
    plain.unlink()
    assert validate(ValidationOptions(str(tmp_path), calibrate=True, round=1))["rows"] == \
        first["rows"]


def test_cell_gain_is_the_relative_change_per_relative_step_change():
    from laps_jax.sim.cells import markdown, over_rounds
    from laps_jax.sim.validate import cell_gains
    row = lambda pool, sim: {"mode": "laps", "pool": pool, "n_real": 9, "real_p50_ms": 100.0,
                             "sim_p50_ms": sim, "err_p50": sim / 100 - 1, "real_p90_ms": 200.0,
                             "sim_p90_ms": 2 * sim, "err_p90": sim / 100 - 1}
    rows = [row("all", 100.0), row("short", 50.0)]
    # steps 10% slower / faster: "all" moves 90 -> 130 (gain 2), "short" not at all
    lo = {"all": {"p50": 90.0, "p90": 190.0}, "short": {"p50": 50.0, "p90": 100.0}}
    hi = {"all": {"p50": 130.0, "p90": 190.0}, "short": {"p50": 50.0, "p90": 100.0}}
    cell_gains(rows, 0.1, [lo, hi])
    assert rows[0]["gain_p50"] == pytest.approx(2.0) and rows[0]["gain_p90"] == 0.0
    assert rows[1]["gain_p50"] == 0.0
    result = {"rows": rows, "options": {"min_samples": 5, "tolerance": 0.2}}
    faster = {"rows": [dict(rows[0], gain_p50=4.0), rows[1]], "options": result["options"]}
    med = over_rounds([result, faster])
    assert med["rows"][0]["gain_p50"] == pytest.approx(3.0)  # median of 2 and 4
    assert "| 3.0 |" in markdown(med) and "gain p50" in markdown(med)


def test_validation_with_another_profile_plans_with_the_runs_model(tmp_path):
    """--profile changes what simulated steps cost, never what the scheduler planned with: a
    profile of the run's device uniformly 2x slower calibrates back to factor ~0.5 (decode
    steps' mix differs a little in the uncalibrated pass), and the cells then come within 10%
    only if the dispatcher still plans (windows, deadlines, aging) with the run's own model
    (planning with the slow model: 23% off)."""
    import json

    from laps_jax.sim.validate import ValidationOptions, validate
    out = _simulated_compare(tmp_path / "run")
    model = LatencyModel.from_dict(out["run"]["latency_model"], PRESETS["bench-cpu"])
    slow = model.scaled(2.0)
    path = tmp_path / "slow.json"
    path.write_text(json.dumps({"model": "bench-cpu", "latency_model": slow.to_dict()}))
    r = validate(ValidationOptions(str(tmp_path / "run"), calibrate=True, round=1,
                                   profile=str(path), calibrate_by="kind"))
    for mode in ("mixed", "laps"):
        assert all(v == pytest.approx(0.5, rel=0.02)
                   for v in r["speed_factors"][mode]["scale"].values())
    assert r["worst_abs_error"] < 0.1
    # per compiled shape (the default): every shape run 5+ times gets exactly 0.5; the kind
    # factors only cover the rarer shapes
    r = validate(ValidationOptions(str(tmp_path / "run"), calibrate=True, round=1,
                                   profile=str(path)))
    for mode in ("mixed", "laps"):
        shapes = {k: v for k, v in r["speed_factors"][mode]["scale"].items() if " " in k}
        assert len(shapes) >= 4 and all(v == pytest.approx(0.5, rel=0.01)
                                        for v in shapes.values())
    assert r["worst_abs_error"] < 0.1
