"""The family screening's arithmetic on hand-made numbers: capacity by bisection, laps against
FCFS and against the better single-queue order per figure, the worst member."""

from __future__ import annotations

import pytest

from laps_jax.sim.screen import capacity_load, compare, worst


def test_capacity_is_where_fcfs_misses_half_its_slos():
    calls = []

    def violations(load):  # misses half at load 0.4
        calls.append(load)
        return min(1.0, 1.25 * load)
    assert capacity_load(violations, steps=12) == pytest.approx(0.4, rel=0.01)
    assert capacity_load(lambda load: 0.1, hi=3.0) == 3.0  # never saturates: the bracket's top


def fig(short, mean, slo, long, tok):
    return {"ttft_short_ms_p90": short, "prefill_latency_ms_mean": mean,
            "slo_violation_rate": slo, "ttft_long_ms_p90": long, "throughput_tokens_per_s": tok}


def test_laps_is_compared_with_the_better_single_queue_order_on_each_figure():
    c = compare({"fcfs": fig(100, 100, 0.4, 1000, 50), "hrrn": fig(40, 60, 0.2, 1300, 52),
                 "srpt": fig(30, 70, 0.3, 1200, 49), "laps": fig(12, 55, 0.1, 1100, 50)})
    assert c["vs_fcfs"]["ttft_short_ms_p90"] == pytest.approx(0.12)
    assert c["vs_fcfs"]["ttft_long_ms_p90"] == pytest.approx(1.1)
    # best per figure: short from srpt (30), SLO from hrrn (0.2), long from srpt (1200),
    # throughput from hrrn (52, higher is better)
    assert c["vs_best"]["ttft_short_ms_p90"] == pytest.approx(12 / 30)
    assert c["vs_best"]["slo_violation_rate"] == pytest.approx(0.5)
    assert c["vs_best"]["ttft_long_ms_p90"] == pytest.approx(1100 / 1200)
    assert c["vs_best"]["throughput_tokens_per_s"] == pytest.approx(50 / 52)
    assert c["met_fcfs"]  # 0.12, 0.55, 0.25, 1.1, 1.0: all within the goals
    assert not c["met_best"]  # 0.4, 0.5, 0.92 are, throughput 0.96 < 0.97 is not


def test_the_worst_member_is_the_highest_ratio_or_the_lowest_throughput():
    cells = [{"member": "a", "fraction": 0.7, "vs_fcfs": fig(0.2, 0.5, 0.3, 1.2, 1.0)},
             {"member": "b", "fraction": 0.7, "vs_fcfs": fig(0.4, 0.6, 0.1, 0.9, 0.9)}]
    w = worst(cells, "vs_fcfs")
    assert w["ttft_short_ms_p90"][:2] == (0.4, "b") and w["ttft_long_ms_p90"][:2] == (1.2, "a")
    assert w["throughput_tokens_per_s"][:2] == (0.9, "b")


def _simulate(*argv):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "scripts", "simulate.py"), *argv],
                          capture_output=True, text=True, timeout=600)


def test_the_screen_takes_the_studys_real_traces_and_draws_them(tmp_path):
    """`screen --members azure` (the study's Azure trace, not a family member) at one load:
    every single-queue order and laps run, tabled and drawn."""
    import json
    cap = tmp_path / "cap.json"
    cap.write_text(json.dumps({"capacity_load": {"azure": 0.6}}))
    out = _simulate("screen", "--members", "azure", "--fractions", "0.7", "--requests", "60",
                    "--capacity-from", str(cap), "--output-dir", str(tmp_path / "s"))
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "s" / "screen.json").read_text())
    assert sorted(r["policy"] for r in res["rows"]) == ["fcfs", "hrrn", "laps", "srpt"]
    assert all(r["workload"] == "azure" and r["load"] == pytest.approx(0.42)
               for r in res["rows"])
    assert "#### azure (FCFS capacity: load 0.600)" in (tmp_path / "s" / "screen.md").read_text()
    png = (tmp_path / "s" / "screen.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_screen_names_an_unknown_member(tmp_path):
    out = _simulate("screen", "--members", "azure,chat-lmsy", "--output-dir", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown --members chat-lmsy" in out.stderr and "chat-lmsys" in out.stderr


def test_the_route_screen_names_an_unknown_member_and_takes_all(tmp_path):
    """--members all is every family member; a misspelt one is a usage error, not a KeyError
    from inside the first simulation."""
    import os
    import runpy
    from laps_jax.workload.family import MEMBERS
    out = _simulate("route-screen", "--members", "chat-lmsys,rag-doc", "--output-dir",
                    str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown --members rag-doc" in out.stderr and "rag-docs" in out.stderr
    assert not (tmp_path / "rows.jsonl").exists()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parse = runpy.run_path(os.path.join(root, "scripts", "simulate.py"))["parse"]
    args = parse(["route-screen", "--members", "all", "--output-dir", str(tmp_path)])
    assert args.members == list(MEMBERS) and len(MEMBERS) >= 14
    assert parse(["route-screen", "--output-dir", str(tmp_path)]).members == [
        "chat-lmsys", "code-chat", "rag-docs", "agent-loop"]
