"""The live router benchmark's arithmetic (laps_jax/bench/routers.py) on synthetic records:
SLO violations (failures count), mean and short p90 TTFT, medians and ranges over rounds, the
median of per-round ratios; and the routers' command lines. No process starts."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import load_script
from laps_jax.bench import router_procs as rp
from laps_jax.bench import bands as bb
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
    assert row["slo_violations"] == sum(t > 5.0 * iso(n) for t, n in zip(ttft, new)) + 2
    assert rb.figures(_result(ttft, new), 1000.0)["slo_violation_rate"] == pytest.approx(
        sum(t > 1000.0 for t in ttft) / 80)  # no isolated times: the fixed target
    steps = ladder(2046)
    assert steps[0] == 8 and steps[-1] == 2046 and steps == sorted(set(steps))


def test_violations_are_counted_by_new_token_band_and_pooled_over_rounds():
    """Each replay counts its violations in new-token bands (1-64, 65-256, 257-1024, over
    1024: edges inclusive), with the median TTFT / target; the summary sums the counts over
    rounds and the table shows them."""
    assert [bb.band_of(n) for n in (1, 64, 65, 256, 257, 1024, 1025)] == [
        "1-64", "1-64", "65-256", "65-256", "257-1024", "257-1024", "over 1024"]
    target = lambda r: 40.0 + 0.5 * r.new_tokens  # noqa: E731
    ranges = {"1-64": (1, 64), "65-256": (65, 256), "257-1024": (257, 1024),
              "over 1024": (1025, 10**9)}
    rounds, want = [], {b: [0, 0] for b in ranges}
    for seed in range(3):
        rng = random.Random(100 + seed)
        new = [rng.choice([3, 64, 65, 200, 256, 257, 900, 1024, 1025, 1900]) for _ in range(70)]
        ttft = [rng.uniform(0.3, 2.5) * (40.0 + 0.5 * n) for n in new]
        row = rb.figures(_result(ttft, new, failed=1), 1000.0, target)
        for b, (lo, hi) in ranges.items():
            mine = [(t, n) for t, n in zip(ttft, new) if lo <= n <= hi]
            fails = 1 if b == "1-64" else 0  # a failure (no new tokens known) in the first
            over = sorted([t / (40.0 + 0.5 * n) for t, n in mine] + [float("inf")] * fails)
            got = row["bands"][b]
            assert got["requests"] == len(mine) + fails
            assert got["violations"] == sum(t > 40.0 + 0.5 * n for t, n in mine) + fails
            assert got["ttft_over_target_p50"] == pytest.approx(np.median(over))
            want[b][0] += got["violations"]
            want[b][1] += got["requests"]
        assert sum(b["violations"] for b in row["bands"].values()) == row["slo_violations"]
        rounds.append({"laps": row})
    rounds.append({"laps": {**rounds[0]["laps"], "bands": {}}})  # a round without bands
    s = rb.summarize(rounds)
    for b, (v, n) in want.items():
        assert (s["bands"]["laps"][b]["violations"], s["bands"]["laps"][b]["requests"]) == (v, n)
    table = bb.band_markdown(s)
    assert table.count("\n| laps |") == 1 and "over 1024 new tokens" in table
    assert f"| {want['1-64'][0]} / {want['1-64'][1]} (" in table
    assert bb.band_markdown(rb.summarize([{"laps": {"completed": 1, "failed": 0,
                                                    "slo_violations": 0}}])) == ""
    alone = rb.figures(_result([5000.0], [10], failed=2), 1000.0, target)["bands"]["1-64"]
    assert alone == {"requests": 3, "violations": 3, "ttft_over_target_p50": None}


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
    # a round's own count wins over its rate x requests (7.5 would round to 8)
    rounds[0]["laps"].update(slo_violation_rate=7.5 / 60, slo_violations=7)
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
    want_v = 7 + sum(round(r["laps"]["slo_violation_rate"] * 60) for r in rounds[1:]
                     if "laps" in r)
    assert s["pooled"]["laps"] == {"violations": want_v, "requests": 240, "rate": want_v / 240}
    table = rb.markdown(s)
    assert table.count("\n") == 2 + 3 and "| laps | " in table and "viol. / round-robin" in table
    rr = s["pooled"]["round-robin"]
    assert f"| laps | {s['routers']['laps']['slo_violation_rate']['median']:.1%}" in table
    assert f"| {want_v} / 240 |" in table
    assert f"| {(want_v / 240) / rr['rate']:.2f} |" in table  # pooled / round-robin
    only_ours = rb.summarize([{"laps": rounds[0]["laps"]}])
    assert only_ours["ratios"] == {}


def test_router_specs_and_their_commands():
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


def test_results_are_written_after_each_round_and_say_whether_the_run_ended(tmp_path):
    """A run stopped early keeps routers.json/.md of the rounds it finished (marked incomplete);
    a trace with no finished round yet is left out rather than summarised as empty."""
    import json

    from laps_jax.bench.isolated import IsolatedTTFT
    script = load_script("bench_routers")
    args = script.parse_args(["--output-dir", str(tmp_path), "--routers", "round-robin,laps"])
    rng = random.Random(2)
    rounds = {"azure": [_round({"round-robin": 1.0, "laps": 0.6}, rng)], "mooncake": []}
    iso = IsolatedTTFT((8, 256), (10.0, 40.0))
    per = {"azure": 1, "mooncake": 1}
    text = script.write_results(args, iso, rounds, per, complete=False)
    out = json.loads((tmp_path / "routers.json").read_text())
    assert out["complete"] is False and list(out["traces"]) == ["azure"]
    assert out["isolated_ttft"] == {"tokens": [8, 256], "ms": [10.0, 40.0]}
    want = rounds["azure"][0]["laps"]["slo_violation_rate"]
    got = out["traces"]["azure"]["summary"]["routers"]["laps"]["slo_violation_rate"]["median"]
    assert got == pytest.approx(want)
    assert (tmp_path / "routers.md").read_text() == text and "### azure" in text
    rounds["azure"].append(_round({"round-robin": 1.0, "laps": 0.6}, rng))
    rounds["mooncake"].append(_round({"round-robin": 1.0, "laps": 0.9}, rng))
    script.write_results(args, iso, rounds, per, complete=True)
    out = json.loads((tmp_path / "routers.json").read_text())
    assert out["complete"] is True and len(out["traces"]["azure"]["rounds"]) == 2
    assert out["blocks_per_round"] == {"azure": 1, "mooncake": 1}
    assert list(out["traces"]) == ["azure", "mooncake"]
    assert "new tokens" not in (tmp_path / "routers.md").read_text()  # no bands counted
    rounds["mooncake"][0]["laps"]["bands"] = {"65-256": {"requests": 9, "violations": 4,
                                                         "ttft_over_target_p50": 0.8}}
    text = script.write_results(args, iso, rounds, per, complete=True)
    azure, mooncake = text.split("### mooncake")  # the band table under its own trace only
    assert "| laps | 4 / 9 (0.80) |" in mooncake and "new tokens" not in azure


def test_sigterm_runs_every_finally_so_no_instance_is_left_running(tmp_path):
    """bench_routers stops its instances in `finally` blocks; SIGTERM (what stops a run started
    in a shell's background, where SIGINT is ignored) must reach them, even from inside the
    replay's event loop, instead of killing the process and orphaning its serve.py children."""
    import os
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "stopped"
    code = f"""
import asyncio, sys
from laps_jax.bench import router_procs as rp
rp.exit_on_sigterm()
async def replay():
    print("ready", flush=True)
    await asyncio.sleep(60)
try:
    asyncio.run(replay())
finally:
    open({str(marker)!r}, "w").write("instances stopped")
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 128 + signal.SIGTERM
    finally:
        p.kill()
    assert marker.read_text() == "instances stopped"


def test_loop_stalls_are_read_from_each_process_metrics():
    """The replay's stall count sums `laps_event_loop_stalls_total` over the processes; one
    that does not export it (smg) or does not answer makes the count unknown, not zero."""
    import http.server
    import threading

    pages = {"/a/metrics": "# TYPE laps_event_loop_stalls counter\n"
                           "laps_event_loop_stalls_total 2.0\nlaps_event_loop_stalls_created 1.7e9\n",
             "/b/metrics": "laps_event_loop_stalls_total 1.0\n",
             "/smg/metrics": "smg_requests_total 5.0\n", "/bad/metrics": "{not metrics}\n"}

    class Pages(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *_):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert rb.loop_stalls([base + "/a", base + "/b"]) == 3.0
        assert rb.loop_stalls([base + "/a", base + "/smg"]) is None
        assert rb.loop_stalls([base + "/a", base + "/gone"]) is None
        assert rb.loop_stalls([base + "/bad"]) is None
    finally:
        srv.shutdown()


def test_router_hop_flags():
    """bench_router_hop.py's defaults and its refusal of counts it cannot run."""
    hop = load_script("bench_router_hop")
    a = hop.parse_args([])
    assert (a.requests, a.prompt_tokens, a.model, a.instant) == (60, [8], "bench-cpu", False)
    assert hop.parse_args(["--prompt-tokens", "100,2000", "--instant"]).prompt_tokens == \
        [100, 2000]
    specs = [rp.RouterSpec.parse(s) for s in a.routers.split(",")]
    assert [s.name for s in specs] == ["laps", "round-robin", "smg:round_robin"]
    for bad in (["--requests", "0"], ["--prompt-tokens", "0"], ["--prompt-tokens", "8,0"],
                ["--prompt-tokens", "8,x"], ["--prompt-tokens", ","]):
        with pytest.raises(SystemExit):
            hop.parse_args(bad)


def test_the_instant_instance_answers_through_the_router_as_serve_py_does():
    """bench_router_hop.py --instant's instance: the router polls it healthy with its
    reported threshold (one read of /load), relays its stream (token-id lines dropped) and
    the replay client reads it as it reads serve.py's, through the router and on /generate."""
    import asyncio
    import threading

    import aiohttp
    from aiohttp import web

    from laps_jax.bench import instant_instance
    from laps_jax.workload.http_client import ReplayConfig, stream_completion
    from router_utils import RouterThread, sse

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(instant_instance.make_app(), access_log=None)
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"
    url = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    router = RouterThread([url])
    try:
        status = router.wait(lambda s: s["healthy"] == 1, what="the instance healthy")
        assert status["threshold"] == 256 and status["instances"][0]["long_chunk"] == 256
        events = sse(router.url, "/v1/completions", {"model": instant_instance.MODEL,
                                                     "prompt": [5] * 40, "max_tokens": 3,
                                                     "stream": True})
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "a", "a"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1] == "[DONE]"

        async def replay(base: str, api: str) -> RequestRecord:
            rec = RequestRecord(request_id="r", arrival_s=0.0, max_tokens=4)
            async with aiohttp.ClientSession() as http:
                ids = await stream_completion(http, base, instant_instance.MODEL, [9] * 3000,
                                              rec, ReplayConfig(api=api, progress=False), 0.0)
            assert ids == [instant_instance.TOKEN_ID] * 4, rec.error
            return rec
        for base, api in ((router.url, "openai"), (url, "sglang")):
            rec = asyncio.run(replay(base, api))
            assert rec.error is None and rec.output_tokens == 4 and rec.ttft_s > 0
    finally:
        router.close()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_band_recount_of_a_run_reads_its_records_and_targets(tmp_path, capsys):
    """bench_router_bands.py recounts a run from routers.json's isolated TTFT and SLO scale
    and the request records beside it: the counts a test makes by hand from the same data."""
    import json
    bands = load_script("bench_router_bands")
    iso = {"tokens": [8, 512, 2046], "ms": [10.0, 100.0, 400.0]}
    replays = {"laps": {}, "smg:cache_aware": {}}  # each round's routers, as bench_routers
    (tmp_path / "routers.json").write_text(json.dumps({  # writes them
        "args": {"slo_scale": 3.0}, "routers": ["laps", "smg:cache_aware"],
        "isolated_ttft": iso, "traces": {"azure": {"rounds": [replays, replays]}}}))
    logs = tmp_path / "bench_routers_x"
    logs.mkdir()
    rng = random.Random(7)
    target = lambda n: 3.0 * (10.0 + 90.0 * (max(n, 8) - 8) / 504 if n <= 512  # noqa: E731
                              else 100.0 + 300.0 * (min(n, 2046) - 512) / 1534)
    want = {}
    for name, file in (("laps", "laps"), ("smg:cache_aware", "smg_cache_aware")):
        for rnd in (1, 2):
            recs = []
            for k in range(40):
                n = rng.choice([5, 60, 100, 700, 1500])
                ttft = rng.uniform(0.2, 2.0) * target(n) / 1000
                recs.append({"request_id": f"r{k}", "new_tokens": n, "status": 200,
                             "ttft_s": ttft})
                w = want.setdefault((name, bb.band_of(n)), [0, 0])
                w[0] += ttft * 1000 > target(n)
                w[1] += 1
            lines = [json.dumps({"router_status": {"policy": name}})] + [json.dumps(r)
                                                                         for r in recs]
            (logs / f"requests_azure_r{rnd}_{file}.jsonl").write_text("\n".join(lines) + "\n")
    got = bands.recount(str(tmp_path))["azure"]["bands"]
    assert {(name, b): [x["violations"], x["requests"]] for name, per in got.items()
            for b, x in per.items()} == want
    assert bands.main([str(tmp_path)]) == 0
    assert "| smg:cache_aware |" in capsys.readouterr().out
    (tmp_path / "routers.json").write_text(json.dumps({
        "args": {"slo_scale": 0.0}, "routers": ["laps"], "isolated_ttft": None}))
    with pytest.raises(SystemExit, match="no isolated TTFT"):
        bands.recount(str(tmp_path))


def _run_json(path, rounds, time_scale_for=None, trace_file="azure.csv", **more):
    path.mkdir()
    (path / "routers.json").write_text(json.dumps({
        "args": {"trace": [["azure", trace_file]], "max_requests": 600, "length_scale": 0.25,
                 "time_scale": 1.1, **more,
                 "time_scale_for": time_scale_for or {}, "serve_args": "--max-chunk 256",
                 "slo_scale": 5.0, "seed": 0},
        "traces": {"azure": {"rounds": [
            {name: {"slo_violations": v} for name, v in row.items()} for row in rounds]}}}))


def test_router_pairs_of_a_block_run_resample_whole_rounds_too(tmp_path, capsys):
    """The blocks of one round share the machine's spell: pairs know their round and block
    (from routers.json's blocks_per_round, or a finished old block run's pairs over rounds),
    and the second interval resamples rounds whole. With one round all in laps' favour and the
    other all against, that interval reaches each round's own pooled ratio (a draw of one round
    twice is likelier than 5%); the per-block one cannot (six blocks from one round: 1/64)."""
    from laps_jax.bench import pairs as bp
    rng = random.Random(11)
    rows, by_round = [], [[0, 0], [0, 0]]
    for r, (lo, hi) in enumerate(((0.4, 0.6), (1.4, 1.8))):
        for _ in range(3):
            b = rng.randint(40, 90)
            a = round(b * rng.uniform(lo, hi))
            rows.append({"laps": {"slo_violations": a}, "round-robin": {"slo_violations": b}})
            by_round[r][0] += a
            by_round[r][1] += b
    for name, extra in (("new", {"blocks_per_round": {"azure": 3}}),
                        ("old", {"complete": True})):  # before the entry: 6 pairs / 2 rounds
        (tmp_path / name).mkdir()
        (tmp_path / name / "routers.json").write_text(json.dumps({
            "args": {"block": 100, "rounds": 2}, **extra,
            "traces": {"azure": {"rounds": rows}}}))
        ps = bp.pairs({name: rb.read_run(str(tmp_path / name))}, "azure", "laps", "round-robin")
        assert [(p.round_no, p.block_no) for p in ps] == [(1, 1), (1, 2), (1, 3),
                                                           (2, 1), (2, 2), (2, 3)]
        s = bp.summary(ps, draws=4000)
        assert s["whole_rounds"] == 2 and s["rounds"] == 6
        first, second = (a / b for a, b in by_round)
        assert s["interval90_rounds"] == pytest.approx((first, second))
        lo, hi = s["interval90"]
        assert first < lo < s["pooled"] < hi < second
    script = load_script("bench_router_pairs")
    assert script.main([str(tmp_path / "new"), "--trace", "azure", "--against",
                        "round-robin"]) == 0
    out = capsys.readouterr().out
    assert "| new | 2.3 |" in out and "6 blocks" in out
    assert f"resampling the 2 rounds whole (their blocks share the machine's spell): " \
           f"[{first:.2f}, {second:.2f}]" in out
    (tmp_path / "stopped").mkdir()  # an old block run stopped early: blocks count as rounds
    (tmp_path / "stopped" / "routers.json").write_text(json.dumps({
        "args": {"block": 100, "rounds": 2}, "complete": False,
        "traces": {"azure": {"rounds": rows[:4]}}}))
    ps = bp.pairs({"s": rb.read_run(str(tmp_path / "stopped"))}, "azure", "laps", "round-robin")
    assert [p.round_no for p in ps] == [1, 2, 3, 4] and not any(p.block_no for p in ps)


def test_router_pairs_pool_the_rounds_of_runs_with_the_same_settings(tmp_path, capsys):
    """bench_router_pairs.py pairs two routers' violations round by round across runs; its
    median, geometric mean, pooled ratio and win count match counts made here; the bootstrap
    interval holds the pooled ratio; runs of another load are refused, naming the setting."""
    from laps_jax.bench import pairs as bp
    rng = random.Random(3)
    runs, want = [], []
    for r in range(2):
        rows = []
        for _ in range(rng.randint(2, 4)):
            a, b = rng.randint(20, 300), rng.randint(20, 300)
            rows.append({"laps": a, "smg:cache_aware": b, "round-robin": rng.randint(1, 9)})
            want.append((a, b))
        rows.append({"laps": 5})  # a round the reference did not run: not a pair
        _run_json(tmp_path / f"run{r}", rows)
        runs.append(str(tmp_path / f"run{r}"))
    ps = bp.pairs({d: rb.read_run(d) for d in runs}, "azure", "laps", "smg:cache_aware")
    assert [(p.router, p.reference) for p in ps] == want
    s = bp.summary(ps, draws=2000)
    ratios = sorted(a / b for a, b in want)
    n = len(ratios)
    med = (ratios[n // 2] + ratios[(n - 1) // 2]) / 2
    assert s["median"] == pytest.approx(med)
    assert s["geomean"] == pytest.approx(float(np.exp(np.mean(np.log(ratios)))))
    pooled = sum(a for a, _ in want) / sum(b for _, b in want)
    assert s["pooled"] == pytest.approx(pooled)
    assert s["won"] == sum(a < b for a, b in want) and s["lost"] == sum(a > b for a, b in want)
    lo, hi = s["interval90"]
    assert lo <= pooled <= hi and lo < hi
    script = load_script("bench_router_pairs")
    assert script.main(runs + ["--trace", "azure", "--draws", "500"]) == 0
    out = capsys.readouterr().out
    assert f"pooled {sum(a for a, _ in want)} / {sum(b for _, b in want)}" in out
    assert len([l for l in out.splitlines() if l.startswith(("| run0 |", "| run1 |"))]) \
        == len(want)  # one row per pair, none for the unpaired rounds
    _run_json(tmp_path / "other", [{"laps": 1, "smg:cache_aware": 2}],
              time_scale_for={"azure": 0.8})
    assert script.main(runs + [str(tmp_path / "other"), "--trace", "azure"]) == 2
    assert "time_scale: [1.1, 1.1, 0.8]" in capsys.readouterr().err
    assert script.main(runs + [str(tmp_path / "other"), "--trace", "azure",
                               "--allow-mixed"]) == 0
    assert script.main(runs + ["--trace", "mooncake"]) == 2  # no such rounds
    _run_json(tmp_path / "elsewhere", [{"laps": 1, "smg:cache_aware": 2}],
              trace_file="other_azure.csv")
    assert script.main(runs + [str(tmp_path / "elsewhere"), "--trace", "azure"]) == 2
    assert "trace_file" in capsys.readouterr().err
    _run_json(tmp_path / "unblocked", [{"laps": 1, "smg:cache_aware": 2}], block=0)
    assert script.main(runs + [str(tmp_path / "unblocked"), "--trace", "azure"]) == 0
    _run_json(tmp_path / "blocked", [{"laps": 1, "smg:cache_aware": 2}], block=100)
    assert script.main(runs + [str(tmp_path / "blocked"), "--trace", "azure"]) == 2
    assert "block: [0, 0, 100]" in capsys.readouterr().err  # replays of another length
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "routers.json").write_text('{"args": ')
    with pytest.raises(SystemExit, match="broken.*not JSON"):
        script.main([str(tmp_path / "broken"), "--trace", "azure"])


def test_blocks_cut_a_real_trace_into_consecutive_parts_with_their_own_gaps():
    """--block N: consecutive parts of N requests of the real Azure trace, together every
    request once in order, each part's arrivals moved to start at 0 with the trace's gaps kept;
    0 (or N at least the trace) replays whole, as does a sessions trace; a negative N is
    refused."""
    import os

    from laps_jax.workload.load import load
    from laps_jax.workload.records import TraceOptions
    path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces",
                        "azure_llm_2023_conv.csv")
    n, size = random.Random(5).randint(230, 320), random.Random(6).randint(40, 90)
    work = load("azure", path, TraceOptions(max_requests=n, vocab_size=1000))
    parts = rb.blocks(work, size)
    assert [len(p) for p in parts] == [size] * (n // size) + ([n % size] if n % size else [])
    assert [r.request_id for p in parts for r in p] == [r.request_id for r in work]
    start = 0
    for p in parts:
        orig = work.requests[start:start + len(p)]
        assert p[0].arrival_s == 0.0
        assert [r.arrival_s for r in p] == pytest.approx(
            [r.arrival_s - orig[0].arrival_s for r in orig])
        assert [(r.input_len, r.output_len) for r in p] == [(r.input_len, r.output_len)
                                                             for r in orig]
        start += len(p)
    assert work.requests[size].arrival_s > 0  # so the second part's 0 start is a real move
    assert rb.blocks(work, 0) == [work] and rb.blocks(work, n) == [work]
    with pytest.raises(ValueError, match="block size"):
        rb.blocks(work, -1)
    from laps_jax.workload.sessions import SessionTrace
    sessions = SessionTrace("s", [])
    assert rb.blocks(sessions, 10) == [sessions]  # closed loop: replays whole
    script = load_script("bench_routers")
    assert script.parse_args(["--output-dir", "o", "--block", "100"]).block == 100
    with pytest.raises(SystemExit):
        script.parse_args(["--output-dir", "o", "--block", "-1"])


def test_two_traces_of_one_kind_are_told_apart_by_name():
    """--trace NAME=KIND:PATH: two sessions traces (two family members) replay side by side,
    each with its own --*-for options by name over its kind's; a name given twice, or an
    option for a name that is no trace, is a usage error."""
    script = load_script("bench_routers")
    args = script.parse_args(["--output-dir", "o", "--time-scale", "0.5",
                              "--trace", "chat=sessions:runs/a.jsonl",
                              "--trace", "code=sessions:runs/b=c.jsonl",
                              "--trace", "mooncake:m.jsonl",
                              "--time-scale-for", "sessions=0.3",
                              "--time-scale-for", "code=0.1", "--max-requests-for", "chat=40"])
    assert args.trace == [("chat", "sessions", "runs/a.jsonl"),
                          ("code", "sessions", "runs/b=c.jsonl"),
                          ("mooncake", "mooncake", "m.jsonl")]
    chat, code, moon = (script.options_for(args, n, 1000) for n in ("chat", "code", "mooncake"))
    assert chat.time_scale == 0.3  # its kind's
    assert chat.max_requests == 40 and code.time_scale == 0.1 and moon.time_scale == 0.5
    for bad in (["--trace", "a=sessions:x", "--trace", "a=azure:y"],
                ["--trace", "sessions:x", "--trace", "sessions:y"],
                ["--trace", "a=sessions:x", "--time-scale-for", "b=0.1"],
                ["--trace", "a=nosuch:x"], ["--trace", "a=sessions:"]):
        with pytest.raises(SystemExit):
            script.parse_args(["--output-dir", "o", *bad])


def test_instance_step_counters_per_request():
    """Lane seconds, steps and rows read from /metrics text, and their growth per request."""
    from laps_jax.bench.instance_steps import counters, per_request
    text = (
        '# TYPE laps_lane_seconds counter\n'
        'laps_lane_seconds_total{kind="prefill",lane="laps"} 2.0\n'
        'laps_lane_seconds_total{kind="decode",lane="laps"} 1.0\n'
        '# TYPE laps_prefill_batches counter\n'
        'laps_prefill_batches_total{lane="laps",size="1"} 4.0\n'
        'laps_prefill_batches_total{lane="laps",size="3"} 2.0\n'
        '# TYPE laps_decode_batches counter\n'
        'laps_decode_batches_total{lane="laps",size="2"} 10.0\n'
        '# TYPE laps_filled_long_tokens counter\n'
        'laps_filled_long_tokens_total{lane="laps"} 64.0\n'
        '# TYPE laps_requests counter\n'
        'laps_requests_total{endpoint="/metrics",status="200"} 9.0\n')
    c = counters(text)
    assert c == {"prefill_s": 2.0, "decode_s": 1.0, "prefill_steps": 6.0, "prefill_rows": 10.0,
                 "decode_steps": 10.0, "decode_rows": 20.0, "filled_long_tokens": 64.0}
    before = dict(c, prefill_s=1.0, prefill_steps=2.0, prefill_rows=2.0, decode_steps=0.0,
                  decode_rows=0.0)
    d = per_request(before, c, 4)
    assert d["instances_prefill_ms_per_request"] == 250.0
    assert d["instances_decode_ms_per_request"] == 0.0
    assert d["prefill_steps_per_request"] == 1.0 and d["prefill_batch_mean"] == 2.0
    assert d["decode_steps_per_request"] == 2.5 and d["decode_batch_mean"] == 2.0
    assert per_request(None, c, 4) == {}


def test_router_pairs_speed_adjusted_scale_each_replays_targets_by_its_speed(tmp_path, capsys):
    """A replay whose instances ran 1.5x the pair's mean compute per request is judged against
    1.5x its targets, the other (0.5x) against half of them: TTFT 140 ms over a 100 ms target
    misses raw, not at 1.5x; 60 ms meets it raw, misses at 0.5x. Rounds without the speed
    figure are left out."""
    from laps_jax.bench import pairs as bp
    iso = {"tokens": [1, 1000], "ms": [20.0, 20.0]}  # 5 x 20 = a 100 ms target everywhere
    run = {"args": {"slo_scale": 5, "block": 0, "rounds": 2}, "isolated_ttft": iso,
           "blocks_per_round": {"t": 1}, "complete": True,
           "traces": {"t": {"rounds": [
               {"a": {"slo_violations": 2, bp.SPEED: 300.0},
                "b": {"slo_violations": 0, bp.SPEED: 100.0}},
               {"a": {"slo_violations": 2}, "b": {"slo_violations": 0}}]}}}
    d = tmp_path / "run"
    logs = d / "bench_routers_x"
    logs.mkdir(parents=True)
    (d / rb.RUN_FILE).write_text(json.dumps(run))
    def rec(i, ttft):
        return json.dumps({"request_id": str(i), "new_tokens": 50, "status": 200,
                           "ttft_s": ttft})
    for rnd in (1, 2):
        (logs / f"requests_t_r{rnd}_a.jsonl").write_text(
            "\n".join([rec(0, 0.14), rec(1, 0.16), json.dumps({"router_status": {}})]) + "\n")
        (logs / f"requests_t_r{rnd}_b.jsonl").write_text(
            "\n".join([rec(0, 0.06), rec(1, 0.04)]) + "\n")
    runs = {"run": rb.read_run(str(d))}
    assert [(p.router, p.reference) for p in bp.pairs(runs, "t", "a", "b")] == [(2, 0), (2, 0)]
    adj = bp.speed_adjusted({"run": str(d)}, runs, "t", "a", "b")
    assert [(p.round_no, p.router, p.reference) for p in adj] == [(1, 1, 1)]
    script = load_script("bench_router_pairs")
    assert script.main([str(d), "--trace", "t", "--router", "a", "--against", "b",
                        "--speed-adjusted"]) == 0
    assert "pooled 1 / 1 = 1.00" in capsys.readouterr().out


def test_bench_poll_cost_refuses_empty_runs(capsys):
    mod = load_script("bench_poll_cost")
    a = mod.parse_args([])
    assert (a.instances, a.phases, a.requests, a.prompt_tokens) == (2, 6, 40, 250)
    for flag in ("--instances", "--phases", "--requests", "--prompt-tokens"):
        with pytest.raises(SystemExit):
            mod.parse_args([flag, "0"])
        assert flag in capsys.readouterr().err


def test_placement_counts_each_instance_by_what_the_router_named():
    """Our router names a place, smg a URL (with or without its slash); failed requests and
    names outside the run's instances are left out of the instances' rows."""
    from laps_jax.bench.placement import busiest_share, instance_index, placement
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert instance_index("1", urls) == 1 and instance_index("2", urls) is None
    assert instance_index("http://127.0.0.1:8001/", urls) == 0
    assert instance_index("http://10.0.0.1:8001", urls) is None and instance_index(None, urls) is None

    def rec(name, prompt, cached, out, ok=True):
        return RequestRecord("r", 0.0, out, prompt_tokens=prompt, output_tokens=out,
                             cached_tokens=cached, served_by=name, status=200 if ok else 503,
                             finish_reason="length", error=None if ok else "HTTP 503")
    rows = placement([rec("0", 100, 40, 5), rec("http://127.0.0.1:8002", 300, 0, 7),
                      rec("http://127.0.0.1:8002/", 50, 50, 1), rec("1", 900, 0, 9, ok=False),
                      rec(None, 10, 0, 1), rec("7", 10, 0, 1)], urls)
    assert rows[:2] == [{"requests": 1, "computed_tokens": 60, "output_tokens": 5},
                        {"requests": 2, "computed_tokens": 300, "output_tokens": 8}]
    assert rows[2] == {"unnamed": 2}
    assert busiest_share(rows) == pytest.approx(300 / 360)
    assert placement([rec(None, 10, 0, 1)], urls) is None and busiest_share(None) is None
