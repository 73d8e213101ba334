"""Where a simulated run's misses are (sim/miss_split.py): hand-made request stats, and a
routed burst whose split is checked against where each request's executor says it ran."""

from __future__ import annotations

from laps_jax.cluster.inprocess import Router, RouterConfig
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.scheduler.request import RequestStats
from laps_jax.sim.instance import build_dispatcher
from laps_jax.sim.miss_split import line, miss_split
from sim_fixtures import CFG, MODEL, spec


def stat(rid: str, arrival: float, pool: str, cached: int, ttft: float | None,
         slo: float | None = 1.0) -> RequestStats:
    s = RequestStats(rid, arrival, 100, new_tokens=100 - cached, cached_tokens=cached,
                     pool=pool, slo_s=slo)
    s.first_token = None if ttft is None else arrival + ttft
    return s


def test_hand_made_misses_split_by_kind_instance_and_window():
    stats = [stat("a", 1.0, "short", 0, 0.5), stat("b", 1.0, "short", 64, 2.0),
             stat("c", 2.0, "long", 0, 3.0), stat("d", 2.0, "long", 0, 0.1),
             stat("e", 2.0, "short", 64, 9.0, slo=None),   # no SLO: not counted
             stat("f", 9.0, "long", 0, 5.0),               # after the window
             stat("g", 2.0, "short", 64, 4.0)]             # placed nowhere known
    placed = {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0, "f": 1}
    got = miss_split(stats, placed, 2, window=(0.5, 5.0))
    assert got["kinds"] == {"long/uncached": [1, 2], "short/cached": [2, 2],
                            "short/uncached": [0, 1]}
    assert got["instances"] == [[0, 2], [2, 2]]
    assert miss_split(stats, None, 2)["instances"] == [[0, 0], [0, 0]]
    assert line(got) == ("long/uncached 1/2, short/cached 2/2, short/uncached 0/1; "
                         "by instance 0/2 2/2")


def test_a_routed_burst_is_split_where_its_executors_ran_it():
    """Four laps instances, least-load, six long prompts then 40 short ones every 2 ms: the
    split's per-instance counts are those of the executors that ran each request, and its
    misses those of the requests' own stats."""
    async def main():
        clock = SimClock()
        ds = [build_dispatcher(spec("laps", long_chunk_ratio=0.25), CFG, MODEL, clock, f"i{i}")
              for i in range(4)]
        r = Router(ds, RouterConfig(policy="least-load", affinity_ratio=None), clock)
        await r.start()
        hs = []
        for i, n in enumerate([1024] * 6 + [24] * 40):
            prompt = [10 + ((30 + i) * 977 + j * 13) % 400 for j in range(n)]
            hs.append(r.submit(prompt, SamplingParams(max_tokens=1), request_id=f"r{i}",
                               slo=5 * MODEL.predict_prefill(n, 0)))
            if n == 24:
                await clock.sleep(0.002)
        stats = [await h.result() for h in hs]
        ran = [int(h.request.lane.executor.name.split("/")[0][1:]) for h in hs]
        await r.stop()
        return stats, ran, r.placed
    stats, ran, placed = run_simulated(main())
    got = miss_split(stats, placed, 4)
    for i in range(4):
        mine = [s for s, k in zip(stats, ran) if k == i]
        assert got["instances"][i] == [sum(bool(s.slo_violated) for s in mine), len(mine)]
    short = [s for s in stats if s.pool == "short"]
    assert got["kinds"]["short/uncached"] == [sum(bool(s.slo_violated) for s in short), 40]
    assert got["kinds"]["short/uncached"][0] >= 10  # least-load's short misses (see
    # test_sim_router.test_laps_beats_least_load_on_a_skewed_burst)
