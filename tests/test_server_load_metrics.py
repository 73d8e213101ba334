"""/metrics reports load the way routers read it: the model-server protocol's queued and running
requests and KV-cache use (scraped by a Prometheus text parser), and the prompt tokens still to
prefill per pool; all back to zero when the work is done. /load answers the same gauges in
one read, with /health's status."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import random
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inproc_server import MODEL, serving

from laps_jax.cluster.upstream import parse_load, parse_metrics


@pytest.fixture(scope="module")
def srv(engine_for):
    with serving(engine_for) as s:
        yield s


def scrape(srv) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def pending(m: dict) -> dict[str, float]:
    return {dict(k[1])["pool"]: v for k, v in m.items() if k[0] == "laps_pending_prefill_tokens"}


def test_queued_running_kv_and_pending_tokens(srv):
    engine = srv.engine
    gate, entered = threading.Event(), threading.Event()
    prefill = engine.prefill

    def held(*a, **kw):  # the first step waits until the test has looked
        entered.set()
        gate.wait(30)
        return prefill(*a, **kw)

    rng = random.Random(time.time_ns())
    lengths = [7, 40, 90, 150]
    prompts = [[rng.randrange(3, 900) for _ in range(n)] for n in lengths]
    engine.prefill = held
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            first = pool.submit(srv.post, "/v1/completions",
                                {"model": MODEL, "prompt": prompts[0], "max_tokens": 4})
            assert entered.wait(30)
            rest = [pool.submit(srv.post, "/v1/completions",
                                {"model": MODEL, "prompt": p, "max_tokens": 4})
                    for p in prompts[1:]]
            deadline = time.time() + 10
            while time.time() < deadline:  # until the others have reached the dispatcher
                m = scrape(srv)
                if value(m, "vllm:num_requests_waiting") == len(prompts):
                    break
                time.sleep(0.05)
            # the lane is inside the first step: nothing has finished a prefill yet
            assert value(m, "vllm:num_requests_waiting") == len(prompts)
            assert value(m, "vllm:num_requests_running") == 0
            by_pool = pending(m)
            assert sum(by_pool.values()) == sum(lengths)  # nothing of these prompts is cached
            assert by_pool["admission"] == sum(lengths[1:])  # the others wait to be admitted
            usage = value(m, "vllm:kv_cache_usage_perc")
            assert 0.0 < usage < 0.05  # the first request's pages, of 4,096
            info = [k for k in m if k[0] == "vllm:cache_config_info"]
            assert dict(info[0][1])["block_size"] == str(engine.kv.page_size)
            assert int(dict(info[0][1])["num_gpu_blocks"]) == engine.kv.num_pages - 1
            # a router's one-read poll (/load) reads the same report as from /metrics
            # (all the router routes by; not the pages and stalls only /metrics has)
            from_load = parse_load(read(srv, "/load")[1])
            from_metrics = parse_metrics(read(srv, "/metrics")[1].decode())
            assert from_load == dataclasses.replace(from_metrics, pages_used=None,
                                                    loop_stalls=None)
            assert from_load.pending_tokens == sum(lengths)
            gate.set()
            answers = [first.result(60)] + [f.result(60) for f in rest]
    finally:
        gate.set()
        del engine.prefill
    assert [a[0] for a in answers] == [200] * len(prompts)
    deadline = time.time() + 10
    while time.time() < deadline and value(scrape(srv), "vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.05)
    m = scrape(srv)
    assert value(m, "vllm:num_requests_waiting") == value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0
    assert set(pending(m).values()) == {0.0}


def read(srv, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(srv.url + path, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_load_answers_as_health_does(srv):
    """/load is /health's answer with the gauges: 503 and why while draining, no gauges."""
    status, body = read(srv, "/load")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert parse_load(body).threshold == srv.dispatcher.derived.threshold(0)
    srv.state.draining = True
    try:
        status, body = read(srv, "/load")
        health = read(srv, "/health")
    finally:
        srv.state.draining = False
    assert (status, json.loads(body)) == (503, {"status": "draining"})
    assert health[0] == 503


def test_threshold_and_long_chunk_are_the_scheduler_s_own(srv):
    """What a router reads as the instance's short/long cut and long chunk is what its laps
    scheduler runs with, not a second estimate."""
    m = scrape(srv)
    derived = srv.dispatcher.derived
    assert value(m, "laps_short_threshold_tokens") == derived.threshold(0)
    chunk = value(m, "laps_long_chunk_tokens")
    assert chunk == derived.long_budget
    assert 0 < chunk <= derived.budget  # one long step's tokens (several chunks may share it)


def test_event_loop_stalls_are_exported(srv):
    """The loop watch's counts are in /metrics (a stall is visible to whoever scrapes, not
    only in the log): a count, and the worst stall, zero exactly when nothing stalled."""
    m = scrape(srv)
    stalls = value(m, "laps_event_loop_stalls_total")
    worst = value(m, "laps_event_loop_worst_stall_seconds")
    assert stalls >= 0 and (stalls == 0) == (worst == 0)
