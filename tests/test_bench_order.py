"""The order a benchmark runs its modes or routers in, round by round (laps_jax/bench/order.py)."""

from __future__ import annotations

from itertools import permutations

from laps_jax.bench.order import round_order


def test_round_order_reverses_each_pair_and_moves_every_mode_through_every_position():
    modes = ["mixed", "laps", "laps-spatial"]
    orders = [round_order(modes, k) for k in range(6)]
    assert sorted(map(tuple, orders)) == sorted(permutations(modes))  # all six, once each
    assert all(orders[k + 1] == orders[k][::-1] for k in (0, 2, 4))   # drift cancels by pairs
    assert round_order(modes, 6) == orders[0]
    two = [round_order(["a", "b"], k) for k in range(4)]
    assert [o[0] for o in two].count("a") == 2 and all(sorted(o) == ["a", "b"] for o in two)
    assert round_order(["a"], 3) == ["a"]


def test_four_routers_each_take_every_place_and_follow_more_than_one_other():
    """bench_routers.py's usual four (a router, its A/A twin, a variant, the gateway): over 8
    rounds each is at every place twice, and the twin does not always run right after its
    original (with a plain rotation it did, in every round)."""
    routers = ["inflow", "again", "hold", "smg"]
    orders = [round_order(routers, k) for k in range(8)]
    for r in routers:
        assert sorted(o.index(r) for o in orders) == [0, 0, 1, 1, 2, 2, 3, 3]
        before = {o[o.index(r) - 1] for o in orders if o.index(r) > 0}
        assert len(before) >= 2, (r, before)
    assert sum(o.index("again") == o.index("inflow") + 1 for o in orders) <= 4
