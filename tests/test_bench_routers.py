"""The live router benchmark's arithmetic (laps_jax/bench/routers.py) on synthetic records:
SLO violations (failures count), mean and short p90 TTFT, medians and ranges over rounds, the
median of per-round ratios; and the routers' command lines. No process starts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import load_script
from laps_jax.bench import router_procs as rp
from laps_jax.bench import routers as rb
from laps_jax.workload.http_client import RequestRecord, read_chunk, request_body
from laps_jax.workload.http_compare import mode_row
from laps_jax.workload.http_replay import ReplayResult, summarize_records


def _result(ttfts_ms, new_tokens, failed=0) -> ReplayResult:
    recs = []
    for k, (t, n) in enumerate(zip(ttfts_ms, new_tokens)):
        recs.append(RequestRecord(str(k), k * 0.1, 4, prompt_tokens=n, new_tokens=n,
                                  sent_s=k * 0.1, output_tokens=4, ttft_s=t / 1e3,
                                  e2e_s=t / 1e3 + 0.05, status=200, finish_reason="length",
                                  error=None))
    recs += [RequestRecord(f"f{k}", 9.0, 4, status=503, error="HTTP 503") for k in range(failed)]
    return ReplayResult({}, summarize_records(recs, short_threshold=256), recs)


def test_mode_row_counts_violations_and_failures():
    rng = random.Random(5)
    ttft = [rng.uniform(10, 3000) for _ in range(57)]
    new = [rng.choice([20, 100, 800, 1500]) for _ in ttft]
    row = mode_row(_result(ttft, new, failed=3), slo_ms=1000.0)
    assert row["slo_violation_rate"] == pytest.approx((sum(t > 1000 for t in ttft) + 3) / 60)
    assert row["prefill_latency_ms_mean"] == pytest.approx(np.mean(ttft))
    short = [t for t, n in zip(ttft, new) if n <= 256]
    assert row["ttft_short_ms_p90"] == pytest.approx(np.percentile(short, 90), abs=1e-3)
    assert (row["completed"], row["failed"]) == (57, 3)
    from laps_jax.bench.routers import failure_counts
    recs = _result(ttft[:4], new[:4], failed=3).requests
    recs[0].status, recs[0].error = 0, "timeout after 120 s"  # one more, another cause
    assert failure_counts(recs) == {"HTTP 503": 3, "timeout after 120 s": 1}


def test_each_request_has_its_own_slo_from_the_isolated_ttft():
    """The SLO is `scale` x the isolated TTFT at the request's own new tokens (linear between
    measured points, flat past them); the fixed target is reported beside it."""
    from laps_jax.bench.isolated import IsolatedTTFT, ladder
    iso = IsolatedTTFT((8, 64, 512, 2046), (20.0, 30.0, 200.0, 800.0))
    assert iso(1) == 20.0 and iso(9999) == 800.0
    assert iso(288) == pytest.approx(115.0)  # halfway from 64 to 512
    rng = random.Random(11)
    new = [rng.choice([5, 40, 300, 1200, 3000]) for _ in range(80)]
    ttft = [rng.uniform(0.5, 8.0) * iso(n) for n in new]
    row = rb.figures(_result(ttft, new, failed=2), 1000.0, lambda r: 5.0 * iso(r.new_tokens))
    assert row["slo_violation_rate"] == pytest.approx(
        (sum(t > 5.0 * iso(n) for t, n in zip(ttft, new)) + 2) / 82)
    assert row["fixed_slo_violation_rate"] == pytest.approx(
        (sum(t > 1000.0 for t in ttft) + 2) / 82)
    assert rb.figures(_result(ttft, new), 1000.0)["slo_violation_rate"] == pytest.approx(
        sum(t > 1000.0 for t in ttft) / 80)  # no isolated times: the fixed target
    steps = ladder(2046)
    assert steps[0] == 8 and steps[-1] == 2046 and steps == sorted(set(steps))


def _round(scale: dict[str, float], rng) -> dict[str, dict]:
    return {name: {"slo_violation_rate": 0.2 * s * rng.uniform(0.9, 1.1),
                   "prefill_latency_ms_mean": 500 * s, "ttft_ms_p90": 900 * s,
                   "ttft_short_ms_p90": 300 * s, "throughput_tokens_per_s": 1000 / s,
                   "completed": 60, "failed": 0} for name, s in scale.items()}


def test_summary_medians_ranges_and_median_of_ratios():
    rng = random.Random(1)
    scale = {"round-robin": 1.0, "laps": 0.7, "smg:cache_aware": 0.8}
    rounds = [_round(scale, rng) for _ in range(5)]
    del rounds[2]["laps"]  # a router missing in a round is skipped there, not zero
    s = rb.summarize(rounds)
    v = [r["laps"]["slo_violation_rate"] for r in rounds if "laps" in r]
    got = s["routers"]["laps"]["slo_violation_rate"]
    assert got == {"median": pytest.approx(np.median(v)), "min": min(v), "max": max(v)}
    want = np.median([r["laps"]["slo_violation_rate"] / r["round-robin"]["slo_violation_rate"]
                      for r in rounds if "laps" in r])
    assert s["ratios"]["round-robin"]["laps"]["slo_violation_rate"] == pytest.approx(want)
    assert s["ratios"]["smg:cache_aware"]["laps"]["ttft_ms_p90"] == pytest.approx(0.7 / 0.8)
    assert s["ratios"]["round-robin"]["round-robin"]["throughput_tokens_per_s"] == 1.0
    assert s["ratios"]["round-robin"]["laps"]["failed"] == 1.0  # 0 / 0: no difference
    table = rb.markdown(s)
    assert table.count("\n") == 2 + 3 and "| laps | " in table and "viol. / round-robin" in table
    only_ours = rb.summarize([{"laps": rounds[0]["laps"]}])
    assert only_ours["ratios"] == {}


def test_router_specs_commands_and_rotation():
    assert rp.RouterSpec.parse("laps") == rp.RouterSpec("laps", "laps")
    smg = rp.RouterSpec.parse("smg:cache_aware")
    assert (smg.name, smg.api) == ("smg:cache_aware", "sglang")
    cmd = smg.command(["http://a:1", "http://b:2"], 9000, 9001)
    assert cmd[1:6] == ["launch", "--worker-urls", "http://a:1", "http://b:2", "--policy"]
    assert "127.0.0.1" in cmd and "9001" in cmd  # its metrics port stays on loopback
    ours = rp.RouterSpec.parse("least-load").command(["http://a:1"], 9000, 9001)
    assert ours[-6:] == ["--instance", "http://a:1", "--policy", "least-load", "--port", "9000"]
    ablation = rp.RouterSpec.parse("laps-nodecode=laps --decode-step-tokens 0")
    assert (ablation.name, ablation.api) == ("laps-nodecode", "openai")
    assert ablation.command(["http://a:1"], 9000, 9001)[-4:] == [
        "--port", "9000", "--decode-step-tokens", "0"]
    for bad in ("nginx:x", "smg:", "", "laps --decode-step-tokens 0", "x=", "x=nginx:y"):
        with pytest.raises(ValueError):
            rp.RouterSpec.parse(bad)
    assert rb.rotated([1, 2, 3], 4) == [2, 3, 1] and rb.rotated([], 2) == []


def test_sglang_stream_chunks_read_as_new_tokens():
    path, body = request_body("sglang", "m", [5, 6], 3)
    assert path == "/generate" and body["sampling_params"]["max_new_tokens"] == 3
    usage = None
    seen: list[int] = []
    for out, fin in (([9], None), ([9, 8], None), ([9, 8, 7], {"type": "length"})):
        new, _, finish, usage = read_chunk("sglang", {"output_ids": out, "meta_info": {
            "finish_reason": fin, "completion_tokens": len(out), "cached_tokens": 16}},
            len(seen), usage)
        seen += new
    assert seen == [9, 8, 7] and finish == "length"
    assert usage == {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 16}}


def test_per_trace_time_scale_request_count_and_length_scale():
    """--time-scale-for / --max-requests-for / --length-scale-for set one trace kind's options
    and leave the others at the common flags; a malformed, out-of-range or unknown-kind value
    is a usage error."""
    script = load_script("bench_routers")
    args = script.parse_args(["--output-dir", "o", "--max-requests", "60", "--time-scale", "0.5",
                              "--length-scale", "0.25", "--max-requests-for", "azure=200",
                              "--time-scale-for", "mooncake=4",
                              "--length-scale-for", "mooncake=0.1"])
    azure, moon = (script.options_for(args, k, 1000) for k in ("azure", "mooncake"))
    assert (azure.max_requests, azure.time_scale, azure.length_scale) == (200, 0.5, 0.25)
    assert (moon.max_requests, moon.time_scale, moon.length_scale) == (60, 4.0, 0.1)
    for bad in (["--max-requests-for", "azure=x"], ["--max-requests-for", "azure=0"],
                ["--max-requests-for", "nosuch=5"], ["--time-scale-for", "azure"],
                ["--time-scale-for", "azure=-1"], ["--length-scale-for", "mooncake=0"],
                ["--length-scale-for", "mooncake=nan"], ["--length-scale-for", "x=0.1"]):
        with pytest.raises(SystemExit):
            script.parse_args(["--output-dir", "o", *bad])
