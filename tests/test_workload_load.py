"""The one trace loader (`workload.load`) and the shared trace flags every script declares."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from conftest import load_script
from laps_jax.workload.generator import SessionGenConfig, generate_sessions
from laps_jax.workload.load import FORMATS, add_trace_args, load, trace_options_from_args
from laps_jax.workload.records import Trace, TraceOptions
from laps_jax.workload.sessions import SessionTrace, write_sessions_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = [os.path.join(ROOT, "..", "shared", "traces"), "/work/shared/traces"]
FILES = {"azure": "azure_llm_2023_conv.csv", "mooncake": "mooncake_conversation_trace.jsonl"}


def _real(kind: str) -> str:
    for d in TRACES:
        if os.path.isfile(os.path.join(d, FILES[kind])):
            return os.path.join(d, FILES[kind])
    pytest.skip(f"{FILES[kind]} not found in ../shared/traces")


@pytest.fixture
def trace_files(tmp_path) -> dict[str, str]:
    """The two public traces, and a sessions file generated here."""
    sessions = tmp_path / "sessions.jsonl"
    write_sessions_jsonl(generate_sessions(12, SessionGenConfig(rate=2.0), seed=3), sessions)
    return {"azure": _real("azure"), "mooncake": _real("mooncake"), "sessions": str(sessions)}


def _requests(work: Trace | SessionTrace) -> list[tuple[float, int, int]]:
    """(time, input, output) per request: arrival for open loop; for sessions the session's
    arrival on turn 0 and the think time after, with each turn's new input."""
    if isinstance(work, SessionTrace):
        return [(s.arrival_s if k == 0 else t.think_s, t.new_input_tokens, t.output_tokens)
                for s in work.sessions for k, t in enumerate(s.turns)]
    return [(r.arrival_s, r.input_len, r.output_len) for r in work]


@pytest.mark.parametrize("kind", FORMATS)
def test_the_format_is_detected_and_gives_what_naming_it_gives(trace_files, kind):
    opts = TraceOptions(max_requests=20)
    detected, named = load(None, trace_files[kind], opts), load(kind, trace_files[kind], opts)
    assert isinstance(detected, SessionTrace if kind == "sessions" else Trace)
    assert _requests(detected) == _requests(named)
    if kind != "sessions":
        assert detected[0].request_id.startswith(kind)


@pytest.mark.parametrize("kind", FORMATS)
def test_every_option_means_the_same_for_every_kind(trace_files, kind):
    """The first N requests, lengths times the length scale (at least 1), times times the time
    scale: checked against the same file read without options."""
    n, length_scale, time_scale = 9, 0.3, 0.25
    plain = _requests(load(kind, trace_files[kind], TraceOptions()))[:n]
    cut = load(kind, trace_files[kind], TraceOptions(max_requests=n, length_scale=length_scale,
                                                     time_scale=time_scale))
    got = _requests(cut)
    assert len(got) == n == (cut.num_requests if kind == "sessions" else len(cut))
    for (t0, in0, out0), (t1, in1, out1) in zip(plain, got):
        assert t1 == pytest.approx(t0 * time_scale, rel=1e-9, abs=1e-9)
        assert (in1, out1) == (max(1, round(in0 * length_scale)),
                               max(1, round(out0 * length_scale)))
    if kind == "mooncake":  # the shared 512-token blocks scale with the prompts
        assert {r.block_size for r in cut} == {round(512 * length_scale)}


def test_an_unknown_kind_is_refused(trace_files):
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        load("csv", trace_files["azure"])


def _parser(**kw) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_trace_args(ap, **kw)
    return ap


def test_the_flags_fill_trace_options():
    args = _parser().parse_args(["--trace", "t.csv", "--max-requests", "5", "--length-scale",
                                 "0.5", "--time-scale", "2", "--trace-format", "azure"])
    assert (args.trace, args.trace_format) == ("t.csv", "azure")
    assert trace_options_from_args(args, vocab_size=1000, seed=4) == TraceOptions(
        max_requests=5, length_scale=0.5, time_scale=2.0, vocab_size=1000, seed=4)
    plain = _parser().parse_args(["--trace", "t.csv"])
    assert plain.time_scale is None and trace_options_from_args(plain) == TraceOptions()
    zero = _parser().parse_args(["--trace", "t", "--time-scale", "0"])
    assert trace_options_from_args(zero).time_scale == 0.0  # all at once, not "not given"


def test_trace_is_required_unless_the_script_has_a_default():
    with pytest.raises(SystemExit):
        _parser().parse_args([])
    assert _parser(trace_default="the workload's file").parse_args([]).trace is None
    only = _parser(only=("length_scale",)).parse_args(["--length-scale", "0.2"])
    assert vars(only) == {"length_scale": 0.2}
    with pytest.raises(ValueError, match="not trace flags"):
        _parser(only=("requests",))


def test_the_three_scripts_read_the_same_flags_the_same_way():
    flags = ["--trace", "x.jsonl", "--trace-format", "sessions", "--max-requests", "7",
             "--length-scale", "0.4", "--time-scale", "0.5", "--sample", "0.25"]
    parsed = [
        load_script("compare_modes").parse(flags + ["--output-dir", "out"]),
        load_script("bench_serving").parse_args(flags + ["--base-url", "http://h", "--output", "o"]),
        load_script("simulate").parse(["run"] + flags),
    ]
    opts = {trace_options_from_args(a) for a in parsed}
    assert opts == {TraceOptions(max_requests=7, length_scale=0.4, time_scale=0.5, sample=0.25)}
    assert {(a.trace, a.trace_format) for a in parsed} == {("x.jsonl", "sessions")}


def test_simulate_replays_a_trace_file_as_its_workload_would(tmp_path, capsys):
    """`simulate.py run --trace FILE --max-requests N` is `--workload KIND --requests N` (one
    instance): the same requests, the same simulated latencies."""
    sim = load_script("simulate")
    common = ["--mode", "laps", "--load", "0.6", "--trace-dir", os.path.dirname(_real("azure"))]
    outs = []
    for i, how in enumerate((["--workload", "azure", "--requests", "40"],
                             ["--trace", _real("azure"), "--max-requests", "40"])):
        out = tmp_path / f"{i}.json"
        args = sim.parse(["run", *how, *common, "--output", str(out)])
        assert args.func(args) == 0
        outs.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert outs[0]["workload"] == outs[1]["workload"]
    assert outs[0]["workload"]["requests"] == 40
    assert outs[0]["summary"] == outs[1]["summary"]
