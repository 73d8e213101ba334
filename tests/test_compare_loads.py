"""compare_modes at several loads (capacity measured once) and the regime line it prints."""

from __future__ import annotations

import dataclasses

import pytest

from laps_jax.bench.loads import describe, loads_markdown, regime, run_loads


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
