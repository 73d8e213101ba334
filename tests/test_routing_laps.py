"""The `laps` and `prefix` routing policies, decision by decision, on fake loads and fake time
(the policy never reads a clock or measures anything, so every case here is deterministic)."""

from __future__ import annotations

import pytest

from laps_jax.cluster.cache_aware import CacheAwareSettings, pick_cache_aware
from laps_jax.cluster.groups import Groups, GroupSettings
from laps_jax.cluster.policy import RouterConfig, RoutingPolicy
from laps_jax.scheduler.request import LONG, SHORT


def short_under_64(new: int, cached: int) -> bool:
    return new <= 64


def laps(n: int = 4, **kw) -> RoutingPolicy:
    """Cost = new tokens / 100 (seconds), a full step 1 s, a long chunk 0.25 s."""
    groups = GroupSettings(**kw.pop("groups", {}))
    return RoutingPolicy(n, RouterConfig(policy="laps", groups=groups, **kw), short_under_64,
                         full_step_s=1.0, chunk_s=0.25, cost=lambda new, c, s: new / 100)


# -- groups --------------------------------------------------------------------------------
def test_groups_follow_the_compute_share_with_hysteresis_and_one_each():
    g = Groups.split(8, 0.5, GroupSettings(share_tau_s=1e9, hysteresis=0.5, dwell_s=0.0,
                                           move_interval_s=0.0))
    ok, none = [True] * 8, lambda i, k: 0.0
    assert g.sizes() == (4, 4)
    g.observe(SHORT, 1.0, 0.0)
    g.observe(LONG, 1.0, 0.0)
    assert g.rebalance(0.0, g.short_share(0, 0, 0.0), ok, none) is None  # 4 of 8: on target
    assert g.rebalance(1.0, 0.40, ok, none) is None  # 3.2 short: within 0.5 + 0.5
    moves = [g.rebalance(2.0 + t, 0.01, ok, none) for t in range(5)]  # ~no short work
    assert [m.to for m in moves if m] == [LONG] * 3 and g.sizes() == (1, 7)  # keeps one
    for t in range(8):
        g.rebalance(10.0 + t, 0.99, ok, none)
    assert g.sizes() == (7, 1)  # ... and the long group keeps one too


def test_shares_are_compute_decayed_over_tau():
    g = Groups.split(2, 0.5, GroupSettings(share_tau_s=1.0))
    g.observe(LONG, 9.0, 0.0)
    g.observe(SHORT, 1.0, 0.0)
    assert g.short_share(0.0, 0.0, 0.0) == pytest.approx(0.1)
    g.observe(SHORT, 1.0, 5.0)  # the old work has decayed by e^-5
    assert g.short_share(0.0, 0.0, 5.0) > 0.9
    assert g.short_share(0.0, 50.0, 5.0) < 0.05  # pending long work counts as well


def test_dwell_and_move_interval_hold_a_moved_instance():
    g = Groups.split(4, 0.5, GroupSettings(hysteresis=0.0, dwell_s=10.0, move_interval_s=1.0))
    ok, none = [True] * 4, lambda i, k: 0.0
    m = g.rebalance(0.0, 0.99, ok, none)  # one long instance joins the short group
    assert (m.instance, m.to) == (2, SHORT) and g.sizes() == (3, 1)
    assert g.rebalance(0.5, 0.01, ok, none) is None       # inside the move interval
    m = g.rebalance(2.0, 0.01, ok, none)                  # a short one leaves: not the one
    assert (m.instance, m.to) == (0, LONG)                # that came 2 s ago (dwell 10 s)
    g.group[:] = [LONG, LONG, SHORT, LONG]
    assert g.rebalance(4.0, 0.99, ok, none).instance == 1  # 0 and 2 still dwell


def test_a_leaving_instance_drains_its_old_kind_first():
    g = Groups.split(2, 0.5, GroupSettings(hysteresis=0.0, dwell_s=0.0, move_interval_s=0.0))
    g.group[:] = [SHORT, LONG]
    long_left = {0: 0.0, 1: 3.0}
    pending = lambda i, kind: long_left[i] if kind == LONG else 0.0
    g.group.append(LONG)  # a third instance so the long group can give one
    g.moved_at.append(None)
    g.draining.append(False)
    long_left[2] = 5.0
    m = g.rebalance(0.0, 0.99, [True] * 3, pending)
    assert m.instance == 1 and g.draining == [False, True, False]  # least long work to drain
    g.update_draining(lambda i: long_left[i])
    assert g.draining[1]
    long_left[1] = 0.0
    g.update_draining(lambda i: long_left[i])
    assert not g.draining[1]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="dwell_s"):
        GroupSettings(dwell_s=-1.0)
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareSettings(cache_threshold=1.5)


# -- laps decisions ------------------------------------------------------------------------
def test_a_short_request_waits_out_short_work_and_one_chunk_not_the_whole_queue():
    p = laps(2, groups={"share_tau_s": 1e9})
    p.group[:] = [LONG, LONG]
    # i0: 5 s of long work, nothing short; i1: 0.4 s, all short. A short request would wait
    # one 0.25 s chunk on i0, 0.4 s on i1; plain least-load picks i1.
    c = p.choose(30, [0, 0], [5.0, 0.4], 0.0, short_loads=[0.0, 0.4])
    assert c.instance == 0 and c.short


def test_a_short_request_waits_out_each_instance_s_own_chunk():
    p = laps(2, groups={"share_tau_s": 1e9})
    p.group[:] = [LONG, LONG]
    # i0: 5 s of long work, i1: 0.3 s of short work. With the default 0.25 s chunk the short
    # request waits less on i0; when i0 says its chunks take 0.5 s, i1 is sooner; i1's own
    # chunk does not matter (it has no long work)
    args = ([0, 0], [5.0, 0.3], 0.0)
    assert p.choose(30, *args, short_loads=[0.0, 0.3]).instance == 0
    assert p.choose(30, *args, short_loads=[0.0, 0.3], chunk=[0.5, 0.01]).instance == 1
    assert p.choose(30, *args, short_loads=[0.0, 0.3], chunk=[0.2, 9.0]).instance == 0
    # a long request's SRPT wait and decode steps use the instance's chunk too: 2 s of work
    # in 0.5 s chunks is 4 decode steps of 0.3 s on i0 (3.2 s), 8 of them in 0.25 s chunks
    dec = dict(short_loads=[0.0, 0.0], decode_step=[0.3, 0.0])
    p2 = laps(2, harm=0.0)
    p2.group[:] = [LONG, LONG]
    assert p2.choose(200, [0, 0], [0.0, 1.35], 0.0, **dec).instance == 1  # 4.4 s vs 3.35
    assert p2.choose(200, [0, 0], [0.0, 1.35], 0.0, chunk=[0.5, 0.5], **dec).instance == 0


def test_the_history_holder_wins_while_its_load_allows():
    p = laps(2)
    p.group[:] = [LONG, LONG]
    args = dict(short_loads=[0.0, 0.0])
    # 1,000 tokens, 900 cached on i1: 1 s of work there, 10 s elsewhere
    assert p.choose(1000, [0, 900], [3.0, 8.0], 0.0, **args).instance == 1
    # i0 would finish at 10 s, i1 at 13 s; but i0 recomputes 9 s of history, work taken
    # from the other requests (harm 1): 19 s against 13 s
    assert p.choose(1000, [0, 900], [0.0, 12.0], 0.0, **args).instance == 1
    c = p.choose(1000, [0, 900], [0.0, 20.0], 0.0, **args)  # too busy: the whole prompt counts
    assert (c.instance, c.new_tokens, c.cached_tokens) == (0, 1000, 0)
    p0 = laps(2, harm=0.0)  # without the charge, the earlier finish alone decides
    p0.group[:] = [LONG, LONG]
    assert p0.choose(1000, [0, 900], [0.0, 12.0], 0.0, **args).instance == 0


def test_long_work_enters_the_short_group_past_a_margin_or_when_an_instance_idles():
    p = laps(2, groups={"share_tau_s": 1e9, "move_interval_s": 1e9})
    assert p.group == [SHORT, LONG]
    p.groups.observe(SHORT, 1.0, 0.0)  # half the compute is short: margin = 0.5 x 1 s step
    p.groups.observe(LONG, 1.0, 0.0)
    sl = [0.1, 0.0]
    assert p.choose(500, [0, 0], [0.1, 0.5], 0.0, short_loads=sl).instance == 1
    assert p.choose(500, [0, 0], [0.1, 0.7], 0.0, short_loads=sl).instance == 0
    assert p.stats.spilled == 1
    # an idle short instance takes long work with no margin at all
    assert p.choose(500, [0, 0], [0.0, 0.05], 0.0, short_loads=[0.0, 0.0]).instance == 0


def test_srpt_aware_wait_sends_a_small_long_request_past_big_queued_ones():
    p = laps(2, harm=0.0)
    p.group[:] = [LONG, LONG]
    # i0 holds one 6 s request, i1 three requests of 0.8 s: a 1 s request runs before the
    # big one on i0 (waiting one chunk), behind all three on i1.
    c = p.choose(100 * 1, [0, 0], [6.0, 2.4], 0.0, short_loads=[0.0, 0.0],
                 long_items=[[6.0], [0.8, 0.8, 0.8]])
    assert c.instance == 0


def test_decode_steps_count_once_per_prefill_step_of_the_request():
    p = laps(2, harm=0.0)
    p.group[:] = [LONG, LONG]
    none = dict(short_loads=[0.0, 0.0])
    # i0 decodes (0.3 s a step), i1 has 0.2 s of long work queued and decodes nothing
    dec = dict(none, decode_step=[0.3, 0.0])
    assert p.choose(30, [0, 0], [0.0, 0.2], 0.0, **dec).instance == 1  # 0.3 > 0.2
    assert p.choose(30, [0, 0], [0.0, 0.2], 0.0, **none).instance == 0  # unknown: i0 idles
    # 200 tokens, 2 s: 8 chunks of 0.25 s, each after a decode step on i0 (2.4 s) against
    # 1.5 s of work on i1
    assert p.choose(200, [0, 0], [0.0, 1.5], 0.0, **dec).instance == 1
    assert p.choose(200, [0, 0], [0.0, 1.5], 0.0,
                    **dict(none, decode_step=[0.1, 0.0])).instance == 0  # 0.8 s: i0


def test_draining_instances_get_no_new_work():
    p = laps(3, groups={"hysteresis": 0.0, "dwell_s": 0.0, "move_interval_s": 0.0,
                        "share_tau_s": 1e9})
    assert p.group == [SHORT, SHORT, LONG] or p.group == [SHORT, LONG, LONG]
    p.group[:] = [SHORT, LONG, LONG]
    p.groups.observe(SHORT, 100.0, 0.0)  # nearly all the work is short: a long one moves
    c = p.choose(30, [0] * 3, [0.0, 2.0, 0.0], 1.0, short_loads=[0.0, 0.0, 0.0])
    assert p.group == [SHORT, LONG, SHORT] and p.draining() == [False, False, False]
    p.group[:] = [SHORT, LONG, LONG]
    p.groups.last_move = None
    p.groups.observe(SHORT, 100.0, 1.0)
    c = p.choose(30, [0] * 3, [0.0, 2.0, 3.0], 2.0, short_loads=[0.0, 0.0, 0.0])
    assert p.draining() == [False, True, False] and p.group[1] == SHORT  # had 2 s to finish
    assert c.instance != 1 and p.stats.moves == 2


# -- prefix (cache-aware) ------------------------------------------------------------------
def test_cache_aware_prefers_the_prefix_then_the_least_busy_unless_imbalanced():
    s = CacheAwareSettings()
    ok = lambda i: True
    routed = [0, 0, 0]
    assert pick_cache_aware(100, [0, 60, 0], [5, 6, 5], routed, ok, s) == (1, True)
    assert pick_cache_aware(100, [0, 50, 0], [5, 6, 4], routed, ok, s) == (2, False)  # 50%
    assert pick_cache_aware(100, [0, 90, 0], [5, 40, 5], routed, ok, s) == (0, False)
    assert pick_cache_aware(100, [0, 0, 0], [3, 3, 3], [4, 2, 9], ok, s) == (1, False)
    assert pick_cache_aware(100, [0, 90, 0], [5, 40, 5], routed, lambda i: i != 0, s)[0] == 2


def test_prefix_policy_through_routing_policy_counts_cache_hits():
    p = RoutingPolicy(2, RouterConfig(policy="prefix"), short_under_64, 1.0)
    assert p.choose(100, [0, 80], [9.0, 9.0], 0.0, inflight=[0, 3]).instance == 1
    assert p.choose(100, [0, 0], [9.0, 0.0], 0.0, inflight=[0, 3]).instance == 0
    assert p.stats.by_affinity == 1 and p.stats.routed == [1, 1]
