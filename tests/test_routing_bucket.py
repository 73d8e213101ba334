"""The `bucket` policy on hand-made loads: length ranges levelled on the recent work, the
gateway's imbalance fallback, and an owner that cannot take work (fake time, no processes)."""

from __future__ import annotations

import pytest

from laps_jax.cluster.bucket import Buckets, BucketSettings, level_bounds
from laps_jax.cluster.policy import RouterConfig, RoutingPolicy


def bucket(n: int, **kw) -> RoutingPolicy:
    """Cost = prompt tokens / 100, a full step 1 s (the default imbalance margin)."""
    return RoutingPolicy(n, RouterConfig(policy="bucket", bucket=BucketSettings(**kw)),
                         lambda new, cached: new <= 64, full_step_s=1.0,
                         cost=lambda new, c, s: new / 100)


def test_bounds_are_the_work_weighted_quantiles():
    # ten 100-token prompts of work 1 and one 2,000-token prompt of work 10: half the work
    # is the ten short ones, so the cut is at 100
    assert level_bounds([(100, 1.0)] * 10 + [(2000, 10.0)], 2) == [100]
    # equal work per length: quartiles
    assert level_bounds([(l, 1.0) for l in range(1, 101)], 4) == [25, 50, 75]
    assert level_bounds([], 3) == [] and level_bounds([(5, 1.0)], 1) == []


def test_initial_ranges_split_4096_evenly_and_the_last_has_no_end():
    b = Buckets(4)
    assert b.bounds == [1023, 2047, 3071]
    assert [b.owner(x) for x in (0, 1023, 1024, 3071, 3072, 100_000)] == [0, 0, 1, 2, 3, 3]


def test_ranges_move_so_each_instance_gets_the_same_work():
    p = bucket(2, interval_s=5.0, window_s=5.0)
    idle = [0.0, 0.0]
    # the first ranges ([0, 2047], [2048, ...)) put 38 short prompts (work 1 each) and two
    # of 1,900 tokens (work 19 each) all on instance 0
    picks = [p.choose(1900 if k % 20 == 19 else 100, [0, 0], idle, 0.1 * k).instance
             for k in range(40)]
    assert picks == [0] * 40 and p.buckets.adjusts == 0
    # five seconds on, the bounds level the window's work: short prompts stay, long move
    assert p.choose(100, [0, 0], idle, 5.0).instance == 0
    assert p.buckets.adjusts == 1 and p.buckets.bounds == [100]
    assert p.choose(1900, [0, 0], idle, 5.1).instance == 1
    assert p.choose(101, [0, 0], idle, 5.2).instance == 1


def test_bounds_stay_while_the_work_per_range_is_within_the_ratio():
    b = Buckets(2, BucketSettings(interval_s=1.0, window_s=1.0, readjust_ratio=2.0))
    ok = lambda k: True
    for k in range(10):
        b.pick(100 * (k + 1), 1.0, [0, 0], 0.05 * k, ok, 1.0)
    b.maybe_adjust(1.0)
    first = list(b.bounds)
    for k in range(10):  # the same work, other lengths: no move
        b.pick(10 * (k + 1), 1.5, [0, 0], 1.05 + 0.05 * k, ok, 1.0)
    assert not b.maybe_adjust(2.0) and b.bounds == first


def test_imbalanced_loads_go_to_the_least_loaded_as_the_gateway_does():
    p = bucket(2)
    assert p.choose(100, [0, 0], [5.0, 0.5], 0.0).instance == 1   # 4.5 > 1 s and > 2x
    assert p.choose(100, [0, 0], [1.2, 0.5], 0.1).instance == 0   # under one full step apart
    assert p.choose(100, [0, 0], [5.0, 3.0], 0.2).instance == 0   # under 2x
    assert p.stats.spilled == 1


def test_an_owner_that_cannot_take_work_leaves_it_to_the_least_loaded():
    p = bucket(3)
    assert p.choose(100, [0, 0, 0], [0.0, 0.4, 0.2], 0.0,
                    eligible=[False, True, True]).instance == 2


def test_bad_settings_are_refused():
    for kw in ({"interval_s": 0}, {"readjust_ratio": 0.5}, {"balance_abs": -1.0}):
        with pytest.raises(ValueError):
            BucketSettings(**kw)
