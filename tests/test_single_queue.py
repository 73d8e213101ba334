"""mixed's one queue in each order, on hand-made arrivals whose order is worked out by hand.

One long request (1,000 tokens) arrives first, two short ones after it: FCFS serves the long
one first, SRPT the shorts (until the long one has waited the wait bound), HRRN by
(waited + service) / service.
"""

from __future__ import annotations

import argparse

import pytest

from laps_jax.bench.variants import parse_variant
from laps_jax.engine.buckets import BucketGrid
from laps_jax.engine.sequence import SamplingParams, Sequence
from laps_jax.scheduler import SchedulerConfig
from laps_jax.scheduler import flags
from laps_jax.scheduler.policy import MixedPlanner, derive
from laps_jax.scheduler.pools import SingleQueue
from laps_jax.scheduler.request import Request, RequestStats

GRID = BucketGrid.default(max_chunk=256, max_prefill_batch=8, max_decode_batch=8, min_tokens=16,
                          max_batch_tokens=512)


def req(name: str, n: int, arrival: float) -> Request:
    return Request(Sequence(list(range(10, 10 + n)), SamplingParams(max_tokens=2)),
                   RequestStats(name, arrival, n))


def queue(order: str) -> tuple[SingleQueue, dict[str, Request]]:
    """long (1,000 tokens) at 0.0, a (40) at 0.1, b (20) at 0.25; service = tokens / 1000 s."""
    q = SingleQueue(GRID, 512, 0.0, order, service=lambda n: n / 1000.0, max_wait_s=2.0)
    rs = {"long": req("long", 1000, 0.0), "a": req("a", 40, 0.1), "b": req("b", 20, 0.25)}
    for r in rs.values():
        q.add(r, r.stats.arrival)
    return q, rs


def names(reqs) -> list[str]:
    return [r.stats.request_id for r in reqs]


def test_fcfs_serves_in_arrival_order_and_nobody_overtakes():
    q, _ = queue("fcfs")
    assert names(q.ordered(0.3)) == ["long", "a", "b"]
    plan = q.plan(0.3)
    # long chunked to 256 and a (40) share a 2 x 256 bucket (296 of 512 real); b would need a
    # third row, and 3 rows of 256 exceed the 512 budget: strict FCFS stops there
    assert [(r.stats.request_id, n) for r, n in plan.work] == [("long", 256), ("a", 40)]


def test_srpt_serves_the_shorts_first_until_the_long_one_waited_the_bound():
    q, _ = queue("srpt")
    assert names(q.ordered(0.3)) == ["b", "a", "long"]      # 20 < 40 < 1000, nobody overdue
    plan = q.plan(0.3)
    # b first; a (40) beside b (20) would pad a 2 x 64 bucket 53% (> the 50% cap), so it is
    # skipped (not strict), and a 256-token chunk of long fills a 2 x 256 one (276 of 512 real)
    assert [(r.stats.request_id, n) for r, n in plan.work] == [("b", 20), ("long", 256)]
    assert names(q.ordered(2.05)) == ["long", "b", "a"]      # long waited 2.05 >= 2.0 s


def test_ratio_serves_the_highest_response_ratio_first():
    q, _ = queue("ratio")
    # at 0.3: long (0.3 + 1.0) / 1.0 = 1.3; a (0.2 + 0.04) / 0.04 = 6.0; b (0.05 + 0.02) / 0.02
    # = 3.5: a before b (unlike SRPT), the long one last
    assert names(q.ordered(0.3)) == ["a", "b", "long"]
    # at 5.0: long 6.0; a (4.9 + 0.04) / 0.04 = 123.5; b (4.75 + 0.02) / 0.02 = 238.5
    assert names(q.ordered(5.0)) == ["b", "a", "long"]
    c = req("c", 100, 4.99)
    q.add(c, 4.99)  # c: (0.01 + 0.1) / 0.1 = 1.1 < long's 6.0: the long one goes first
    assert names(q.ordered(5.0)) == ["b", "a", "long", "c"]


def test_mixed_is_fcfs_by_default_and_orders_by_queue_order_only():
    d = derive(SchedulerConfig(threshold=64), GRID, None)
    assert MixedPlanner(GRID, d).queue.order == "fcfs"
    # laps' pool order does not reach mixed's queue; queue_order does, with the pools' service
    d = derive(SchedulerConfig(threshold=64, order="ratio", queue_order="srpt",
                               max_wait_s=3.0), GRID, None)
    p = MixedPlanner(GRID, d)
    assert (p.queue.order, p.queue.max_wait_s) == ("srpt", 3.0)
    with pytest.raises(ValueError, match="queue_order must be one of"):
        derive(SchedulerConfig(queue_order="sjf"), GRID, None)


def test_order_flag_orders_mixed_only_where_mixed_is_the_mode():
    ap = argparse.ArgumentParser()
    flags.add_args(ap, ("order",))
    a = ap.parse_args(["--order", "ratio"])
    assert flags.from_args(a, "mixed").queue_order == "ratio"
    laps = flags.from_args(a, "laps")
    assert (laps.order, laps.queue_order) == ("ratio", "fcfs")
    assert flags.from_args(a).queue_order == "fcfs"  # beside laps: the baseline stays FCFS
    none = flags.from_args(ap.parse_args([]), "mixed")
    assert (none.order, none.queue_order) == ("srpt", "fcfs")


def test_a_mixed_variant_orders_the_one_queue():
    v = parse_variant("hrrn=mixed:order=ratio")
    assert v.settings == {"queue_order": "ratio"}
    assert parse_variant("laps-f=laps:order=fcfs").settings == {"order": "fcfs"}


def test_laps_long_pool_may_age_while_its_short_pool_keeps_srpt():
    """long_order=ratio orders laps' long pool alone: of two long requests, the larger one that
    has waited goes first under HRRN and last under SRPT; the short pool stays SRPT."""
    from laps_jax.scheduler.policy import LapsPlanner
    d = derive(SchedulerConfig(threshold=64, long_order="ratio"), GRID, None)
    p = LapsPlanner(GRID, d)
    assert (p.short.order, p.long.order) == ("srpt", "ratio")
    assert LapsPlanner(GRID, derive(SchedulerConfig(threshold=64), GRID, None)).long.order \
        == "srpt"  # unset: the pools share `order`
    from laps_jax.scheduler.pools import LongPool
    pools = {o: LongPool(GRID, 256, 0.0, 60.0, o, lambda n: n / 1000.0, 30.0)
             for o in ("srpt", "ratio")}
    for pool in pools.values():
        big, small = req("big", 2000, 0.0), req("small", 300, 19.0)
        pool.add(big, 0.0)
        pool.add(small, 19.0)
    # at 20.0: SRPT small (300 < 2,000; nobody past the 30 s bound); HRRN big (20 + 2) / 2 =
    # 11 against small (1 + 0.3) / 0.3 = 4.3
    assert names(pools["srpt"].ordered(20.0)) == ["small", "big"]
    assert names(pools["ratio"].ordered(20.0)) == ["big", "small"]
    assert parse_variant("laps-hl=laps:long_order=ratio").settings == {"long_order": "ratio"}
    with pytest.raises(ValueError, match="long_order must be one of"):
        derive(SchedulerConfig(long_order="sjf"), GRID, None)


def test_one_order_asked_for_orders_both_pools_unless_the_long_pool_is_named():
    from laps_jax.bench.variants import apply
    ap = argparse.ArgumentParser()
    flags.add_args(ap, ("order", "long_order"))
    both = flags.from_args(ap.parse_args(["--order", "fcfs"]), "laps")
    assert (both.order, both.long_order) == ("fcfs", None)  # None: the long pool follows
    split = flags.from_args(ap.parse_args(["--order", "fcfs", "--long-order", "ratio"]), "laps")
    assert (split.order, split.long_order) == ("fcfs", "ratio")
    only = flags.from_args(ap.parse_args(["--long-order", "ratio"]), "laps")
    assert (only.order, only.long_order) == (SchedulerConfig.order, "ratio")
    base = SchedulerConfig(long_order="ratio")
    assert apply(base, {"order": "fcfs"}).long_order is None
    assert apply(base, {"threshold": 32}).long_order == "ratio"
