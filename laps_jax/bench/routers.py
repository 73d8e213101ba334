"""The live router benchmark: the same arrivals through each router in front of the same
serve.py instances (scripts/bench_routers.py is its command line).

Instances start once, each held to one CPU thread (`router_procs.ONE_THREAD_XLA_FLAGS`;
optionally pinned to a core with `taskset`), and stay up for the whole run; routers start and
stop in turn in front of them. Before each router's replay every instance's prefix cache is flushed
(`POST /flush_cache`), so no router inherits the history another one placed: restarting the
instances would do the same but costs a full compile per router (minutes each on the CPU).
Each router is a fresh process, so its own cache index starts empty too.

Routers: ours (`scripts/router.py --policy P`; any policy it knows) and the SGLang Model
Gateway (`smg launch --policy P`). Through smg the replay speaks SGLang's `/generate` with
token ids (smg's `/v1/completions` takes string prompts only); through ours, OpenAI's
`/v1/completions` with token ids; the instances run the same engine path for both.
The order of routers changes every round (`order.round_order`: each odd round reverses the
one before, each pair starts one rotation on) so neither a drifting machine nor what one
replay leaves for the next always favours the same one. Figures:
`workload.http_compare.mode_row`, with the SLO of each request `scale` x its measured isolated
TTFT as in the simulator (`isolated.py`), and beside it the share over one
fixed TTFT target (failures count as violations of both), and the violations by new-token band
(`bands.py`: which requests a router wins or loses); `summarize` gives each figure's median and
range over rounds, the median of per-round ratios against the reference routers, and the
pooled counts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import glob
import json
import os
import urllib.request
from types import SimpleNamespace

import numpy as np

from laps_jax.bench.bands import by_band, over_target, pooled_bands
from laps_jax.bench.cpu_meter import CpuMeter, process_seconds
from laps_jax.bench.instance_steps import per_request, summed
from laps_jax.bench.isolated import IsolatedTTFT
from laps_jax.bench.placement import busiest_share, placement
from laps_jax.bench.report import median_ratio, ratio
from laps_jax.bench.router_procs import Process, RouterSpec, flush_caches, start_router
from laps_jax.cluster.upstream import parse_metrics
from laps_jax.workload.http_client import ReplayConfig
from laps_jax.workload.http_compare import mode_row
from laps_jax.workload.http_replay import replay
from laps_jax.bench.load_groups import by_load
from laps_jax.workload.records import Trace

# what a router is judged on, and which way is better
FIGURES = ("slo_violation_rate", "fixed_slo_violation_rate", "prefill_latency_ms_mean",
           "ttft_ms_p90", "ttft_short_ms_p90", "throughput_tokens_per_s", "completed", "failed",
           "router_cpu_ms_per_request", "loop_stalls", "instances_prefill_ms_per_request",
           "busiest_prefill_share")
REFERENCES = ("round-robin", "smg:cache_aware")
# "round-robin" is plain data parallelism (#24's baseline): ours without its prefix-affinity rule
DEFAULT_ROUTERS = ("round-robin=round-robin --no-affinity", "least-load", "laps",
                   "smg:cache_aware", "smg:round_robin")
def figures(result, slo_ms: float, target_ms=None) -> dict:
    """`mode_row`'s figures, where `slo_violation_rate` counts TTFT over each request's own
    target `target_ms(record)` (`isolated.py`) when given, and `fixed_slo_violation_rate`
    over the one `slo_ms` for all (a failed request is a violation of both)."""
    row = mode_row(result, slo_ms)
    row["fixed_slo_violation_rate"] = row["slo_violation_rate"]
    target = target_ms or (lambda r: slo_ms)
    reqs = result.requests
    row["slo_violations"] = sum(over_target(r, target) > 1 for r in reqs)
    if target_ms is not None:
        row["slo_violation_rate"] = row["slo_violations"] / max(len(reqs), 1)
        row["bands"] = by_band(reqs, target)
    return row


def run_round(work, instances: list[Process], routers: list[RouterSpec], slo_ms: float,
              short_threshold: int, log_dir: str, log=print, tag: str = "",
              target_ms=None) -> dict[str, dict]:
    """One replay of `work` through each router in turn: {router name: figures}. With a
    `tag`, every request's record (and our routers' final /router/status: routes, groups,
    moves) goes to `log_dir/requests_TAG_ROUTER.jsonl`, to see why a router missed, and the
    router's own log to `log_dir/router_TAG_ROUTER.log` (one per replay)."""
    urls = [p.url for p in instances]
    out = {}
    for spec in routers:
        flush_caches(urls)
        router = start_router(spec, urls, log_dir, tag)
        status = None
        pids = {"router": [router.proc.pid], "instances": [p.proc.pid for p in instances],
                "client": [os.getpid()]}  # (the replay runs in this process)
        try:
            before = metrics_texts(urls)
            cpu0 = _cpu(pids)
            with CpuMeter() as meter:
                result = asyncio.run(replay(router.url, work, ReplayConfig(
                    short_threshold=short_threshold, progress=False, api=spec.api)))
            cpu1 = _cpu(pids)
            after = metrics_texts(urls)
            status = _router_status(router.url) if spec.kind == "laps" else None
            # our router counts its event-loop stalls too (smg does not)
            mine = metrics_texts([router.url]) if spec.kind == "laps" else []
        finally:
            router.stop()
        if tag:
            _write_records(records_path(log_dir, tag, spec.name), result.requests, status)
        out[spec.name] = figures(result, slo_ms, target_ms)
        where = placement(result.requests, urls)  # per instance: requests, tokens
        if where is not None:
            out[spec.name]["placement"] = where
            out[spec.name]["busiest_prefill_share"] = busiest_share(where)
        out[spec.name]["steal_share"] = meter.steal  # the hypervisor's share of the cores
        stalls0 = stalls_of(before)
        stalls = stalls_of(None if after is None or mine is None else after + mine)
        if stalls is not None and stalls0 is not None:  # event-loop stalls during the replay:
            out[spec.name]["loop_stalls"] = stalls - stalls0  # instances', and our router's
        for who in pids:  # CPU per request of the router, the instances, the client: they
            if cpu0[who] is not None and cpu1[who] is not None:  # share the cores
                out[spec.name][f"{who}_cpu_ms_per_request"] = (
                    1000 * (cpu1[who] - cpu0[who]) / max(len(result.requests), 1))
        out[spec.name].update(per_request(summed(before), summed(after), len(result.requests)))
        errors = failure_counts(result.requests)
        if errors:  # kept in routers.json: a failure is a violation, and its cause matters
            out[spec.name]["errors"] = errors
        log(f"  {spec.name}: " + ", ".join(f"{k}={v}" for k, v in out[spec.name].items()
                                           if k != "errors")
            + (f"; errors: {errors}" if errors else ""))
    return out


def round_tag(trace: str, round_no: int, block_no: int = 0) -> str:
    """The tag of a trace's round (1-based), and block in it (1-based; 0: not cut), in its
    replays' file names."""
    return f"{trace}_r{round_no}" + (f"b{block_no}" if block_no else "")


def blocks(work: Trace, size: int) -> list[Trace]:
    """`work` cut into consecutive parts of `size` requests (0: one part, the whole), each
    part's arrivals moved to start at 0 with the trace's own gaps. Every router replays a part
    in turn before the next part starts (`bench_routers.py --block`), so the replays compared
    are a minute apart, not a whole round: on a machine whose speed moves by a third within a
    round (docs/BENCHMARKS.md, "Router"), that is the difference between comparing routers
    and comparing moments. A sessions trace replays whole (one part): its turns wait on their
    answers, so a cut would change the arrivals."""
    if size < 0:
        raise ValueError(f"block size must be >= 0, got {size}")
    if not isinstance(work, Trace) or size == 0 or size >= len(work.requests):
        return [work]
    reqs = work.requests
    out = []
    for k in range(0, len(reqs), size):
        part = reqs[k:k + size]
        t0 = part[0].arrival_s
        out.append(dataclasses.replace(
            work, source=f"{work.source} [{k}:{k + len(part)}]",
            requests=[dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in part]))
    return out


def records_path(log_dir: str, tag: str, router: str) -> str:
    """Where `run_round` writes one replay's per-request records (scripts/bench_router_bands.py
    reads them back)."""
    return os.path.join(log_dir, f"requests_{tag}_{router.replace(':', '_')}.jsonl")


RUN_FILE = "routers.json"  # a run's settings, isolated TTFT and every round's figures


def read_run(run_dir: str) -> dict:
    """A bench_routers.py output dir's RUN_FILE (the scripts that read a finished run back),
    or a clear error naming the dir or file."""
    path = os.path.join(run_dir, RUN_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"{run_dir}: no {RUN_FILE} (not a bench_routers.py output dir)")
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not JSON ({e})")


def replay_records(run_dir: str, trace: str, round_no: int, router: str) -> list | None:
    """One finished replay's per-request records (`records_path`, in the run's newest
    bench_routers_* log dir) as objects with the records' fields; None when not on disk."""
    logs = sorted(glob.glob(os.path.join(run_dir, "bench_routers_*")), key=os.path.getmtime)
    path = records_path(logs[-1], round_tag(trace, round_no), router) if logs else ""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return [SimpleNamespace(**r) for r in map(json.loads, f) if "request_id" in r]


def run_targets(run: dict):
    """The run's own per-request TTFT target in ms (`--slo-scale` x the isolated TTFT it
    measured at the request's new tokens), or None when it timed none (--slo-scale 0)."""
    if not run.get("isolated_ttft") or not run["args"].get("slo_scale"):
        return None
    iso, scale = IsolatedTTFT.from_json(run["isolated_ttft"]), run["args"]["slo_scale"]
    return lambda r: scale * iso(r.new_tokens)


def _cpu(pids: dict[str, list[int]]) -> dict[str, float | None]:
    """CPU seconds used so far by each group of processes (None where one is unreadable)."""
    out = {}
    for who, ps in pids.items():
        secs = [process_seconds(p) for p in ps]
        out[who] = None if None in secs else sum(secs)
    return out


def metrics_texts(urls: list[str]) -> list[str] | None:
    """The /metrics text of each process at `urls`, read once for every figure taken from it
    (`stalls_of`, `instance_steps.summed`); None when one cannot be read."""
    out = []
    for url in urls:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
                out.append(r.read().decode())
        except (OSError, ValueError):
            return None
    return out


def stalls_of(texts: list[str] | None) -> float | None:
    """Event-loop stalls counted so far in these /metrics texts (`laps_event_loop_stalls`,
    read as the router reads an instance's); None when a text is missing, malformed, or does
    not count them (smg)."""
    if texts is None:
        return None
    total = 0.0
    for text in texts:
        try:
            stalls = parse_metrics(text).loop_stalls
        except ValueError:
            return None
        if stalls is None:
            return None
        total += stalls
    return total


def loop_stalls(urls: list[str]) -> float | None:
    """Event-loop stalls the processes at `urls` have counted so far (`stalls_of`)."""
    return stalls_of(metrics_texts(urls))


def _router_status(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/router/status", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _write_records(path: str, requests, status: dict | None) -> None:
    with open(path, "w") as f:
        if status is not None:
            f.write(json.dumps({"router_status": status}) + "\n")
        for r in requests:
            f.write(json.dumps(r.to_json()) + "\n")


def failure_counts(requests, most: int = 5) -> dict[str, int]:
    """The commonest client-side errors of a replay's failed requests, with their counts."""
    return dict(collections.Counter(r.error or "unknown" for r in requests
                                    if not r.ok).most_common(most))


def summarize(rounds: list[dict[str, dict]]) -> dict:
    """Per router and figure, the median and [min, max] over rounds; per reference router
    present, the median over rounds of each round's ratio (router / reference)."""
    names = list(dict.fromkeys(n for r in rounds for n in r))
    out: dict = {"routers": {}, "ratios": {}}
    for name in names:
        fig = {}
        for k in FIGURES:
            xs = [r[name][k] for r in rounds if name in r and r[name].get(k) is not None]
            fig[k] = ({"median": float(np.median(xs)), "min": float(min(xs)),
                       "max": float(max(xs))} if xs else None)
        out["routers"][name] = fig
    for ref in REFERENCES:
        if ref not in names:
            continue
        out["ratios"][ref] = {name: median_ratio([ratio(r[name], r[ref], FIGURES) for r in rounds
                                                  if name in r and ref in r])
                              for name in names}
    out["pooled"] = {name: pooled([r[name] for r in rounds if name in r]) for name in names}
    out["load_groups"] = by_load(rounds)
    bands = {name: pooled_bands([r[name] for r in rounds if name in r]) for name in names}
    if any(bands.values()):
        out["bands"] = bands
    return out


def pooled(rows: list[dict]) -> dict:
    """SLO violations and requests summed over rounds: one rate over every request, steadier
    than a median of a few rounds when violations are rare."""
    n = sum(r["completed"] + r["failed"] for r in rows)
    v = sum(r["slo_violations"] if "slo_violations" in r  # rounds written before the count
            else round(r["slo_violation_rate"] * (r["completed"] + r["failed"])) for r in rows)
    return {"violations": v, "requests": n, "rate": v / n if n else None}


def _cell(f: dict | None, pct: bool = False) -> str:
    if f is None:
        return "-"
    show = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:,.0f}" if abs(x) >= 100
                                               else f"{x:.3g}")
    return f"{show(f['median'])} [{show(f['min'])}, {show(f['max'])}]"


def markdown(summary: dict) -> str:
    """One row per router: median [range] of each figure, then its ratios to the references."""
    refs = list(summary["ratios"])
    pool = summary.get("pooled", {})
    head = (["router", "SLO viol.", "pooled viol.", "TTFT > fixed", "mean TTFT ms", "p90 TTFT ms",
             "short p90 TTFT ms", "tok/s", "failed", "loop stalls", "router CPU ms/req",
             "instances' prefill ms/req"]
            + [f"viol. / {r}" for r in refs] + [f"pooled / {r}" for r in refs]
            + [f"tok/s / {r}" for r in refs])
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, f in summary["routers"].items():
        p = pool.get(name)
        row = [name, _cell(f["slo_violation_rate"], pct=True),
               f"{p['violations']} / {p['requests']}" if p else "-",
               _cell(f.get("fixed_slo_violation_rate"), pct=True),
               _cell(f["prefill_latency_ms_mean"]), _cell(f["ttft_ms_p90"]),
               _cell(f["ttft_short_ms_p90"]), _cell(f["throughput_tokens_per_s"]),
               _cell(f["failed"]), _cell(f.get("loop_stalls")),
               _cell(f.get("router_cpu_ms_per_request")),
               _cell(f.get("instances_prefill_ms_per_request"))]
        for r in refs:
            x = summary["ratios"][r][name].get("slo_violation_rate")
            row.append("-" if x is None else f"{x:.2f}")
        for r in refs:
            a, b = pool.get(name), pool.get(r)
            ok = a and b and a["rate"] is not None and b["rate"]
            row.append(f"{a['rate'] / b['rate']:.2f}" if ok else "-")
        for r in refs:
            x = summary["ratios"][r][name].get("throughput_tokens_per_s")
            row.append("-" if x is None else f"{x:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
