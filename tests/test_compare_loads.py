"""compare_modes at several loads (capacity measured once) and the regime line it prints."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from laps_jax.bench.loads import describe, loads_markdown, regime, run_loads

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))


@dataclasses.dataclass
class Opts:
    output_dir: str = "/tmp/x"
    load: float = 0.8
    time_scale: float | None = None


def test_later_loads_replay_the_first_loads_arrivals_faster_or_slower():
    seen = []

    def run(o, log):
        seen.append((o.load, o.time_scale, o.output_dir))
        ts = o.time_scale if o.time_scale is not None else 2.0  # "measured" at the first load
        return {"run": {"time_scale": ts}, "mixed": {"slo_violation_rate": 0.1 * o.load},
                "ratio": {"slo_violation_rate": 0.5}}
    out = run_loads(Opts(), [0.5, 0.7, 1.0], run, lambda m: None)
    # time scale x load is constant: 2.0 x 0.5 = 1.0 -> 1.0 / 0.7 and 1.0 / 1.0
    assert [s[1] for s in seen] == [None, pytest.approx(1 / 0.7), pytest.approx(1.0)]
    assert seen[2][2] == "/tmp/x/load_1.00"
    table = loads_markdown(out)
    assert "| 0.70 | 7% | laps | - | - | 0.50 | - | - |" in table


def test_the_regime_says_where_the_cut_sits_and_whether_anything_was_short():
    r = regime(64, 12, {"mixed": {"short_requests": 0, "long_requests": 50},
                        "laps": {"short_requests": 0, "long_requests": 50}})
    assert r["cut_vs_crossover"] == "above"
    assert "none was short" in describe(r)
    r = regime(None, 230, {"laps": {"short_requests": 7, "long_requests": 3}})
    assert (r["threshold"], r["cut_vs_crossover"]) == (230, "at")
    assert "laps 7 of 10" in describe(r) and "none was short" not in describe(r)


@dataclasses.dataclass
class ProbeOpts(Opts):
    modes: tuple = ("mixed", "laps")
    variants: tuple = ("v",)
    repeats: int = 3


def _fcfs(miss_at):
    """A stand-in run_comparison whose mixed misses miss_at(load) of its SLOs; records what
    each probe was asked to run."""
    seen = []

    def run(o, log):
        seen.append(o)
        ts = o.time_scale if o.time_scale is not None else 1.4  # "measured" at the first probe
        return {"run": {"time_scale": ts}, "mixed": {"slo_violation_rate": miss_at(o.load)}}
    return run, seen


def test_the_target_load_is_where_fcfs_misses_inside_the_band():
    from laps_jax.bench.loads import find_target_load
    run, seen = _fcfs(lambda x: min(1.0, max(0.0, (x - 0.8) * 2.0)))  # 30% at load 0.95
    t = find_target_load(ProbeOpts(), (0.2, 0.4), run, lambda m: None)
    assert t.in_band and 0.2 <= t.miss <= 0.4 and 0.9 <= t.load <= 1.0
    # every probe is mixed alone, one round, in its own folder, on the same arrivals rescaled
    assert all(o.modes == ("mixed",) and o.variants == () and o.repeats == 1 for o in seen)
    assert len({o.output_dir for o in seen}) == len(seen)
    assert t.time_scale * t.load == pytest.approx(1.4 * 0.7)
    assert t.probes[0] == (0.7, 0.0) and len(t.probes) == len(seen) <= 6


def test_a_steep_miss_curve_is_bisected_not_stepped_over():
    from laps_jax.bench.loads import find_target_load
    # FCFS jumps from 10% to 60% between load 1.0 and 1.1: 1.4x steps alone would cross it
    run, seen = _fcfs(lambda x: 0.1 if x < 1.0 else (0.3 if x < 1.1 else 0.6))
    t = find_target_load(ProbeOpts(), (0.2, 0.4), run, lambda m: None)
    assert t.in_band and 1.0 <= t.load < 1.1, t.probes


def test_no_load_in_the_band_keeps_the_closest_and_says_so():
    from laps_jax.bench.loads import find_target_load
    logs = []
    run, seen = _fcfs(lambda x: 0.05 if x < 1.0 else 0.9)  # never in 20-40%
    t = find_target_load(ProbeOpts(), (0.2, 0.4), run, logs.append, max_probes=4)
    assert not t.in_band and len(seen) == 4
    assert t.miss == 0.05  # |0.05 - 0.3| < |0.9 - 0.3|
    assert any("no load put mixed's miss rate" in m for m in logs)


@pytest.mark.parametrize("flags,loads,target", [
    ([], [0.5, 0.7, 0.9], None),
    (["--load", "0.6"], None, None),
    (["--loads", "0.4,0.8"], [0.4, 0.8], None),
    (["--target-violation"], None, (0.2, 0.4)),
    (["--target-violation", "0.1,0.3"], None, (0.1, 0.3)),
])
def test_compare_modes_runs_three_loads_unless_told_otherwise(flags, loads, target):
    import compare_modes
    args = compare_modes.parse(["--trace", "t", "--output-dir", "o", *flags])
    assert (args.loads, args.target_violation) == (loads, target)


@pytest.mark.parametrize("flags", [["--target-violation", "--load", "0.5"],
                                   ["--target-violation", "0.4,0.2"],
                                   ["--target-violation", "x"],
                                   ["--loads", "0.5", "--time-scale", "2"]])
def test_compare_modes_refuses_loads_that_contradict(flags, capsys):
    import compare_modes
    with pytest.raises(SystemExit) as e:
        compare_modes.parse(["--trace", "t", "--output-dir", "o", *flags])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_target_violation_end_to_end_on_the_simulated_engine(tmp_path):
    """compare_modes --simulate --target-violation 0.5,0.6: FCFS is probed up the load until it
    misses 50-60% of its SLOs (the Azure trace needs more than the first probe at 0.7), every
    probe is kept, and the modes are compared at the load found."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trace = os.path.join(root, "..", "shared", "traces", "azure_llm_2023_conv.csv")
    if not os.path.exists(trace):
        pytest.skip("the Azure trace is not in ../shared/traces")
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "compare_modes.py"), "--simulate",
         "--profile", os.path.join(root, "docs", "data", "profile_bench_cpu.json"),
         "--no-rescale-profile", "--trace", trace, "--trace-format", "azure",
         "--max-requests", "120", "--length-scale", "0.1",
         "--threshold", "64", "--modes", "mixed,laps", "--target-violation", "0.5,0.6",
         "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    head = (tmp_path / "loads.md").read_text().splitlines()[0]
    probes = [p.split(" -> ") for p in head.split("its SLO miss rate: ")[1].split(";")[0]
              .split(", ")]
    assert len(probes) >= 2 and probes[0][0] == "0.70" and "in the band" in head
    load, miss = probes[-1][0], int(probes[-1][1].rstrip("%"))
    assert 50 <= miss <= 60 and f"compared at load {load}." in head
    assert len(list((tmp_path / "target_probes").iterdir())) == len(probes)
    assert f"| {load} | {miss}% | laps |" in (tmp_path / "loads.md").read_text()
