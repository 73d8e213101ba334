"""Conversation sampling (laps_jax/workload/sampling.py, TraceOptions.sample): whole
conversations kept, about the asked fraction, the same ones for the same seed, and on the real
Mooncake trace a window that holds the trace's prefix reuse where the first requests do not.
Reuse and predecessors are measured from the trace's own hash_ids, not by the sampler's rule."""

from __future__ import annotations

import json
import math

import pytest

from conftest import load_script
from laps_jax.workload.generator import SessionGenConfig, generate_sessions
from laps_jax.workload.load import load
from laps_jax.workload.records import TraceFormatError, TraceOptions
from laps_jax.workload.sampling import PrefixConversations, keeps
from laps_jax.workload.sessions import write_sessions_jsonl
from test_workload_load import _real


def _block_reuse(hash_lists) -> float:
    """Share of blocks that repeat a leading run already seen in the window (what a prefix
    cache with room for everything could reuse)."""
    seen, total, hit = set(), 0, 0
    for h in hash_lists:
        k = 0
        while k < len(h) and h[k] in seen:
            k += 1
        seen.update(h)
        total, hit = total + len(h), hit + k
    return hit / total


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_a_fraction_outside_zero_to_one_is_refused(fraction):
    with pytest.raises(ValueError, match=r"conversations to keep must be in \(0, 1\]"):
        TraceOptions(sample=fraction)


def test_keeps_is_stable_near_the_fraction_and_nested():
    ids = range(20000)
    small = {i for i in ids if keeps(i, 0.2, seed=3)}
    large = {i for i in ids if keeps(i, 0.5, seed=3)}
    assert small == {i for i in ids if keeps(i, 0.2, seed=3)}
    assert small <= large
    assert abs(len(small) / 20000 - 0.2) < 0.015 and abs(len(large) / 20000 - 0.5) < 0.015
    other_seed = {i for i in ids if keeps(i, 0.2, seed=4)}
    assert len(small & other_seed) < 0.3 * len(small)  # about 0.2 of them, independent
    assert all(keeps(i, 1.0) for i in range(100))


def test_prefix_conversations_follow_continued_prompts_not_a_shared_system_prompt():
    conv = PrefixConversations()
    a = conv.assign((0, 1, 2, 3, 4))
    b = conv.assign((0, 5, 6))                    # only the system block in common: new
    a2 = conv.assign((0, 1, 2, 3, 4, 7, 8, 9))    # continues a
    a3 = conv.assign((0, 1, 2, 3, 4, 7, 8, 9, 10))  # continues a2, so a
    c = conv.assign((0, 1, 11, 12))               # two of a's five blocks: a preamble, new
    b2 = conv.assign((0, 5, 6, 13, 14, 15, 16))
    b3 = conv.assign((0, 5, 6, 20))               # branches off b, not off the longer b2
    assert (a, b, c) == (0, 1, 4)
    assert a2 == a3 == a and b2 == b3 == b


def test_mooncake_sample_keeps_whole_conversations_and_the_traces_reuse():
    path = _real("mooncake")
    head = load("mooncake", path, TraceOptions(max_requests=120, length_scale=0.1))
    sampled = load("mooncake", path, TraceOptions(max_requests=120, length_scale=0.1,
                                                  sample=0.05))
    assert len(sampled) == 120
    assert any("sample 0.05: kept 120 of the" in n for n in sampled.notes)
    # the first 120 requests span 36 s and reuse little; a 5% sample spans minutes and holds
    # the follow-up turns
    assert sampled[-1].arrival_s > 10 * head[-1].arrival_s
    assert _block_reuse(r.hash_ids for r in head) < 0.1
    assert _block_reuse(r.hash_ids for r in sampled) > 0.3

    # whole: every request of the file before the last kept one that a kept request extends
    # (every block of it but perhaps its last, partial one leads the kept one's, two blocks or
    # more) is kept too
    records = []
    with open(path) as f:
        for line in f:
            records.append(tuple(json.loads(line)["hash_ids"]))
            if len(records) > 2 * 120 / 0.05:
                break
    kept = {r.hash_ids for r in sampled}
    last = max(i for i, h in enumerate(records) if h in kept)
    checked = 0
    for i in range(last + 1):
        if records[i] not in kept:
            continue
        for j in range(i):
            h = records[j]
            full = max(2, len(h) - 1)
            if len(h) >= 2 and records[i][:full] == h[:full]:
                assert h in kept, f"request {i} kept without the request {j} it continues"
                checked += 1
    assert checked >= 20


def test_azure_and_sessions_sample_their_own_units(tmp_path):
    path = _real("azure")
    full = load("azure", path, TraceOptions(max_requests=4000))
    part = load("azure", path, TraceOptions(max_requests=4000, sample=0.25))
    assert len(part) == 4000
    read = int(part.notes[0].split("of the ")[1].split()[0])
    assert abs(4000 / read - 0.25) < 0.03
    # the kept requests are the file's own, in order, with its gaps
    by_len = [(r.input_len, r.output_len) for r in full]
    kept = [(r.input_len, r.output_len) for r in part][:200]
    it = iter(by_len)
    assert all(any(k == x for x in it) for k in kept)

    sessions = tmp_path / "sessions.jsonl"
    write_sessions_jsonl(generate_sessions(80, SessionGenConfig(rate=2.0), seed=5), sessions)
    every = load("sessions", sessions, TraceOptions())
    half = load("sessions", sessions, TraceOptions(sample=0.5))
    whole = {s.session_id: s for s in every.sessions}
    assert 20 <= len(half.sessions) <= 60
    for s in half.sessions:  # a kept session has every turn, unchanged
        assert [(t.new_input_tokens, t.output_tokens) for t in s.turns] == \
            [(t.new_input_tokens, t.output_tokens) for t in whole[s.session_id].turns]


def test_a_broken_row_is_an_error_whether_or_not_the_sample_keeps_it(tmp_path):
    bad = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:15:{i:02d}.0,{100 + i},{10 + i}" for i in range(30)]
    rows[17] = "2023-11-16 18:15:17.0,12"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    for seed in range(4):
        with pytest.raises(TraceFormatError, match=r"azure.csv:19: expected 3 fields"):
            load("azure", bad, TraceOptions(sample=0.2, seed=seed))


def test_the_scripts_take_sample_and_bench_routers_per_trace():
    script = load_script("bench_routers")
    args = script.parse_args(["--output-dir", "o", "--sample-for", "mooncake=0.05"])
    assert script.options_for(args, "mooncake", 1000).sample == 0.05
    assert script.options_for(args, "azure", 1000).sample == 1.0
    for bad in (["--sample-for", "mooncake=0"], ["--sample-for", "mooncake=2"],
                ["--sample", "0"]):
        with pytest.raises(SystemExit):
            script.parse_args(["--output-dir", "o", *bad])
    serving = load_script("bench_serving").parse_args(
        ["--trace", "x", "--sample", "0.3", "--base-url", "http://h", "--output", "o"])
    assert serving.sample == 0.3
