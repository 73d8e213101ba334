"""The load-adaptive laps rule (`laps-adaptive`) on hand-made loads where the right choice is
known: a prefix holder behind when every instance queues and when one is idle, a one-chunk
long request, and a nearly idle short instance."""

from __future__ import annotations

import pytest

from laps_jax.cluster.policy import RouterConfig, RoutingPolicy
from laps_jax.scheduler.request import LONG, SHORT


def make(policy: str, n: int = 3, chunk_s: float = 0.25) -> RoutingPolicy:
    """Cost = new tokens / 100 (s), short at <= 64 new tokens, a full step 1 s; groups fixed
    (no moves) so only the rule decides."""
    from laps_jax.cluster.groups import GroupSettings
    frozen = GroupSettings(hysteresis=1e6)
    return RoutingPolicy(n, RouterConfig(policy=policy, groups=frozen), lambda new, c: new <= 64,
                         full_step_s=1.0, chunk_s=chunk_s, cost=lambda new, c, s: new / 100)


def test_when_every_instance_queues_the_holder_keeps_its_history_longer():
    # 3,000 tokens, 1,500 cached on instance 1: 15 s there, 30 s elsewhere. laps moves it
    # once the holder is 30 s ((1 + harm) x 15) further behind; when every instance queues
    # the recomputed 15 s is capacity lost to all, and laps-adaptive keeps it up to 45 s
    def pick(policy: str, holder_wait: float) -> int:
        return make(policy, chunk_s=4.0).choose(
            3000, [0, 1500, 0], [100.0, holder_wait, 20.0], 0.0,
            short_loads=[100.0, 0.0, 0.0]).instance
    assert pick("laps", 20.0 + 40.0) == 2
    assert pick("laps-adaptive", 20.0 + 40.0) == 1
    assert pick("laps-adaptive", 20.0 + 46.0) == 2


def test_a_nearly_idle_short_instance_keeps_the_group_margin():
    # the short instance has 0.2 s pending (under one chunk): it still serves short work with
    # nothing in the way, so long work keeps off it unless it is idle, as before
    loads, short = [0.2, 0.3], [0.2, 0.0]
    for policy in ("laps", "laps-adaptive"):
        p = make(policy, n=2)
        assert p.choose(500, [0, 0], loads, 0.0, short_loads=short).instance == 1, policy


def test_a_one_chunk_long_request_waits_for_the_chunk_not_all_the_long_work():
    # chunk 4 s; a 300-token request (3 s) is long and fits one chunk. Instance 1 has one
    # 30 s request pending, instance 2 two of 8 s and 1 s of short work; the long pool runs
    # the least remaining first, so the truth (what the rule computes from the items) is
    # instance 1: 4 s chunk + 3 s + 3 s delay to the one larger = 10 vs 1 + 4 + 6 + 3 = 14
    loads, short = [50.0, 30.0, 17.0], [50.0, 0.0, 1.0]
    items = [[], [30.0], [8.0, 8.0]]
    truth = make("laps", chunk_s=4.0).choose(300, [0] * 3, loads, 0.0, short_loads=short,
                                             long_items=items).instance
    assert truth == 1
    # without the items (the network router) the old rule counts all 30 s on instance 1
    blind = make("laps", chunk_s=4.0).choose(300, [0] * 3, loads, 0.0, short_loads=short)
    assert blind.instance == 2
    adaptive = make("laps-adaptive", chunk_s=4.0).choose(300, [0] * 3, loads, 0.0,
                                                         short_loads=short)
    assert adaptive.instance == truth


@pytest.mark.parametrize("policy", ["laps", "laps-adaptive"])
def test_prefix_affinity_breaks_once_the_holder_is_further_behind_than_the_recompute(policy):
    # as above, but instance 2 is idle (not every instance queues): both rules move the
    # request once the holder is more than (1 + harm) x 15 = 30 s behind
    def pick(holder_wait: float) -> int:
        p = make(policy, chunk_s=4.0)
        loads = [100.0, holder_wait, 0.0]
        return p.choose(3000, [0, 1500, 0], loads, 0.0, short_loads=[100.0, 0.0, 0.0]).instance
    assert pick(28.0) == 1
    assert pick(32.0) == 2


def test_every_instance_far_behind_goes_by_requests_in_flight():
    # chunk 0.25 s; every instance at least 3 chunks behind. Instance 0 has the least
    # predicted work (1 s, in 9 requests), instance 2 the fewest requests (2, 4 s): laps
    # sends it by predicted finish, laps-adaptive where the fewest wait
    loads, short, inflight = [1.0, 3.0, 4.0], [0.0] * 3, [9, 5, 2]
    laps = make("laps").choose(300, [0] * 3, loads, 0.0, short_loads=short, inflight=inflight)
    assert laps.instance == 0
    p = make("laps-adaptive")
    assert p.choose(300, [0] * 3, loads, 0.0, short_loads=short, inflight=inflight).instance == 2
    assert p.stats.behind == 1
    # the holder of most of the prompt keeps it while the counts are balanced
    held = p.choose(300, [0, 200, 0], loads, 0.0, short_loads=short, inflight=inflight)
    assert held.instance == 1 and held.cached_tokens == 200
    # one instance under 3 chunks (0.7 s): the predicted finish decides again
    loads[0] = 0.7
    assert p.choose(300, [0] * 3, loads, 0.0, short_loads=short,
                    inflight=inflight).instance == 0
    # a caller that does not count requests in flight: the predicted finish too
    assert make("laps-adaptive").choose(300, [0] * 3, [1.0, 3.0, 4.0], 0.0,
                                        short_loads=short).instance == 0


def test_inflow_without_a_unit_falls_back_to_requests_in_flight_far_behind():
    # the same far-behind load: laps-inflow with each instance's seconds per unit prices the
    # inflow (none routed yet: the predicted finish, instance 0); without a unit (a network
    # router before any streamed request measured a pace) it cannot, and decides as
    # laps-adaptive: where the fewest requests wait
    loads, short, inflight = [1.0, 3.0, 4.0], [0.0] * 3, [9, 5, 2]
    priced = make("laps-inflow")
    assert priced.choose(300, [0] * 3, loads, 0.0, short_loads=short, inflight=inflight,
                         unit_s=[1.0] * 3).instance == 0
    assert priced.stats.behind == 0
    blind = make("laps-inflow")
    assert blind.choose(300, [0] * 3, loads, 0.0, short_loads=short,
                        inflight=inflight).instance == 2
    assert blind.stats.behind == 1


def test_far_behind_uses_each_instances_own_chunk():
    # instance 1 reports a 2 s chunk: 4 s pending is only 2 of its chunks, so not every
    # instance is behind and the predicted finish decides
    p = make("laps-adaptive")
    c = p.choose(300, [0] * 3, [1.0, 4.0, 4.0], 0.0, short_loads=[0.0] * 3,
                 inflight=[9, 1, 5], chunk=[0.25, 2.0, 0.25])
    assert c.instance == 0 and p.stats.behind == 0


def test_far_behind_requests_still_size_the_groups():
    # every instance far behind: the gateway's rule places the requests, but the groups must
    # still see their work, or a long surge decided that way leaves the long group sized
    # for the traffic before it
    p = make("laps-adaptive")
    loads, short, inflight = [4.0, 4.0, 4.0], [0.0] * 3, [3, 3, 3]
    before = p.groups.short_share(0.0, 0.0, 0.0)
    for _ in range(4):
        p.choose(800, [0] * 3, loads, 0.0, short_loads=short, inflight=inflight)
    assert p.stats.behind == 4
    assert p.groups.work[LONG] == pytest.approx(4 * 8.0)
    assert p.groups.short_share(0.0, 0.0, 0.0) < before
    p.choose(20, [0] * 3, loads, 0.0, short_loads=short, inflight=inflight)
    assert p.groups.work[SHORT] == pytest.approx(0.2)


def test_inflow_a_long_request_keeps_off_where_smaller_long_work_keeps_arriving():
    """laps-inflow: long instance 2 has 8 s of long work pending and long instance 3 has 10 s,
    but 2 s of smaller long work reached instance 2 in the last second (rho 0.4 over the 5 s
    window): on a least-remaining-first pool that keeps overtaking a 10 s request, (8 + 10) /
    0.6 = 30 s there against 20 s on instance 3. A request no larger than that work is not
    overtaken by it, and once the window has passed, or with no seconds per unit, nothing is
    counted."""
    busy = [100.0, 100.0]  # the short group, out of the way
    loads, short = busy + [8.0, 10.0], busy + [0.0, 0.0]
    unit = [1.0] * 4

    def policy(unit_s=unit) -> RoutingPolicy:
        p = make("laps-inflow", n=4)
        assert p.group == [SHORT, SHORT, LONG, LONG]
        first = p.choose(200, [0] * 4, busy + [0.0, 50.0], 0.0, short_loads=short,
                         unit_s=unit_s)
        assert first.instance == 2 and not first.short
        return p

    assert make("laps-adaptive", n=4).choose(1000, [0] * 4, loads, 1.0,
                                             short_loads=short).instance == 2
    assert policy().choose(1000, [0] * 4, loads, 1.0, short_loads=short,
                           unit_s=unit).instance == 3
    assert policy().choose(150, [0] * 4, loads, 1.0, short_loads=short,
                           unit_s=unit).instance == 2
    assert policy().choose(1000, [0] * 4, loads, 6.0, short_loads=short,
                           unit_s=unit).instance == 2
    assert policy(None).choose(1000, [0] * 4, loads, 1.0, short_loads=short).instance == 2
    # the network router's tokens: 2 s of work is 200 units at 10 ms a unit
    p = make("laps-inflow", n=4)
    p.cost = lambda new, cached, short_: float(new)
    tokens = [10_000.0, 10_000.0]
    p.choose(200, [0] * 4, tokens + [0.0, 5_000.0], 0.0, short_loads=tokens + [0.0, 0.0],
             unit_s=[0.01] * 4)
    assert p.choose(1000, [0] * 4, tokens + [800.0, 1000.0], 1.0,
                    short_loads=tokens + [0.0, 0.0], unit_s=[0.01] * 4).instance == 3


def test_inflow_uncounts_long_work_that_left_its_failed_instance():
    """A long request sent to instance 2 whose instance then failed (the router sent it on
    elsewhere) is no inflow there: withdrawn, the next long request is priced as if it had
    never been routed (instance 2, as with nothing routed), not stretched off (instance 3)."""
    busy = [100.0, 100.0]
    loads, short = busy + [8.0, 10.0], busy + [0.0, 0.0]
    unit = [1.0] * 4
    for withdrawn, want in ((False, 3), (True, 2)):
        p = make("laps-inflow", n=4)
        first = p.choose(200, [0] * 4, busy + [0.0, 50.0], 0.0, short_loads=short,
                         unit_s=unit)
        assert first.instance == 2 and first.long_record is not None
        if withdrawn:
            p.withdraw(first)
            p.withdraw(first)  # twice (or after it aged out): nothing more happens
        assert p.choose(1000, [0] * 4, loads, 1.0, short_loads=short,
                        unit_s=unit).instance == want
    # a short request is no long work: nothing to withdraw
    p = make("laps-inflow", n=4)
    q = p.choose(50, [0] * 4, [0.0] * 4, 0.0, short_loads=[0.0] * 4, unit_s=unit)
    assert q.short and q.long_record is None
    p.withdraw(q)


def test_inflow_prices_no_long_chunk_where_short_work_is_pending_on_every_instance():
    """Instance 0 (short group) has 0.30 s of short work pending; instance 1 (long group)
    0.10 s of short work and 2 s of long work (chunk 0.25 s). With short work pending on both,
    each runs its short batches before its long pool: a short request waits 0.10 s on
    instance 1 and 0.30 s on instance 0, and laps-inflow sends it to 1; laps-adaptive prices
    the chunk as well (0.35 s) and keeps it on 0. With instance 0's short queue empty the
    request starts there at once, and both rules send it there."""
    unit = [1.0, 1.0]
    for policy, want in (("laps-inflow", 1), ("laps-adaptive", 0)):
        p = make(policy, n=2)
        assert p.group == [SHORT, LONG]
        c = p.choose(20, [0, 0], [0.30, 2.10], 0.0, short_loads=[0.30, 0.10], unit_s=unit)
        assert c.short and c.instance == want, policy
        idle = make(policy, n=2).choose(20, [0, 0], [0.0, 2.10], 0.0, short_loads=[0.0, 0.10],
                                        unit_s=unit)
        assert idle.instance == 0, policy


def test_inflow_stretch_is_capped_and_forgets():
    from laps_jax.cluster.inflow import MAX_RHO, RecentLongWork, stretch
    w = RecentLongWork(window_s=5.0)
    w.record(0.0, 0, 2.0)
    w.record(1.0, 0, 4.0)
    w.record(1.0, 1, 1.0)
    assert w.rho(0, 4.0, 1.0, 1.0) == pytest.approx(6.0 / 5.0)
    assert w.rho(0, 3.0, 1.0, 1.0) == pytest.approx(2.0 / 5.0)   # only work no larger
    assert w.rho(0, 4.0, 5.5, 1.0) == pytest.approx(4.0 / 5.0)   # the first has aged out
    assert w.rho(1, 4.0, 1.0, 0.5) == pytest.approx(0.5 / 5.0)   # units of half a second
    assert stretch(0.4) == pytest.approx(1 / 0.6)
    assert stretch(6.0 / 5.0) == pytest.approx(1 / (1 - MAX_RHO))
    assert stretch(-1.0) == 1.0
