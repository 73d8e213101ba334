"""HTTP replay (laps_jax.workload.http_replay, scripts/bench_serving.py) against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import ROOT, ServerProcess

from laps_jax.workload.generator import SessionGenConfig, generate_sessions
from laps_jax.workload.http_client import ReplayConfig, RequestRecord
from laps_jax.workload.http_replay import format_summary, replay, summarize_records
from laps_jax.workload.load import load
from laps_jax.workload.records import Trace, TraceOptions, TraceRequest
from laps_jax.workload.sessions import write_sessions_jsonl

REPO = Path(__file__).resolve().parents[1]
QUIET = ReplayConfig(progress=False, keep_token_ids=True, timeout_s=120, deadline_s=120)
SUMMARY_KEYS = {"count", "completed", "failed", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
                "e2e_ms_p50", "e2e_ms_p90", "prompt_tokens_per_s", "output_tokens_per_s",
                "throughput_tokens_per_s", "cached_fraction", "ttft_short_ms_p90",
                "ttft_long_ms_p90"}


def _azure_trace() -> Path:
    for d in (REPO.parent / "shared" / "traces", Path("/work/shared/traces")):
        if (d / "azure_llm_2023_conv.csv").is_file():
            return d / "azure_llm_2023_conv.csv"
    pytest.skip("azure_llm_2023_conv.csv not found in ../shared/traces or /work/shared/traces")


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = ServerProcess(checkpoint("gqa2_untied"))
    yield srv
    srv.stop()


async def test_sessions_extend_previous_turn_and_hit_prefix_cache(server, tmp_path):
    cfg = SessionGenConfig(rate=50.0, mean_turns=2.5, max_turns=3, length_scale=0.1)
    path = tmp_path / "sessions.jsonl"
    write_sessions_jsonl(generate_sessions(6, cfg, seed=1), path)
    work = load("sessions", path, TraceOptions(time_scale=0.02, vocab_size=1000, max_len=400))
    assert all(t.new_input_tokens <= 200 for s in work.sessions for t in s.turns)
    result = await replay(server.url, work, QUIET)
    recs = result.requests
    assert len(recs) == work.num_requests and all(r.ok for r in recs), \
        [r.error for r in recs if not r.ok]
    by_id = {r.request_id: r for r in recs}
    later = [r for r in recs if r.turn > 0]
    assert len(later) >= 3
    for r in recs:
        assert 0 < r.ttft_s <= r.e2e_s and r.prompt_tokens == len(r.prompt_ids)
        assert r.output_tokens == len(r.answer_ids) <= r.max_tokens
    for r in later:
        prev = by_id[f"{r.session_id}/{r.turn - 1}"]
        history = prev.prompt_ids + prev.answer_ids
        assert r.prompt_ids[:len(history)] == history
        assert r.new_tokens == r.prompt_tokens - len(history) > 0
        assert r.sent_s >= prev.sent_s + prev.e2e_s  # closed loop: after the answer
        if len(history) >= 16:  # two 8-token pages: at least one full page is reusable
            assert r.cached_tokens > 0, (r.request_id, len(history))
    assert result.summary["cached_fraction"] > 0
    assert result.summary["completed"] == len(recs) and result.summary["failed"] == 0


async def test_azure_trace_open_loop(server):
    opts = TraceOptions(max_requests=12, length_scale=0.05, time_scale=0.002, vocab_size=1000,
                        max_len=400)
    work = load("azure", _azure_trace(), opts)
    result = await replay(server.url, work, QUIET)
    assert [r.status for r in result.requests] == [200] * 12
    for req, r in zip(work, result.requests):
        assert r.ok and r.prompt_tokens == req.input_len == r.new_tokens
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert 1 <= r.output_tokens <= req.output_len
    s = result.summary
    assert s["completed"] == 12 and s["failed"] == 0 and SUMMARY_KEYS <= s.keys()
    assert s["ttft_ms_p50"] <= s["ttft_ms_p90"] <= s["ttft_ms_p99"]
    assert s["short_count"] + s["long_count"] == 12
    json.dumps(result.to_json(), allow_nan=False)


async def test_failures_are_recorded_not_raised(server):
    bad = TraceOptions(vocab_size=5000, token_low=1100).token_space  # ids beyond the model's
    reqs = [TraceRequest("bad", 0.0, 8, 4, token_space=bad),
            TraceRequest("good", 0.0, 8, 4, token_space=TraceOptions(vocab_size=1000).token_space),
            TraceRequest("late", 60.0, 8, 4)]
    cfg = ReplayConfig(progress=False, timeout_s=60, deadline_s=3)
    result = await replay(server.url, Trace("mixed", reqs), cfg)
    bad_r, good_r, late_r = result.requests
    assert bad_r.status == 400 and "HTTP 400" in bad_r.error and not bad_r.ok
    assert good_r.ok
    assert late_r.status is None and "deadline" in late_r.error and late_r.sent_s is None
    assert result.config["deadline_reached"]
    s = result.summary
    assert (s["count"], s["completed"], s["failed"], s["not_sent"]) == (3, 1, 2, 1)
    slow = await replay(server.url, Trace("t", reqs[1:2]),
                        ReplayConfig(progress=False, timeout_s=1e-3))
    assert not slow.requests[0].ok and "timeout" in slow.requests[0].error


def test_summary_table_without_server():
    recs = [RequestRecord(f"r{i}", 0.0, 4, prompt_tokens=100 * i + 10, new_tokens=100 * i + 10,
                          sent_s=0.0, output_tokens=4, ttft_s=0.01 * (i + 1), e2e_s=0.1,
                          itl_s_mean=0.02, cached_tokens=5, status=200, error=None)
            for i in range(5)]
    recs.append(RequestRecord("x", 0.0, 4, sent_s=0.0, e2e_s=0.01, status=503, error="HTTP 503"))
    s = summarize_records(recs, short_threshold=256)
    assert (s["count"], s["completed"], s["failed"]) == (6, 5, 1)
    assert (s["short_count"], s["long_count"]) == (3, 2)
    assert s["ttft_long_ms_p90"] > s["ttft_short_ms_p90"]
    assert s["cached_fraction"] == pytest.approx(25 / 1050, abs=1e-4)
    table = format_summary(s)
    assert "TTFT p90 short <= 256" in table and "6 (5 / 1)" in table
    empty = summarize_records([])
    assert empty["ttft_ms_p50"] is None and "-" in format_summary(empty)


def test_cli_end_to_end(server, tmp_path):
    script = str(REPO / "scripts" / "bench_serving.py")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    h = subprocess.run([sys.executable, script, "--help"], check=False, capture_output=True,
                       text=True, env=env, timeout=60)
    assert h.returncode == 0 and "--trace-format" in h.stdout and "--vocab-size" in h.stdout
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, script, "--base-url", server.url, "--trace",
                        str(_azure_trace()), "--trace-format", "azure", "--max-requests", "5",
                        "--length-scale", "0.05", "--time-scale", "0.002", "--vocab-size", "1000",
                        "--concurrency-limit", "4", "--timeout", "60", "--no-progress",
                        "--output", str(out)], check=False, capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "TTFT p50 / p90 / p99" in r.stdout
    data = json.loads(out.read_text())
    assert set(data) == {"config", "summary", "requests"}
    assert SUMMARY_KEYS <= data["summary"].keys() and data["summary"]["completed"] == 5
    assert data["config"]["max_len"] == 512  # taken from the server's max_model_len
    assert len(data["requests"]) == 5 and "api_key" not in data["config"]
    bad = subprocess.run([sys.executable, script, "--base-url", "http://127.0.0.1:9",
                          "--trace", str(_azure_trace()), "--output", str(tmp_path / "x.json")],
                         check=False, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "error" in bad.stderr
    failing = subprocess.run([sys.executable, script, "--base-url", server.url, "--trace",
                              str(_azure_trace()), "--max-requests", "2", "--vocab-size", "5000",
                              "--length-scale", "0.05", "--time-scale", "0", "--no-progress",
                              "--output", str(tmp_path / "f.json")],
                             check=False, capture_output=True, text=True, env=env, timeout=60)
    assert failing.returncode == 1, failing.stderr
    assert json.loads((tmp_path / "f.json").read_text())["summary"]["failed"] == 2


@pytest.mark.parametrize("flags, bad", [
    (["--variant", "laps-ratio=laps:order=ratio"], "--variant"),
    (["--max-wait", "1.5"], "--max-wait"),
    (["--window", "off"], "--window"),
    (["--busy-reruns", "0"], "--busy-reruns"),
])
def test_compare_modes_over_http_refuses_what_serve_py_cannot_take(flags, bad, tmp_path):
    """Settings that only steer the in-process dispatcher are refused with --http (serve.py
    would silently run without them), before any server starts."""
    import subprocess
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "compare_modes.py"), "--http",
         "--trace", "unused.csv", "--trace-format", "azure", "--output-dir", str(tmp_path),
         *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad} cannot be combined with --http" in proc.stderr


def test_compare_modes_over_http(checkpoint, tmp_path):
    """compare_modes.py --http: a real server per mode, the Azure trace replayed over loopback."""
    import subprocess
    out = tmp_path / "cmp"
    trace = next(p for p in (os.path.join(ROOT, "..", "shared", "traces"), "/work/shared/traces")
                 if os.path.isdir(p))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "compare_modes.py"), "--http",
         "--model", checkpoint("gqa2_untied"), "--trace",
         os.path.join(trace, "azure_llm_2023_conv.csv"), "--trace-format", "azure",
         "--max-requests", "6", "--length-scale", "0.05", "--time-scale", "0.005",
         "--max-chunk", "64", "--max-prefill-batch", "4", "--max-decode-batch", "8",
         "--max-model-len", "512", "--kv-cache-tokens", "8192", "--page-size", "8",
         "--output-dir", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "comparison.json").read_text())
    for mode in ("mixed", "laps", "laps-spatial"):
        assert res[mode]["completed"] == 6 and res[mode]["failed"] == 0
        assert 0 < res[mode]["ttft_ms_p50"] <= res[mode]["ttft_ms_p90"]
    assert res["ratio"]["completed"] == 1.0
