"""Prometheus metrics for /metrics: request counters and latency histograms, plus gauges read
from the dispatcher and the engines at scrape time.

Load for routers: the Gateway API Inference Extension's model-server protocol asks for queued
requests, running requests and KV-cache utilisation (and, optionally, the cache's block size
and block count), and its endpoint picker scrapes them by default under vLLM's names, which
the protocol lists as the recommended ones. They are exported under those names, so any
gateway that speaks the protocol balances over laps_jax instances unchanged; beside them,
`laps_pending_prefill_tokens{pool}` is the load a length-aware router balances on: prompt
tokens still to prefill, per pool, with requests not yet admitted counted whole.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Live:
    """Gauges that come from the dispatcher's snapshot and the engines' KV managers."""

    def __init__(self, dispatcher, engines):
        self.dispatcher, self.engines = dispatcher, engines

    def collect(self):
        m = self.dispatcher.metrics()
        yield from self.protocol(m)
        q = GaugeMetricFamily("laps_queue_length", "Requests waiting, per pool", labels=["pool"])
        pools = sorted({p for lane in m.lanes for p in lane.queue_lengths})
        for pool in pools:
            q.add_metric([pool], m.queue_length(pool))
        yield q
        yield GaugeMetricFamily("laps_running_requests", "Requests admitted and not finished",
                                value=m.running)
        yield GaugeMetricFamily("laps_compiles_after_warmup",
                                "XLA compiles after warm-up (a bug when above 0)",
                                value=m.compiles_after_warmup)
        used = GaugeMetricFamily("laps_kv_pages_used", "KV pages held by live sequences",
                                 labels=["engine"])
        free = GaugeMetricFamily("laps_kv_pages_free", "KV pages free or evictable",
                                 labels=["engine"])
        hits = CounterMetricFamily("laps_prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache", labels=["engine"])
        pad = GaugeMetricFamily("laps_padding_fraction", "Padded share of bucket tokens",
                                labels=["engine"])
        buckets = CounterMetricFamily("laps_bucket_steps", "Steps run per bucket",
                                      labels=["engine", "batch", "tokens"])
        for i, eng in enumerate(self.engines):
            name = str(i)
            used.add_metric([name], eng.kv.num_used)
            free.add_metric([name], eng.kv.num_free)
            hits.add_metric([name], eng.kv.hit_tokens)
            stats = eng.runner.stats
            pad.add_metric([name], stats.padding_fraction)
            for b, n in sorted(stats.steps.items()):
                buckets.add_metric([name, str(b.batch), str(b.tokens)], n)
        yield from (used, free, hits, pad, buckets)
        for lane in m.lanes:
            c = lane.counters
            for kind, hist in (("prefill", c.prefill_batch_sizes), ("decode", c.decode_batch_sizes)):
                fam = CounterMetricFamily(f"laps_{kind}_batches",
                                          f"{kind} steps by batch size", labels=["lane", "size"])
                for size, n in sorted(hist.items()):
                    fam.add_metric([lane.name, str(size)], n)
                yield fam
        seconds = CounterMetricFamily(
            "laps_lane_seconds", "Seconds each lane spent in prefill steps, decode steps, and "
            "around steps on the host (admission, planning, thread hops)", labels=["lane", "kind"])
        for lane in m.lanes:
            c = lane.counters
            for kind, v in (("prefill", c.prefill_seconds), ("decode", c.decode_seconds),
                            ("host", c.host_seconds)):
                seconds.add_metric([lane.name, kind], v)
        yield seconds
        for name, text, attr in LANE_COUNTERS:
            fam = CounterMetricFamily(name, text, labels=["lane"])
            for lane in m.lanes:
                fam.add_metric([lane.name], getattr(lane.counters, attr))
            yield fam
        waits = CounterMetricFamily("laps_window_waits", "Short-pool waiting-window waits",
                                    labels=["lane"])
        for lane in m.lanes:
            waits.add_metric([lane.name], lane.window_waits)
        yield waits

    def protocol(self, m):
        """The model-server protocol's gauges and the pending prefill tokens per pool."""
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued for prefill "
                                "(in a pool or not yet admitted)", value=m.waiting)
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests past their prefill, "
                                "decoding", value=max(m.running - m.waiting, 0))
        used = sum(e.kv.num_used for e in self.engines)
        total = sum(e.kv.num_used + e.kv.num_free for e in self.engines)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of KV pages held by live "
                                "sequences (0-1)", value=used / total if total else 0.0)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache layout",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(self.engines[0].kv.page_size), str(total)], 1.0)
        yield info
        pending = GaugeMetricFamily("laps_pending_prefill_tokens", "Prompt tokens still to "
                                    "prefill, per pool (admission: not yet admitted, whole "
                                    "prompts)", labels=["pool"])
        for pool in sorted({p for lane in m.lanes for p in lane.pending_prefill_tokens}):
            pending.add_metric([pool], m.pending_tokens(pool))
        yield pending
        yield GaugeMetricFamily("laps_short_threshold_tokens", "New tokens at or under which a "
                                "request with no cached prefix is short (this instance's "
                                "latency-model cut; routers read it)",
                                value=self.dispatcher.derived.threshold(0))
        yield GaugeMetricFamily("laps_long_chunk_tokens", "Prompt tokens of one long-pool "
                                "step: what a short request admitted behind long work waits "
                                "out (routers read it)",
                                value=self.dispatcher.derived.long_budget)


# per-lane counters: (metric name, help, LaneCounters attribute)
LANE_COUNTERS = (
    ("laps_kv_handoffs", "Requests whose K/V moved into this lane to decode (laps-spatial)",
     "handoffs_in"),
    ("laps_filled_long_tokens", "Long-prompt tokens prefilled in the empty bucket rows of short "
     "batches (laps)", "filled_long_tokens"),
    ("laps_overload_long_steps", "Long-pool steps widened past the long chunk because more "
     "long requests waited than the overload mark (laps)", "overload_long_steps"),
)


class ServerMetrics:
    def __init__(self, dispatcher, engines):
        self.registry = CollectorRegistry()
        self.requests = Counter("laps_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("laps_ttft_seconds", "Time to first token", ["pool"],
                              buckets=BUCKETS, registry=self.registry)
        self.e2e = Histogram("laps_e2e_seconds", "End-to-end request latency", ["pool"],
                             buckets=BUCKETS, registry=self.registry)
        self.live = _Live(dispatcher, engines)
        self.registry.register(self.live)

    def observe(self, stats) -> None:
        pool = stats.pool or "unknown"
        if stats.ttft is not None:
            self.ttft.labels(pool).observe(stats.ttft)
        if stats.finished is not None:
            self.e2e.labels(pool).observe(stats.finished - stats.arrival)

    def load_gauges(self) -> list[list]:
        """The gauges routers read (the model-server protocol's and the pending prefill tokens,
        threshold and long chunk) as [name, labels, value], for /load."""
        return [[s.name, s.labels, s.value]
                for fam in self.live.protocol(self.live.dispatcher.metrics()) for s in fam.samples]

    def render(self) -> bytes:
        return generate_latest(self.registry)
