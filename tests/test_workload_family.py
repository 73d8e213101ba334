"""The trace family: each member's generated statistics match its parameters (fixed seed), and
shared prefixes are the same tokens in every session that names them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from laps_jax.workload.family import MEMBERS
from laps_jax.workload.generator import SessionGenConfig, generate_sessions, tailed
from laps_jax.workload.records import TokenSpace
from laps_jax.workload.sessions import Session, SessionTrace

N = 3000


def sessions_of(name: str):
    m = MEMBERS[name]
    return m.config, generate_sessions(N, dataclasses.replace(m.config, rate=4.0), m.seed)


def test_the_family_spans_the_four_kinds_with_at_least_twelve_members():
    kinds = {m.kind for m in MEMBERS.values()}
    assert len(MEMBERS) >= 12 and kinds == {"chat", "code", "rag", "agent"}
    assert len({m.seed for m in MEMBERS.values()}) == len(MEMBERS)


@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_lengths_follow_ups_and_prefixes_match_the_parameters(name):
    cfg, ss = sessions_of(name)
    first = np.array([s.turns[0].new_input_tokens for s in ss])
    # the share under 256 and over 4,096 tokens: the mixture's own CDF, within sampling error
    for t in (256, 4097):
        assert (first < t).mean() == pytest.approx(cfg.first_input.frac_under(t), abs=0.03)
    out = np.array([t.output_tokens for s in ss for t in s.turns])
    assert (out < 128).mean() == pytest.approx(cfg.output.frac_under(128), abs=0.03)
    # follow-up share: 1 - sessions / turns, turns a geometric count capped at max_turns
    q = 1 - 1 / cfg.mean_turns
    expected_turns = (1 - q ** cfg.max_turns) / (1 - q) if q else 1.0
    turns = sum(len(s.turns) for s in ss)
    assert 1 - N / turns == pytest.approx(1 - 1 / expected_turns, abs=0.03)
    think = [t.think_s for s in ss for t in s.turns[1:]]
    if think:
        assert np.median(think) == pytest.approx(cfg.think_s.median, rel=0.1)
    with_prefix = np.mean([s.prefix_tokens > 0 for s in ss])
    assert with_prefix == pytest.approx(cfg.prefix_share, abs=0.03)


def test_bursts_hold_burst_size_sessions_on_average():
    cfg = SessionGenConfig(rate=1.0, burst_size=8.0, burst_gap_s=0.01)
    ss = generate_sessions(N, cfg, 7)
    gaps = np.diff([s.arrival_s for s in ss])
    # within a burst gaps average 0.01 s, between bursts 8 s: a gap over 0.1 s starts a burst
    # (1% of the gaps between bursts are shorter; geometric sizes are noisy: 15%)
    bursts = 1 + (gaps > 0.1).sum()
    assert N / bursts == pytest.approx(8.0, rel=0.15)
    # the same sessions/s as Poisson arrivals at that rate
    assert N / ss[-1].arrival_s == pytest.approx(1.0, rel=0.2)


def test_lengths_without_bursts_or_prefixes_are_what_they_always_were():
    plain = generate_sessions(50, SessionGenConfig(), 3)
    more = generate_sessions(50, SessionGenConfig(burst_size=4.0, prefix_share=0.5,
                                                  prefix_docs=2, prefix_len=tailed(100, 0.1)), 3)
    assert [s.turns for s in plain] == [s.turns for s in more]


def test_a_shared_prefix_is_the_same_tokens_cached_after_its_first_session():
    a = Session("a", 0.0, [_turn(30)], "doc1", 64)
    b = Session("b", 1.0, [_turn(20)], "doc1", 64)
    c = Session("c", 2.0, [_turn(20)], "doc2", 64)
    space = TokenSpace()
    SessionTrace("t", [a, b, c], space)
    pa, pb, pc = (s.prompt_ids(0, space) for s in (a, b, c))
    assert pa[:64] == pb[:64] != pc[:64] and len(pa) == 94
    assert (a.new_tokens(0), b.new_tokens(0), c.new_tokens(0)) == (94, 20, 84)
    back = Session.from_json(json.loads(json.dumps(b.to_json())))
    assert (back.prefix_id, back.prefix_tokens, back.turns) == ("doc1", 64, b.turns)


def _turn(n: int):
    from laps_jax.workload.sessions import Turn
    return Turn(n, 8)
