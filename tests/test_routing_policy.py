"""The routing policy decides from plain numbers (cached prefixes, pending work), so the
in-process router and a network router can feed it alike; checked here by hand."""

from __future__ import annotations

import pytest

from laps_jax.cluster.policy import RouterConfig, RoutingPolicy
from laps_jax.scheduler.request import LONG, SHORT


def short_under_64(new: int, cached: int) -> bool:
    return new <= 64


def policy(n: int = 4, **kw) -> RoutingPolicy:
    return RoutingPolicy(n, RouterConfig(**kw), short_under_64, full_step_s=1.0)


def test_groups_start_split_and_keep_one_each():
    assert policy(4).group == [SHORT, SHORT, LONG, LONG]
    assert policy(2, short_fraction=0.9).group == [SHORT, LONG]
    assert policy(1).group == [SHORT]
    with pytest.raises(ValueError):
        RouterConfig(policy="random")


def test_history_pins_the_request_to_its_holder():
    p = policy(4)
    c = p.choose(100, [0, 0, 0, 64], [0.0, 0.0, 0.0, 9.0], now=0.0)  # 64 of 100 cached
    assert (c.instance, c.new_tokens, c.cached_tokens, c.short) == (3, 36, 64, True)
    assert p.stats.by_affinity == 1
    c = p.choose(200, [0, 0, 0, 64], [0.0, 0.0, 0.0, 9.0], now=0.0)  # 32%: not pinned
    assert c.instance != 3 and c.cached_tokens == 0 and not c.short


def test_length_aware_sends_each_kind_to_its_least_loaded_member():
    p = policy(4)
    loads = [0.5, 0.2, 0.3, 0.1]
    assert p.choose(10, [0] * 4, loads, 0.0).instance == 1   # short group {0, 1}
    assert p.choose(500, [0] * 4, loads, 0.0).instance == 3  # long group {2, 3}


def test_spill_only_past_one_full_step():
    p = policy(4, rebalance_interval_s=1e9)
    p.choose(10, [0] * 4, [0.0] * 4, 0.0)  # the first call sets the rebalance clock
    assert p.choose(10, [0] * 4, [1.5, 1.5, 0.6, 0.7], 1.0).instance in (0, 1)  # 0.9 < 1 step
    c = p.choose(10, [0] * 4, [2.5, 2.5, 0.6, 0.7], 2.0)  # the long group is 1.9 s freer
    assert c.instance == 2 and p.stats.spilled == 1
    strict = policy(4, spill_s=float("inf"))
    assert strict.choose(10, [0] * 4, [9.0, 9.0, 5.0, 5.0], 0.0).instance in (0, 1)


def test_rebalance_moves_one_instance_per_interval_toward_the_busy_group():
    p = policy(4, rebalance_interval_s=5.0, rebalance_ratio=2.0)
    busy_short = [3.0, 3.0, 0.5, 0.2]
    p.choose(10, [0] * 4, busy_short, now=0.0)
    assert p.group == [SHORT, SHORT, LONG, SHORT]  # the long member with least to drain moved
    p.choose(10, [0] * 4, busy_short, now=1.0)  # inside the interval: no second move
    assert p.stats.moves == 1
    p.choose(10, [0] * 4, [3.0, 3.0, 0.2, 3.0], now=6.0)
    assert p.group == [SHORT, SHORT, LONG, SHORT]  # the long group keeps its last member
    p.choose(500, [0] * 4, [0.1, 0.1, 5.0, 0.1], now=12.0)
    assert p.group == [LONG, SHORT, LONG, SHORT]
    assert [g for _, *g in p.stats.groups] == [[3, 1], [2, 2]] and p.stats.moves == 2


def test_round_robin_and_least_load_ignore_length():
    rr = policy(3, policy="round-robin")
    assert [rr.choose(n, [0] * 3, [0.0] * 3, 0.0).instance for n in (5, 900, 5, 900)] == \
        [0, 1, 2, 0]
    ll = policy(3, policy="least-load")
    assert ll.choose(900, [0] * 3, [0.3, 0.1, 0.2], 0.0).instance == 1
    assert ll.choose(5, [0] * 3, [0.3, 0.4, 0.2], 0.0).instance == 2
    assert rr.stats.routed == [2, 1, 1]


def test_threshold_override_replaces_the_instances_cut():
    p = policy(2, threshold=1000)
    assert p.choose(900, [0, 0], [0.0, 0.0], 0.0).short
    assert not policy(2).choose(900, [0, 0], [0.0, 0.0], 0.0).short
