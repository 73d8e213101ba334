"""compare_family.py: the live family check read back per member, on hand-made rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laps_jax.bench.family_live import member_cell, read_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def figs(short, mean, slo, long, tok):
    return {"ttft_short_ms_p90": short, "prefill_latency_ms_mean": mean,
            "slo_violation_rate": slo, "ttft_long_ms_p90": long, "throughput_tokens_per_s": tok}


def run(rounds: list[dict], load=0.7, cap=10.0) -> dict:
    return {"run": {"load": load, "mixed_capacity_rps": cap}, "rounds": rounds}


ROUNDS = [  # mixed, hrrn, srpt, laps, a candidate
    {"mixed": figs(100, 50, 0.20, 300, 100), "hrrn": figs(80, 45, 0.10, 320, 101),
     "srpt": figs(60, 48, 0.16, 400, 99), "laps": figs(30, 40, 0.02, 330, 98),
     "cand": figs(50, 30, 0.05, 300, 100)},
    {"mixed": figs(120, 55, 0.30, 300, 100), "hrrn": figs(90, 50, 0.20, 300, 100),
     "srpt": figs(100, 52, 0.24, 350, 100), "laps": figs(60, 44, 0.06, 360, 100),
     "cand": figs(50, 30, 0.05, 300, 100)},
    {"mixed": figs(100, 50, 0.10, 200, 100), "hrrn": figs(50, 40, 0.05, 250, 100),
     "srpt": figs(40, 42, 0.08, 220, 100), "laps": figs(20, 35, 0.01, 250, 97),
     "cand": figs(50, 30, 0.05, 300, 100)},
]


def test_a_members_ratio_is_the_median_of_its_rounds_against_the_better_single_queue():
    cell, rows = member_cell("m", run(ROUNDS))
    # laps/fcfs short p90 per round 0.3, 0.5, 0.2 -> 0.3; SLO 0.1, 0.2, 0.1 -> 0.1
    assert cell["vs_fcfs"]["ttft_short_ms_p90"] == pytest.approx(0.3)
    assert cell["vs_fcfs"]["slo_violation_rate"] == pytest.approx(0.1)
    # against the better of hrrn and srpt per round: short 30/60, 60/90, 20/40 -> 0.5;
    # SLO 0.02/0.10, 0.06/0.20, 0.01/0.05 -> 0.2; long 330/320, 360/300, 250/220 -> 1.136
    assert cell["vs_best"]["ttft_short_ms_p90"] == pytest.approx(0.5)
    assert cell["vs_best"]["slo_violation_rate"] == pytest.approx(0.2)
    assert cell["vs_best"]["ttft_long_ms_p90"] == pytest.approx(250 / 220)
    assert not cell["met_fcfs"]  # mean prefill 0.8 > 0.7 in the median round
    by = {r["policy"]: r for r in rows}
    assert by["fcfs"]["slo_violation_rate"] == pytest.approx(0.2)  # median of 0.2, 0.3, 0.1


def test_a_candidate_variant_is_judged_in_lapss_place_and_a_missing_order_is_named():
    cell, _ = member_cell("m", run(ROUNDS), laps="cand")
    assert cell["vs_fcfs"]["prefill_latency_ms_mean"] == pytest.approx(30 / 50)
    bare = [{k: v for k, v in r.items() if k != "srpt"} for r in ROUNDS]
    with pytest.raises(ValueError, match="m: the run has no srpt"):
        member_cell("m", run(bare))


def test_the_script_tables_every_member_and_load(tmp_path):
    for member, sub in (("a", "load_0.70"), ("a", "load_0.90"), ("b", "")):
        d = tmp_path / member / sub
        d.mkdir(parents=True, exist_ok=True)
        (d / "comparison.json").write_text(json.dumps(
            run(ROUNDS, load=0.9 if "0.90" in sub else 0.7)))
    res = read_runs([str(tmp_path)])
    assert sorted((c["member"], c["fraction"]) for c in res["cells"]) == [
        ("a", 0.7), ("a", 0.9), ("b", 0.7)]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_family.py"),
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "#### a (mixed capacity 10.00 requests/s)" in out.stdout
    assert "worst member at load 0.9, laps/fcfs" in out.stdout
    assert "worst member over every run, laps/best of hrrn, srpt" in out.stdout
    # a run without the judged variant is skipped and named; none with it is an error
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_family.py"),
                          str(tmp_path), "--laps", "cand"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "skipped" not in out.stdout
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "comparison.json").write_text(json.dumps(
        run([{k: v for k, v in r.items() if k != "cand"} for r in ROUNDS])))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_family.py"),
                          str(tmp_path), "--laps", "cand"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "skipped: c: the run has no cand" in out.stdout
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_family.py"),
                          str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no MEMBER/comparison.json" in bad.stderr
    only_c = tmp_path / "only"
    (only_c / "c").mkdir(parents=True)
    (only_c / "c" / "comparison.json").write_text((tmp_path / "c" / "comparison.json").read_text())
    with pytest.raises(ValueError, match="no run holds every mode needed"):
        read_runs([str(only_c)], laps="cand")


def test_a_target_violation_runs_capacity_comes_from_its_first_probe(tmp_path):
    """A --target-violation run replays at the time scale its probes found, so its own run
    records no capacity: the member's heading takes the first probe's."""
    d = tmp_path / "t"
    (d / "target_probes" / "load_0.70").mkdir(parents=True)
    main = run(ROUNDS)
    main["run"]["mixed_capacity_rps"] = None
    (d / "comparison.json").write_text(json.dumps(main))
    (d / "target_probes" / "load_0.70" / "comparison.json").write_text(json.dumps(
        run([{"mixed": ROUNDS[0]["mixed"]}], cap=5.0)))
    res = read_runs([str(tmp_path)])
    assert res["capacity_load"] == {"t": 5.0}
    assert [c["member"] for c in res["cells"]] == ["t"]  # the probe is no member of its own
