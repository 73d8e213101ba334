"""The load-adaptive laps rule (`laps-adaptive`) on hand-made loads where the right choice is
known: every instance queues, a one-chunk long request, and a far-behind prefix holder."""

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


def test_when_every_instance_queues_the_shortest_finish_wins_across_groups():
    # a 500-token request (5 s): the short-group instance finishes it at 2.0 + 5 = 7.0 s
    # (its short work runs first, no long work there), the long one at 2.2 + 5 = 7.2 s
    loads, short = [2.0, 2.2], [2.0, 0.0]
    for policy, want in (("laps", 1), ("laps-adaptive", 0)):
        p = make(policy, n=2)
        assert p.group == [SHORT, LONG]
        assert p.choose(500, [0, 0], loads, 0.0, short_loads=short).instance == want, policy


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
    # 3,000 tokens, 1,500 cached on instance 1: 15 s there, 30 s elsewhere, and the 15 s of
    # history recomputed elsewhere is charged again (harm 1): the holder wins while its wait
    # is under the other's + 30 s
    def pick(holder_wait: float) -> int:
        p = make(policy, chunk_s=4.0)
        loads = [100.0, holder_wait, 20.0]
        return p.choose(3000, [0, 1500, 0], loads, 0.0, short_loads=[100.0, 0.0, 0.0]).instance
    assert pick(20.0 + 29.0) == 1
    assert pick(20.0 + 31.0) == 2
