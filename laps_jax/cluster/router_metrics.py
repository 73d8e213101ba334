"""The router's own /metrics: requests by endpoint and status (the counter serve.py's middleware
counts into), and per instance its health, load, requests in flight and requests routed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from laps_jax.cluster.hold import held_counts


class _Instances:
    def __init__(self, router):
        self.router = router

    def collect(self):
        r = self.router
        healthy = GaugeMetricFamily("laps_router_instance_healthy",
                                    "1 while the instance is in the rotation", labels=["instance"])
        load = GaugeMetricFamily("laps_router_instance_load_tokens",
                                 "Pending prefill tokens: the instance's last report plus what "
                                 "the router sent it since", labels=["instance"])
        inflight = GaugeMetricFamily("laps_router_instance_inflight",
                                     "Requests in flight through the router", labels=["instance"])
        routed = CounterMetricFamily("laps_router_routed", "Requests routed to the instance",
                                     labels=["instance"])
        for inst in r.instances:
            healthy.add_metric([inst.url], float(inst.healthy))
            load.add_metric([inst.url], inst.load.load)
            inflight.add_metric([inst.url], len(inst.inflight))
            routed.add_metric([inst.url], inst.routed)
        yield from (healthy, load, inflight, routed)
        s = r.policy.stats
        yield CounterMetricFamily("laps_router_by_affinity",
                                  "Requests sent where their prefix is cached", value=s.by_affinity)
        yield CounterMetricFamily("laps_router_far_behind",
                                  "laps-adaptive: requests placed by requests in flight because "
                                  "every instance was three long chunks behind", value=s.behind)
        yield CounterMetricFamily("laps_router_group_moves",
                                  "Instances moved between the short and long groups",
                                  value=s.moves)
        yield GaugeMetricFamily("laps_router_held_requests",
                                "Requests waiting in the router for an instance below the hold "
                                "(--hold-tokens)",
                                value=len(r.hold.held) if r.hold is not None else 0)
        yield CounterMetricFamily("laps_router_held",
                                  "Requests that waited in the router for an instance below the "
                                  "hold (--hold-tokens)",
                                  value=held_counts(r.hold)[0])
        yield CounterMetricFamily("laps_router_held_seconds",
                                  "Seconds the released held requests waited in the router",
                                  value=held_counts(r.hold)[1])


class RouterMetrics:
    def __init__(self, router):
        self.registry = CollectorRegistry()
        self.requests = Counter("laps_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.registry.register(_Instances(router))
        self.retries = Counter("laps_router_retries", "Requests sent to another instance after "
                               "theirs failed before any byte reached the client",
                               registry=self.registry)
        self.resumes = Counter("laps_router_resumes", "Streams resumed on another instance "
                               "after theirs failed mid-way (cluster/failover.py)",
                               registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
