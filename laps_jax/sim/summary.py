"""The numbers a simulated run reports, with its throughput next to the physical limit.

`summarize_requests` gives the fields of one mode's requests that compare_modes reports too (the
harness imports it from here: bench may import sim, never the reverse); `summarize` adds the
prefill side.

Prefill throughput is split three ways, because a tokens-per-second figure means nothing
without it: *computed* tokens (new tokens the device actually ran through the model),
*cached* tokens (prompt tokens found in the prefix cache: no compute at all) and *padded*
tokens (bucket padding: compute spent on nothing). Only computed tokens are bounded by the
device: one H200 at 790 TFLOP/s over 65.5 GFLOP per Qwen2.5-32B token computes at most about
12,000 tokens/s, so a prompt rate above that can only come from cache hits.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from laps_jax.scheduler.request import LONG, SHORT, RequestStats
from laps_jax.sim.driver import RunResult, RunSpec, sim_executors
from laps_jax.sim.hardware import ModelSource


def _ok(s: RequestStats) -> bool:
    return s.finish_reason in ("length", "stop") and s.prefill_done is not None


def _ms(xs: list[float], q: float | None = None) -> float | None:
    if not xs:
        return None
    return 1e3 * float(np.mean(xs) if q is None else np.percentile(xs, q))


def in_window(stats: Iterable[RequestStats], window: tuple[float, float] | None
              ) -> list[RequestStats]:
    """The requests that arrived in the steady-state `window` (all of them without one)."""
    if window is None:
        return list(stats)
    lo, hi = window
    return [s for s in stats if lo <= s.arrival <= hi]


def summarize_requests(stats: Iterable[RequestStats]) -> dict:
    """The comparison fields (and a few more) for one mode's requests."""
    stats = list(stats)
    done = [s for s in stats if s.finish_reason in ("length", "stop") and s.ttft is not None]
    ttft = [s.ttft for s in done]
    short = [s.ttft for s in done if s.pool == SHORT]
    long = [s.ttft for s in done if s.pool == LONG]
    prefill = [s.prefill_latency for s in done]
    with_slo = [s for s in stats if s.slo_s is not None]
    t0 = min((s.arrival for s in stats), default=0.0)
    t1 = max((s.finished or s.arrival for s in stats), default=0.0)
    tokens = sum(s.new_tokens + s.output_tokens for s in done)
    return {
        "ttft_ms_p50": _ms(ttft, 50), "ttft_ms_p90": _ms(ttft, 90),
        "ttft_ms_p99": _ms(ttft, 99), "ttft_ms_mean": _ms(ttft),
        "ttft_short_ms_p50": _ms(short, 50), "ttft_short_ms_p90": _ms(short, 90),
        "ttft_long_ms_p50": _ms(long, 50), "ttft_long_ms_p90": _ms(long, 90),
        "prefill_latency_ms_mean": _ms(prefill),
        "slo_violation_rate": (sum(bool(s.slo_violated) for s in with_slo) / len(with_slo)
                               if with_slo else None),
        "throughput_tokens_per_s": tokens / (t1 - t0) if t1 > t0 else None,
        "completed": len(done), "failed": len(stats) - len(done),
        "short_requests": sum(s.pool == SHORT for s in done),
        "long_requests": sum(s.pool == LONG for s in done),
        "cached_tokens": sum(s.cached_tokens for s in done),
        "makespan_s": t1 - t0,
    }


def summarize(result: RunResult, spec: RunSpec, src: ModelSource) -> dict:
    """compare_modes' fields (`summarize_requests`) plus the prefill-side figures.

    Closed-loop sessions ramp up and drain; their figures cover only requests arriving in the
    steady-state window (the others still ran, as load), throughput over the window's length."""
    stats = in_window(result.stats, result.window)
    out = summarize_requests(stats)
    done = [s for s in stats if _ok(s)]
    if not done:
        return out
    t0 = min(s.arrival for s in stats)
    t1 = max(s.prefill_done for s in done)
    if result.window is not None:
        t0, t1 = result.window
    span = max(t1 - t0, 1e-9)
    # throughput: prefills that completed inside [t0, t1], whenever they arrived
    served = [s for s in result.stats if _ok(s) and t0 <= s.prefill_done <= t1]
    execs = sim_executors(result)
    computed = sum(s.new_tokens for s in served)
    cached = sum(s.cached_tokens for s in served)
    padded = sum(ex.bucket_tokens - ex.real_tokens for ex in execs)
    whole = result.end_time if result.window is not None else span  # executor totals cover it
    devices = spec.instances * spec.instance.devices
    limit = src.limit_tokens_per_s * devices if src.limit_tokens_per_s else None
    prefill = [s.prefill_latency for s in done]
    met = [s for s in served if s.slo_s is not None and not s.slo_violated]
    out.update({
        "offered_rps": spec.rate, "window": result.window, "concurrency": spec.concurrency, "time_scale":
        result.time_scale, "instances": spec.instances, "devices": devices,
        "prefill_latency_ms_p50": _ms(prefill, 50), "prefill_latency_ms_p90": _ms(prefill, 90),
        "prefill_latency_short_ms_mean": _ms([s.prefill_latency for s in done
                                              if s.pool == SHORT]),
        "prefill_latency_long_ms_mean": _ms([s.prefill_latency for s in done if s.pool == LONG]),
        "prefill_span_s": span,
        "requests_per_s": len(served) / span,
        "goodput_rps": len(met) / span,
        "computed_tokens": computed, "cached_tokens": cached, "padded_tokens_all": padded,
        "computed_tok_s": computed / span, "cached_tok_s": cached / span,
        "padded_tok_s": padded / whole, "prompt_tok_s": (computed + cached) / span,
        "cache_hit_fraction": cached / max(computed + cached, 1),
        "physical_limit_tok_s": limit,
        "computed_share_of_limit": computed / span / limit if limit else None,
        "device_busy_fraction": (sum(ex.busy_s for ex in execs)
                                 if spec.instance.mode != "laps-spatial"
                                 or spec.instance.spatial_devices == 2
                                 else _shared_busy(result)) / (whole * devices),
        "steps": sum(ex.steps for ex in execs),
    })
    if limit and out["computed_tok_s"] > limit * 1.03:  # roofline: 64.0 GFLOP + attention
        out["warning"] = "computed tokens/s above the physical limit: check the latency model"
    return out


def _shared_busy(result: RunResult) -> float:
    seen, busy = set(), 0.0
    for ex in sim_executors(result):
        if ex.device is not None and id(ex.device) not in seen:
            seen.add(id(ex.device))
            busy += ex.device.busy_s
    return busy


def compact(s: dict) -> dict:
    """The headline fields, for tables and the progress log."""
    keys = ("ttft_ms_p50", "ttft_ms_p90", "ttft_short_ms_p90", "ttft_long_ms_p90",
            "prefill_latency_ms_mean", "slo_violation_rate", "computed_tok_s", "cached_tok_s",
            "physical_limit_tok_s", "requests_per_s", "completed", "failed")
    return {k: s.get(k) for k in keys}
