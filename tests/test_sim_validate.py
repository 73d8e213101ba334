"""The simulator checked against real runs: calibration per step kind, jitter, and validation
of a (simulated) compare_modes run."""

from __future__ import annotations

import pytest

from laps_jax.config import PRESETS
from laps_jax.scheduler.latency_model import LatencyModel
from sim_fixtures import replay, simulated_compare, spec, step


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
    from laps_jax.bench.lane_timings import step_jitter

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

    from laps_jax.bench.validate import ValidationOptions, same_speed, validate
    out = simulated_compare(tmp_path)
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
    # all requests queues, so it grows with the step time (by how much depends on which
    # steps the plans cut: 0.66x the step time's change for laps here, 2.4x for mixed; a
    # small pool's p50 may not move: windows and arrival gaps do not scale)
    first = validate(ValidationOptions(str(tmp_path), calibrate=True, round=1))
    sens = validate(ValidationOptions(str(tmp_path), calibrate=True, round=1, sensitivity=0.05))
    assert [r["sim_p50_ms"] for r in sens["rows"]] == [r["sim_p50_ms"] for r in first["rows"]]
    assert all(r["gain_p50"] is not None for r in sens["rows"] if r["n_real"] >= 5)
    assert all(r["gain_p90"] > 0.0 for r in sens["rows"] if r["pool"] == "all")
    # a run kept gzipped (how docs/data keeps runs) validates the same
    import gzip
    plain = tmp_path / "requests.jsonl"
    with gzip.open(f"{plain}.gz", "wt") as f:
        f.write(plain.read_text())
    plain.unlink()
    assert validate(ValidationOptions(str(tmp_path), calibrate=True, round=1))["rows"] == \
        first["rows"]


def test_cell_gain_is_the_relative_change_per_relative_step_change():
    from laps_jax.bench.cells import markdown, over_rounds
    from laps_jax.bench.validate import cell_gains
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

    from laps_jax.bench.validate import ValidationOptions, validate
    out = simulated_compare(tmp_path / "run")
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
