"""The multi-instance router's policies in the simulator, and generated sessions."""

from __future__ import annotations

import pytest

from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.cluster.inprocess import Router, RouterConfig
from laps_jax.sim import workload as wl
from laps_jax.sim.instance import build_dispatcher
from sim_fixtures import CFG, GRID, MODEL, spec


# -- the router -------------------------------------------------------------------------------
def _router(n: int, policy: str, hold_steps: float = 0.0, **kw):
    """A router in front of `n` laps instances on one virtual clock (`hold_steps`: long
    requests bound late, cluster/hold.py); `kw` is its RouterConfig."""
    clock = SimClock()
    ds = [build_dispatcher(spec("laps"), CFG, MODEL, clock, f"i{i}") for i in range(n)]
    return Router(ds, RouterConfig(policy=policy, **kw), clock, hold_steps=hold_steps), clock


def _prompt(n: int, key: int) -> list[int]:
    return [10 + (key * 977 + j * 13) % 400 for j in range(n)]


def test_round_robin_cycles():
    async def main():
        r, _ = _router(4, "round-robin", affinity_ratio=None)
        await r.start()
        for i in range(6):
            r.submit(_prompt(20, i), SamplingParams(max_tokens=1))
        await r.stop()
        return r.stats.routed
    assert run_simulated(main()) == [2, 2, 1, 1]


def test_least_load_avoids_the_busy_instance():
    async def main():
        r, _ = _router(2, "least-load", affinity_ratio=None)
        await r.start()
        a = r.submit(_prompt(250, 1), SamplingParams(max_tokens=1))   # -> i0 (tie, first)
        b = r.submit(_prompt(20, 2), SamplingParams(max_tokens=1))    # i0 is loaded -> i1
        c = r.submit(_prompt(20, 3), SamplingParams(max_tokens=1))    # i1 holds less -> i1
        await r.stop()
        return [h.request.lane.executor.name.split("/")[0] for h in (a, b, c)]
    assert run_simulated(main()) == ["i0", "i1", "i1"]


def test_length_aware_groups_and_rebalancing():
    """Short and long requests go to their groups; pending work skewed to one group pulls an
    instance over (each group keeps one; one move per check)."""
    async def main():
        r, clock = _router(4, "length-aware", affinity_ratio=None, rebalance_interval_s=0.0,
                           rebalance_ratio=2.0, threshold=64)
        await r.start()
        long = r.submit(_prompt(250, 1), SamplingParams(max_tokens=1))   # to the long group
        short = r.submit(_prompt(20, 2), SamplingParams(max_tokens=1))   # long work pending,
        where = [h.request.lane.executor.name.split("/")[0] for h in (long, short)]  # none short
        await clock.sleep(10.0)  # all done: nothing pending anywhere
        for i in range(6):       # only short work now: instances move back to the short group
            r.submit(_prompt(30, 10 + i), SamplingParams(max_tokens=1))
        await r.stop()
        return where, [g[1:] for g in r.stats.groups], r.group
    where, sizes, groups = run_simulated(main())
    assert where[0] in ("i2", "i3") and where[1] in ("i0", "i1")
    assert sizes == [(2, 2), (1, 3), (2, 2), (3, 1)]   # (short, long) after each move
    assert groups.count("long") == 1


def test_affinity_sends_a_follow_up_turn_to_its_history():
    async def main():
        r, _ = _router(3, "round-robin", affinity_ratio=0.5)
        await r.start()
        history = _prompt(200, 7)
        first = r.submit(history, SamplingParams(max_tokens=1))
        await first.result()
        r.submit(_prompt(20, 8), SamplingParams(max_tokens=1))   # moves the RR pointer on
        follow = r.submit(history + _prompt(20, 9), SamplingParams(max_tokens=1))
        await follow.result()
        await r.stop()
        return first.request.lane, follow.request.lane, follow.stats.cached_tokens
    lane_a, lane_b, cached = run_simulated(main())
    assert lane_a is lane_b and cached == 192  # 12 full pages of 16 tokens


@pytest.mark.parametrize("spill_s, expected", [(None, ["i1", "i1", "i0"]),
                                               (float("inf"), ["i1", "i1", "i1"])])
def test_length_aware_spills_long_work_to_an_idle_short_group(spill_s, expected):
    """Group [short i0, long i1]; three long prompts of about one full step each. The third
    finds i1 more than a full step busier than the idle i0 and spills (unless spill_s = inf)."""
    async def main():
        r, _ = _router(2, "length-aware", affinity_ratio=None, threshold=64, spill_s=spill_s,
                       rebalance_interval_s=1e9)
        await r.start()
        hs = [r.submit(_prompt(250, 20 + i), SamplingParams(max_tokens=1)) for i in range(3)]
        await r.stop()
        return [h.request.lane.executor.name.split("/")[0] for h in hs]
    assert run_simulated(main()) == expected


def test_generated_sessions_keep_their_lengths_at_any_rate():
    a = wl.load("lmsys", max_requests=90, seed=5, rate=2.0)
    b, scale = a.at_rate(8.0)
    assert scale == 1.0 and list(a.new_token_counts()) == list(b.new_token_counts())
    starts = lambda w: [s.arrival_s for s in w.sessions.sessions]
    assert starts(b)[-1] == pytest.approx(starts(a)[-1] / 4)


def _skewed_burst(policy: str) -> tuple[list, list]:
    """Four laps instances; six long prompts (1,024 tokens, ~0.43 s each alone) at once, then
    40 short ones (24 tokens) every 2 ms; SLO 5x each request's isolated prefill. The stats of
    the long requests and of the short ones."""
    async def main():
        clock = SimClock()
        ds = [build_dispatcher(spec("laps", long_chunk_ratio=0.25), CFG, MODEL, clock, f"i{i}")
              for i in range(4)]
        r = Router(ds, RouterConfig(policy=policy, affinity_ratio=None), clock)
        await r.start()
        hs = []
        for i, n in enumerate([1024] * 6 + [24] * 40):
            hs.append(r.submit(_prompt(n, 30 + i), SamplingParams(max_tokens=1),
                               slo=5 * MODEL.predict_prefill(n, 0)))
            if n == 24:
                await clock.sleep(0.002)
        stats = [await h.result() for h in hs]
        await r.stop()
        return stats[:6], stats[6:]
    return run_simulated(main())


def test_laps_beats_least_load_on_a_skewed_burst():
    """Least-load sends the short requests to the instances with the fewest pending tokens, two
    of which hold a long prompt each: every short request there waits behind long chunks and a
    growing short queue. laps prices a short request's wait as the short work ahead plus one
    long chunk, so it spreads them: none misses its SLO, and the long ones are not slower."""
    ll_long, ll_short = _skewed_burst("least-load")
    lp_long, lp_short = _skewed_burst("laps")
    missed = lambda st: sum(bool(s.slo_violated) for s in st)
    p90 = lambda st: sorted(s.ttft for s in st)[int(0.9 * len(st))]
    assert missed(lp_short) == 0 and missed(ll_short) >= 10
    assert p90(lp_short) < 0.6 * p90(ll_short)
    assert max(s.ttft for s in lp_long) < 1.1 * max(s.ttft for s in ll_long)


def test_a_short_request_costs_its_padded_row_once_rows_add_up():
    """On an H200 one short row alone is memory-bound (16 ms for 80 new tokens over a cached
    4k document) but eight of them are compute-bound: what a batch of them takes (the latency
    model on the real bucket) is about eight of the router's short costs, not one lone step."""
    from laps_jax.scheduler.latency_model import StepShape
    from laps_jax.sim import hardware
    from laps_jax.sim.instance import GridSpec, InstanceSpec

    src = hardware.roofline("qwen2.5-32b")
    clock = SimClock()
    inst = InstanceSpec("laps", GridSpec(), kv_cache_tokens=65536)
    ds = [build_dispatcher(inst, src.cfg, src.model, clock, f"i{i}") for i in range(2)]
    r = Router(ds, RouterConfig(policy="laps"), clock)
    grid = ds[0].lanes[0].executor.grid
    alone = src.model.predict_prefill(80, 3500)
    b = grid.fit_prefill(8, 80)
    batch = src.model.predict(StepShape.bucketed((80,) * 8, (3500,) * 8, b.batch, b.tokens))
    short = r.cost(80, 3500, True)
    assert batch > 4 * alone                       # rows are not free here
    assert short > alone / 8                       # so not the lone step's share
    assert 0.8 * batch <= 8 * short <= 1.25 * batch  # but about a row of the batch
    assert r.cost(3000, 0, False) == pytest.approx(src.model.predict_prefill(3000, 0))


# -- late binding of long requests (cluster/hold.py) ------------------------------------------
def test_a_long_request_waits_in_the_router_while_each_instance_has_a_step_ahead_of_it():
    """Two instances busy with a long prompt each (1,200 and 600 tokens, each over one full
    step). A larger long request waits in the router, and goes when the 600-token instance is
    under a step; a short request and a long one smaller than either go at once (each instance
    would run them first anyway). Without the hold every one is sent on arrival."""
    def run(hold: float):
        async def main():
            r, _ = _router(2, "least-load", hold_steps=hold, affinity_ratio=None)
            await r.start()
            p = SamplingParams(max_tokens=1)
            hs = {k: r.submit(_prompt(n, i), p) for i, (k, n) in
                  enumerate((("A", 1200), ("B", 600), ("X", 1800), ("S", 24), ("Y", 400)))}
            waiting = not hs["X"].bound.done() if hold else None
            st = {k: await h.result() for k, h in hs.items()}
            where = {k: h.request.lane.executor.name.split("/")[0] for k, h in hs.items()}
            held = r.metrics()["held"], r.metrics()["held_s"]
            await r.stop()
            return st, where, waiting, held
        return run_simulated(main())

    st, where, waiting, held = run(1.0)
    assert waiting
    assert held[0] == 1 and held[1] == pytest.approx(st["X"].submitted)  # X alone waited
    assert all(st[k].submitted == st[k].arrival == 0.0 for k in "ABSY")
    step = MODEL.predict_prefill(GRID.max_chunk, 0)
    b_done = st["B"].prefill_done
    # sent once B's instance had under a step ahead of it: B's last chunk (Y ran first)
    assert b_done - 1.5 * step <= st["X"].submitted <= b_done
    assert where["X"] == where["B"] != where["A"]
    st0, _, _, held0 = run(0.0)
    assert all(s.submitted == 0.0 for s in st0.values()) and held0 == (0, 0.0)


def test_a_long_request_with_room_on_arrival_is_placed_among_every_instance():
    """L (2,000 tokens) on one instance, M (700) on the other. N (1,200) has room where L
    is (it would overtake L) and none where M is (M runs first, over a step): it is not held,
    and the policy (least load) places it among both, with M, not only where the room is."""
    async def main():
        r, _ = _router(2, "least-load", hold_steps=1.0, affinity_ratio=None)
        await r.start()
        p = SamplingParams(max_tokens=1)
        hs = {k: r.submit(_prompt(n, i), p) for i, (k, n) in
              enumerate((("L", 2000), ("M", 700), ("N", 1200)))}
        for h in hs.values():
            await h.result()
        where = {k: h.request.lane.executor.name.split("/")[0] for k, h in hs.items()}
        await r.stop()
        return where, r.metrics()["held"]

    assert MODEL.predict_prefill(700, 0) > MODEL.predict_prefill(GRID.max_chunk, 0)
    where, held = run_simulated(main())
    assert held == 0 and where["N"] == where["M"] != where["L"]


def test_a_turn_whose_cached_history_outweighs_its_new_part_is_not_held():
    """Both instances busy with smaller long prompts (a step or more ahead of any 500-token
    request): a fresh 500-token prompt waits in the router, a follow-up turn with 500 new
    tokens over a cached 900-token history is bound at once (its holder is where it belongs)."""
    from laps_jax.cluster.inprocess import LateHandle

    async def main():
        r, _ = _router(2, "least-load", hold_steps=1.0, affinity_ratio=None)
        await r.start()
        p = SamplingParams(max_tokens=1)
        history = _prompt(900, 7)
        await r.submit(history, p).result()  # cached on its instance from now on
        busy = [r.submit(_prompt(200, 20 + i), p) for i in range(6)]  # within a step
        follow_up = r.submit(history + _prompt(500, 8), p)
        fresh = r.submit(_prompt(500, 9), p)
        late = isinstance(follow_up, LateHandle), isinstance(fresh, LateHandle)
        for h in (*busy, follow_up, fresh):
            await h.result()
        await r.stop()
        return late, r.metrics()["held"]

    (follow_up_held, fresh_held), held = run_simulated(main())
    assert fresh_held and not follow_up_held and held == 1


def test_late_binding_misses_fewer_slos_on_an_overloaded_mix_of_long_prompts():
    """Two instances, a random mix of short and long prompts arriving faster than they can be
    served (five seeds): bound on arrival, a long request waits behind whatever was sent to
    its instance before it; held, it goes where room opens first. Fewer misses pooled, and a
    shorter worst TTFT, for the plain and the laps rule."""
    import random

    def burst(policy: str, hold: float, seed: int) -> tuple[int, float]:
        rng = random.Random(seed)

        async def main():
            r, clock = _router(2, policy, hold_steps=hold, affinity_ratio=None)
            await r.start()
            hs = []
            for i in range(24):
                n = rng.choice([24, 40, 300, 600, 1200, 1800])
                hs.append(r.submit(_prompt(n, 100 + i), SamplingParams(max_tokens=1),
                                   slo=5 * MODEL.predict_prefill(n, 0)))
                await clock.sleep(rng.expovariate(1 / 0.03))
            st = [await h.result() for h in hs]
            await r.stop()
            return sum(bool(s.slo_violated) for s in st), max(s.ttft for s in st)
        return run_simulated(main())

    for policy in ("least-load", "laps-inflow"):
        bound = [burst(policy, 0.0, s) for s in range(5)]
        held = [burst(policy, 1.0, s) for s in range(5)]
        assert sum(m for m, _ in held) <= 0.8 * sum(m for m, _ in bound)
        assert sum(t for _, t in held) < 0.8 * sum(t for _, t in bound)


def test_simulate_run_takes_a_held_policy_and_reports_what_it_held(tmp_path, capsys):
    """`simulate.py run --policy NAME+hold` binds long requests late, as route-screen's
    policies do, and its router reports how many it held; a misspelt NAME is a usage error
    that names the policies, not a traceback."""
    import json
    from conftest import load_script
    sim = load_script("simulate")
    held = {}
    for policy in ("laps-inflow", "laps-inflow+hold"):
        out = tmp_path / f"{policy}.json"
        args = sim.parse(["run", "--workload", "code-complete", "--instances", "2", "--load",
                          "1.3", "--requests", "30", "--policy", policy, "--output", str(out)])
        assert args.func(args) == 0
        router = json.loads(out.read_text())["router"]
        assert router["policy"] == "laps-inflow"
        held[policy] = router["held"], router["held_s"]
    capsys.readouterr()
    assert held["laps-inflow"] == (0, 0.0)
    assert held["laps-inflow+hold"][0] > 0 and held["laps-inflow+hold"][1] > 0
    assert sim.main(["run", "--instances", "2", "--policy", "laps-inflo+hold"]) == 2
    err = capsys.readouterr().err
    assert "laps-inflo" in err and "laps-inflow" in err and "Traceback" not in err
