"""Workload package: trace readers on the real traces, sessions, the LMSYS-shaped generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script
from laps_jax.workload.generator import (LMSYS_FIRST_TURN, LMSYS_LATER_TURN, LengthMixture,
                                         LogNormal, SessionGenConfig, generate_sessions)
from laps_jax.workload.records import (TokenSpace, TraceFormatError, TraceOptions, summarize)
from laps_jax.workload.sessions import (Session, SessionTrace, Turn, build_turn_prompt,
                                        flatten_sessions, read_sessions_jsonl, session_summary,
                                        write_sessions_jsonl)
from laps_jax.workload.load import load
from laps_jax.workload.traces import (detect_format, parse_azure_timestamp, read_azure_csv,
                                      read_mooncake_jsonl)

REPO = Path(__file__).resolve().parents[1]


def _traces_dir() -> Path | None:
    for d in (REPO.parent / "shared" / "traces", Path("/work/shared/traces")):
        if d.is_dir():
            return d
    return None


TRACES = _traces_dir()


def _trace(name: str) -> Path:
    if TRACES is None or not (TRACES / name).is_file():
        pytest.skip(f"real trace {name} not found in ../shared/traces or /work/shared/traces")
    return TRACES / name


@pytest.fixture(scope="module")
def azure_full():
    return read_azure_csv(_trace("azure_llm_2023_conv.csv"))


# ---------------------------------------------------------------- Azure

def test_azure_full_trace(azure_full):
    trace = azure_full
    assert len(trace) == 19_366 and trace.notes == [] and trace.truncated == 0
    arrivals = np.array([r.arrival_s for r in trace])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert 3400 < arrivals[-1] < 3600  # one hour of traffic
    s = trace.summary(256)
    assert abs(s.p50 - 1020) <= 5 and abs(s.p90 - 2735) <= 10  # trace README numbers
    assert abs(s.frac_under - 0.13) < 0.01
    assert np.median([r.output_len for r in trace]) == pytest.approx(129, abs=2)
    assert len({r.request_id for r in trace}) == len(trace)


def test_azure_timestamp_seven_digits():
    a = parse_azure_timestamp("2023-11-16 18:15:46.6805900")
    b = parse_azure_timestamp("2023-11-16 18:15:50.9951690")
    assert b - a == pytest.approx(4.314579, abs=1e-6)
    assert parse_azure_timestamp("2023-11-16 18:15:47") - a == pytest.approx(0.31941, abs=1e-6)
    # the 2024 traces' form (an offset), ISO 'Z', another zone, plain seconds
    c = parse_azure_timestamp("2023-11-16 18:15:46.680590+00:00")
    assert c - a == pytest.approx(0.0, abs=1e-6)
    assert parse_azure_timestamp("2023-11-16T18:15:46.6805900Z") == pytest.approx(a, abs=1e-6)
    assert parse_azure_timestamp("2023-11-16 20:15:47.5+02:00") - a == pytest.approx(0.81941,
                                                                                    abs=1e-6)
    assert parse_azure_timestamp(" 12.5 ") == 12.5
    for bad in ("2023-11-16 18:15:46.x", "soon", "", "nan"):
        with pytest.raises(ValueError):
            parse_azure_timestamp(bad)


def test_azure_csv_of_the_2024_form_with_a_bom(tmp_path):
    path = tmp_path / "azure_2024.csv"
    path.write_text("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                    "2024-05-10 00:00:00.009930+00:00,4808,10\r\n"
                    "2024-05-10 00:00:00.509930+00:00,3180,8\r\n", encoding="utf-8")
    trace = read_azure_csv(path)
    assert [r.input_len for r in trace] == [4808, 3180]
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.5])


def test_azure_options(azure_full):
    path = _trace("azure_llm_2023_conv.csv")
    base = azure_full.requests[:200]
    opts = TraceOptions(max_requests=200, length_scale=0.1, time_scale=2.0, vocab_size=1000,
                        token_low=5, seed=7)
    trace = read_azure_csv(path, opts)
    assert len(trace) == 200
    for b, r in zip(base, trace):
        assert r.arrival_s == pytest.approx(2 * b.arrival_s)
        assert r.input_len == max(1, round(0.1 * b.input_len)) >= 1
    ids = trace[3].prompt_token_ids()
    assert len(ids) == trace[3].input_len and min(ids) >= 5 and max(ids) < 1000
    assert ids == read_azure_csv(path, opts)[3].prompt_token_ids()  # deterministic
    capped = read_azure_csv(path, TraceOptions(max_requests=500, max_len=1024))
    over = sum(b.input_len + b.output_len > 1024 for b in azure_full.requests[:500])
    assert capped.truncated == over > 0 and str(over) in capped.notes[-1]
    for b, r in zip(azure_full.requests[:500], capped):
        assert r.input_len + r.output_len <= 1024
        assert r.input_len == b.input_len or r.input_len >= 512  # the prompt keeps half


# ---------------------------------------------------------------- Mooncake

@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_mooncake_shared_prefixes(scale):
    path = _trace("mooncake_conversation_trace.jsonl")
    trace = read_mooncake_jsonl(path, TraceOptions(max_requests=1500, length_scale=scale))
    assert len(trace) == 1500 and trace[0].arrival_s == 0.0
    block = trace[0].block_size
    assert block == max(1, round(512 * scale))
    groups: dict[tuple[int, ...], list] = {}
    for r in trace:
        if len(r.hash_ids) >= 2:
            groups.setdefault(r.hash_ids[:2], []).append(r)
    checked = 0
    for group in (g for g in groups.values() if len(g) > 1):
        a, b = group[0], group[1]
        k = 0
        while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
            k += 1
        k = min(k, a.input_len // block, b.input_len // block)
        ia, ib = a.prompt_token_ids(), b.prompt_token_ids()
        assert len(ia) == a.input_len and len(ib) == b.input_len
        assert ia[:k * block] == ib[:k * block]
        if min(len(ia), len(ib)) > k * block:
            assert ia[k * block] != ib[k * block]
        checked += k >= 2
        if checked >= 20:
            break
    assert checked >= 10  # the trace has many multi-block shared prefixes


def test_mooncake_full_count_and_lengths():
    trace = read_mooncake_jsonl(_trace("mooncake_conversation_trace.jsonl"))
    assert len(trace) == 12_031
    s = trace.summary()
    assert abs(s.p50 - 6909) <= 5 and abs(s.p90 - 27367) <= 10
    assert trace[-1].arrival_s == pytest.approx(3536.999)


def test_load_trace_dispatch(tmp_path):
    assert detect_format(_trace("azure_llm_2023_conv.csv")) == "azure"
    assert detect_format(_trace("mooncake_conversation_trace.jsonl")) == "mooncake"
    f = tmp_path / "s.jsonl"
    write_sessions_jsonl(generate_sessions(5, seed=1), f)
    assert detect_format(f) == "sessions"
    assert len(flatten_sessions(load(None, f))) == sum(len(s.turns)
                                                      for s in read_sessions_jsonl(f).sessions)


# ---------------------------------------------------------------- sessions

def test_sessions_round_trip(tmp_path):
    sessions = generate_sessions(300, SessionGenConfig(rate=3.0), seed=11)
    f = tmp_path / "sessions.jsonl"
    assert write_sessions_jsonl(sessions, f) == 300
    back = read_sessions_jsonl(f)
    assert back.sessions == sessions and back.notes == []
    assert back.num_requests == sum(len(s.turns) for s in sessions)


def test_session_prompts_closed_and_open_loop():
    space = TokenSpace(vocab_size=500, low=3, seed=2)
    s = Session("chat-1", 1.5, [Turn(5, 4), Turn(3, 2, think_s=2.0), Turn(6, 1, think_s=0.5)])
    assert s.turn_arrival(0) == 1.5 and s.turn_arrival(1, prev_done_s=10.0) == 12.0
    # Closed loop with the answers actually produced.
    p0 = s.prompt_ids(0, space)
    answer = [7, 8, 9]
    p1 = s.prompt_ids(1, space, p0, answer)
    assert p1 == p0 + answer + s.new_input_ids(1, space) == build_turn_prompt(
        p0, answer, s.new_input_ids(1, space))
    req = s.request(1, 12.0, space, prompt_ids=p1)
    assert req.prompt_token_ids() == p1 and req.history_len == len(p0) + 3
    assert req.new_input_len == 3
    # Open loop with nominal answers equals the chained closed-loop prompts.
    p1n = s.prompt_ids(1, space, p0, s.nominal_answer_ids(0, space))
    p2n = s.prompt_ids(2, space, p1n, s.nominal_answer_ids(1, space))
    flat = flatten_sessions(SessionTrace("x", [s], space), response_s=1.0)
    assert [r.arrival_s for r in flat] == [1.5, 4.5, 6.0]
    assert [r.prompt_token_ids() for r in flat] == [p0, p1n, p2n]
    assert [r.history_len for r in flat] == [0, 9, 14] and flat[2].input_len == 20
    assert all(3 <= t < 500 for t in p2n)


def test_sessions_options(tmp_path):
    f = tmp_path / "s.jsonl"
    s = [Session("a", 2.0, [Turn(100, 50), Turn(40, 30, 1.0), Turn(900, 10, 1.0)]),
         Session("b", 0.0, [Turn(3000, 100)])]
    write_sessions_jsonl(s, f)
    capped = read_sessions_jsonl(f, TraceOptions(max_len=1000, time_scale=0.5))
    a, b = sorted(capped.sessions, key=lambda x: x.session_id)
    assert [t.new_input_tokens for t in a.turns] == [100, 40]  # turn 3 would need 1130
    assert capped.sessions[0] is b and b.turns[0].new_input_tokens == 900  # cut, output kept
    assert a.arrival_s == 1.0 and a.turns[1].think_s == 0.5
    assert capped.dropped_turns == 1 and capped.truncated == 1 and len(capped.notes) == 2
    limited = read_sessions_jsonl(f, TraceOptions(max_requests=2, length_scale=0.5))
    assert limited.num_requests == 2 and limited.sessions[0].turns[0].new_input_tokens == 50


# ---------------------------------------------------------------- generator

def test_generator_lmsys_fractions():
    rng = np.random.default_rng(0)
    first = summarize(LMSYS_FIRST_TURN.sample(rng, 10_000), 256)
    later = summarize(LMSYS_LATER_TURN.sample(rng, 10_000), 256)
    assert abs(first.frac_under - 0.63) <= 0.03 and abs(later.frac_under - 0.81) <= 0.03
    assert first.p99 > 4000 and later.p99 > 2000  # heavy tail
    stats = session_summary(generate_sessions(10_000, seed=3))
    assert abs(stats["first_turn_input"].frac_under - 0.63) <= 0.03
    assert abs(stats["later_turn_new_input"].frac_under - 0.81) <= 0.03
    assert abs(stats["turns_per_session"].mean - 3.0) <= 0.15


def test_generator_seeded_and_poisson():
    cfg = SessionGenConfig(rate=4.0, length_scale=0.25)
    a, b = generate_sessions(2000, cfg, seed=5), generate_sessions(2000, cfg, seed=5)
    assert a == b and a != generate_sessions(2000, cfg, seed=6)
    gaps = np.diff([s.arrival_s for s in a])
    assert a[0].arrival_s == 0.0 and np.all(gaps >= 0)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.1)
    assert all(t.new_input_tokens >= 1 and t.output_tokens >= 1 for s in a for t in s.turns)


def test_mixture_fit_rejects_unreachable_target():
    with pytest.raises(ValueError, match="out of reach"):
        LengthMixture.fit(LogNormal(48, 1.0), LogNormal(900, 1.0), 0.99)


def test_make_sessions_cli(tmp_path):
    mod = load_script("make_sessions")
    out = tmp_path / "out" / "s.jsonl"
    args = ["--sessions", "20", "--seed", "4", "--rate", "2", "--output", str(out)]
    assert mod.main(args + ["--length-scale", "0.5"]) == 0
    cfg = SessionGenConfig(rate=2.0, length_scale=0.5)
    assert read_sessions_jsonl(out).sessions == generate_sessions(20, cfg, seed=4)
    with pytest.raises(SystemExit):
        mod.main(["--help"])


# ---------------------------------------------------------------- malformed input

def _expect_error(path: Path, reader, line: int, fragment: str) -> None:
    with pytest.raises(TraceFormatError) as e:
        reader(path)
    assert isinstance(e.value, ValueError) and e.value.line == line
    assert f"{path}:{line}" in str(e.value) and fragment in str(e.value)


@pytest.mark.parametrize("row,fragment", [
    ("2023-11-16 18:15:47.1,12", "expected 3 fields"),
    ("2023-11-16 18:15:47.1,twelve,3", "ContextTokens must be an integer"),
    ("2023-11-16 18:15:47.1,12,-3", "GeneratedTokens must be >= 0"),
    ("yesterday,12,3", "bad TIMESTAMP"),
])
def test_azure_malformed(tmp_path, row, fragment):
    f = tmp_path / "bad.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n" + row + "\n")
    _expect_error(f, read_azure_csv, 3, fragment)


@pytest.mark.parametrize("line,fragment", [
    ('{"timestamp": 5, "input_length": 10', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"timestamp": 5, "output_length": 3, "hash_ids": []}', "missing field 'input_length'"),
    ('{"timestamp": 5, "input_length": -1, "output_length": 3}', "input_length must be >= 0"),
    ('{"timestamp": 5, "input_length": 9, "output_length": 3, "hash_ids": [1, "x"]}',
     "hash_ids entry"),
])
def test_mooncake_malformed(tmp_path, line, fragment):
    f = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3,
                       "hash_ids": [1, 2]})
    f.write_text(good + "\n\n" + line + "\n")  # blank line 2 is skipped, error on line 3
    _expect_error(f, read_mooncake_jsonl, 3, fragment)


@pytest.mark.parametrize("turns,fragment", [
    ([{"arrival_s": 0, "new_input_tokens": 3, "output_tokens": 2},
      {"new_input_tokens": 3, "output_tokens": 2}], "turn 1 of session 'b': missing field 'think_s'"),
    ([{"arrival_s": 0, "new_input_tokens": -3, "output_tokens": 2}], "must be >= 0"),
    ([{"new_input_tokens": 3, "output_tokens": 2}], "missing field 'arrival_s'"),
    ([], "turns must be a non-empty list"),
])
def test_sessions_malformed(tmp_path, turns, fragment):
    f = tmp_path / "bad.jsonl"
    good = {"session_id": "a", "turns": [{"arrival_s": 0, "new_input_tokens": 3,
                                          "output_tokens": 2}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps({"session_id": "b", "turns": turns}) + "\n")
    _expect_error(f, read_sessions_jsonl, 2, fragment)


def test_sessions_duplicate_id(tmp_path):
    f = tmp_path / "dup.jsonl"
    s = Session("a", 0.0, [Turn(1, 1)])
    write_sessions_jsonl([s, s], f)
    _expect_error(f, read_sessions_jsonl, 2, "already used on line 1")


def test_options_validation():
    for bad in (dict(length_scale=0), dict(time_scale=-1), dict(max_len=1),
                dict(max_requests=-1)):
        with pytest.raises(ValueError):
            TraceOptions(**bad)
    with pytest.raises(ValueError):
        TokenSpace(vocab_size=10, low=10)
