"""The compare_modes harness (bench/): rounds, their order, variants, the CPU meter, capacity
bursts; simulated, so no model compiles."""

from __future__ import annotations

import pytest

from sim_fixtures import simulated_compare


def test_a_run_that_shared_the_cpu_is_run_again_and_a_kept_one_is_named():
    """compare_modes reruns a mode's replay while others (processes, steal) took more than the
    bound of the CPU (at most `reruns` more times), keeps the last result, and comparison.md
    names both the reruns and a run kept over the bound."""
    from laps_jax.bench.cpu_meter import run_unbusy
    from laps_jax.bench.report import busy_note

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

    from laps_jax.bench import cpu_meter
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
    from laps_jax.bench.report import median_ratio
    got = median_ratio([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 2.0, "b": None}])
    assert got == {"a": 2.0, "b": 2.0}


def test_compare_repeats_rounds_in_alternating_order(tmp_path):
    """compare_modes --simulate --repeats 2: both rounds recorded, modes alternate their order,
    and the reported ratio is the median of the rounds' (equal here: virtual time is exact)."""
    import os
    logs: list[str] = []
    out = simulated_compare(tmp_path, logs)
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
    from laps_jax.bench.cells import real_requests, run_rounds
    assert run_rounds(out) == 2
    assert {m: len(v) for m, v in real_requests(str(tmp_path), 2).items()} == {"mixed": 60,
                                                                                "laps": 60}


def test_a_variant_runs_its_mode_with_its_settings_beside_the_others(tmp_path):
    """--variant laps-ratio=laps:order=ratio,long_budget_tokens=512 runs in the same rounds as
    laps and mixed, with its own ratio and goals: its requests are exactly those of a run of laps
    with those settings (virtual time is exact), laps keeps its own, and validation replays the
    variant with its settings (every cell exact)."""
    from laps_jax.bench.variants import parse_variant
    from laps_jax.bench.validate import ValidationOptions, validate
    logs: list[str] = []
    out = simulated_compare(tmp_path / "ab", logs,
                             variants=(parse_variant(
                                 "laps-ratio=laps:order=ratio,long_budget_tokens=512"),))
    order = [line.split(":")[1].strip() for line in logs if line.startswith("round")]
    assert order == ["mixed", "laps", "laps-ratio", "laps-ratio", "laps", "mixed"]
    alone = simulated_compare(tmp_path / "ratio", order="ratio", long_budget_tokens=512)
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
    from laps_jax.bench.cells import over_rounds

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
    ("x=laps:finish_slack=-0.1", "finish_slack must be >= 0"),
])
def test_a_bad_variant_is_refused_with_what_is_wrong(text, match):
    from laps_jax.bench.variants import parse_variant
    with pytest.raises(ValueError, match=match):
        parse_variant(text)


def test_a_variant_turns_a_setting_off_or_moves_it():
    from laps_jax.bench.variants import parse_variant
    assert parse_variant("a=laps:overload_requests=off").settings == {"overload_requests": None}
    assert parse_variant("b=laps:overload_requests=8").settings == {"overload_requests": 8}
    assert parse_variant("c=laps:overload_check=off").settings == {"overload_check": False}
    assert parse_variant("d=laps:finish_slack=off").settings == {"finish_slack": None}
    assert parse_variant("e=laps:finish_slack=0.25").settings == {"finish_slack": 0.25}


def test_capacity_is_measured_over_several_bursts():
    """compare's capacity: one rate per burst (requests / seconds), every burst run."""
    from laps_jax.bench.compare import measure_capacity
    seconds = iter([4.0, 2.0, 5.0])
    calls = []

    def burst():
        calls.append(1)
        return [object()] * 24, None, next(seconds)
    assert measure_capacity(burst, 3) == [6.0, 12.0, 4.8]
    assert len(calls) == 3
    assert measure_capacity(lambda: ([1, 2], None, 1.0), 0) == [2.0]  # at least one burst
