"""The live router benchmark: the same arrivals through each router in front of the same
serve.py instances (scripts/bench_routers.py is its command line).

Instances start once, each held to one CPU thread (`ONE_THREAD_XLA_FLAGS`; optionally pinned
to a core with `taskset`), and stay up for the whole run; routers start and stop in turn in
front of them. Before each router's replay every instance's prefix cache is flushed
(`POST /flush_cache`), so no router inherits the history another one placed: restarting the
instances would do the same but costs a full compile per router (minutes each on the CPU).
Each router is a fresh process, so its own cache index starts empty too.

Routers: ours (`scripts/router.py --policy P`; any policy it knows) and the SGLang Model
Gateway (`smg launch --policy P`). Through smg the replay speaks SGLang's `/generate` with
token ids (smg's `/v1/completions` takes string prompts only); through ours, OpenAI's
`/v1/completions` with token ids; the instances run the same engine path for both.
The order of routers rotates every round so a drifting machine does not always favour the
same one. Figures: `workload.http_compare.mode_row`, with the SLO of each request `scale` x its
measured isolated TTFT as in the simulator (`isolated.py`), and beside it the share over one
fixed TTFT target (failures count as violations of both); `summarize` gives each figure's median and range over rounds and the
median of per-round ratios against the reference routers.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

from laps_jax.bench.cpu_meter import process_seconds
from laps_jax.bench.report import median_ratio, ratio
from laps_jax.workload.http_client import ReplayConfig
from laps_jax.workload.http_compare import free_port, mode_row, wait_ready
from laps_jax.workload.http_replay import replay

# what a router is judged on, and which way is better
FIGURES = ("slo_violation_rate", "fixed_slo_violation_rate", "prefill_latency_ms_mean",
           "ttft_ms_p90", "ttft_short_ms_p90", "throughput_tokens_per_s", "completed", "failed",
           "router_cpu_ms_per_request")
REFERENCES = ("round-robin", "smg:cache_aware")
DEFAULT_ROUTERS = ("round-robin", "least-load", "laps", "smg:cache_aware", "smg:round_robin")
# XLA CPU: one intra-op thread, no multi-threaded Eigen
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """`laps:<policy>` (ours; a bare policy name means ours) or `smg:<policy>`; `LABEL=SPEC
    FLAGS...` adds the router's own command-line flags under its own name (an ablation:
    `laps-nodecode=laps --decode-step-tokens 0`)."""

    kind: str
    policy: str
    flags: tuple[str, ...] = ()
    label: str | None = None

    @classmethod
    def parse(cls, name: str) -> "RouterSpec":
        label, flags = None, ()
        head = name.split()[0] if name.split() else name
        if "=" in head:
            label, _, name = name.partition("=")
            label = label.strip()
        words = name.split()
        if not words or not label and len(words) > 1:
            raise ValueError(f"router {name!r}: flags need a label (LABEL=POLICY FLAGS...)")
        name, flags = words[0], tuple(words[1:])
        kind, _, policy = name.rpartition(":")
        kind = kind or "laps"
        if kind not in ("laps", "smg") or not policy:
            raise ValueError(f"router {name!r}: give POLICY (ours) or smg:POLICY")
        return cls(kind, policy, flags, label)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return self.policy if self.kind == "laps" else f"smg:{self.policy}"

    @property
    def api(self) -> str:
        return "sglang" if self.kind == "smg" else "openai"

    def command(self, urls: list[str], port: int, metrics_port: int) -> list[str]:
        if self.kind == "smg":
            exe = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
            return [exe, "launch", "--worker-urls", *urls, "--policy", self.policy,
                    "--host", "127.0.0.1", "--port", str(port), "--prometheus-host",
                    "127.0.0.1", "--prometheus-port", str(metrics_port),
                    "--shutdown-grace-period-secs", "0", "--log-level", "warn", *self.flags]
        inst = [a for u in urls for a in ("--instance", u)]
        return [sys.executable, os.path.join(ROOT, "scripts", "router.py"), *inst,
                "--policy", self.policy, "--port", str(port), *self.flags]


class Process:
    """A child process serving HTTP on loopback, its output in a log file."""

    def __init__(self, cmd: list[str], port: int, log_path: str, env: dict | None = None):
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env or dict(os.environ))

    def wait(self, ready, timeout: float) -> None:
        """Until `ready(url)` is true; raises with the log's tail if it dies or times out."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if ready(self.url):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} not ready after {timeout:g} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_instances(n: int, serve_args: list[str], log_dir: str, cpus: list[int] | None = None,
                    timeout: float = 1800.0) -> list[Process]:
    """`n` serve.py processes, one XLA thread each (and one core each, given `cpus`). The
    first compiles alone; the others then start together and load its executables from the
    persistent compilation cache instead of compiling the same buckets side by side."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                      + ONE_THREAD_XLA_FLAGS).strip())
    procs = []
    try:
        for k in range(n):
            port = free_port()
            cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--port",
                   str(port), *serve_args]
            if cpus:
                cmd = ["taskset", "-c", str(cpus[k % len(cpus)]), *cmd]
            procs.append(Process(cmd, port, os.path.join(log_dir, f"instance{k}.log"), env))
            if k == 0 or k == n - 1:
                for p in procs:
                    wait_ready(p.url, p.proc, timeout)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def _models_ready(url: str) -> bool:
    with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
        return r.status == 200 and bool(json.loads(r.read()).get("data"))


def start_router(spec: RouterSpec, urls: list[str], log_dir: str, timeout: float = 120.0
                 ) -> Process:
    """The router in front of `urls`, once it answers /v1/models with a model (smg registers
    its workers in the background after it listens) and, for smg, a short settling wait for
    its first health round over every worker."""
    port = free_port()
    p = Process(spec.command(urls, port, free_port()), port,
                os.path.join(log_dir, f"router_{spec.name.replace(':', '_')}.log"))
    try:
        p.wait(_models_ready, timeout)
        if spec.kind == "smg":
            p.wait(lambda u: _smg_workers(u) >= len(urls), timeout)
    except BaseException:
        p.stop()
        raise
    return p


def _smg_workers(url: str) -> int:
    with urllib.request.urlopen(url + "/workers", timeout=2) as r:
        body = json.loads(r.read())
    workers = body.get("workers", body) if isinstance(body, dict) else body
    return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True))


def flush_caches(urls: list[str], timeout: float = 60.0) -> None:
    """POST /flush_cache to every instance until each answers 200 (400 while it still finishes
    the previous replay's requests)."""
    for url in urls:
        deadline = time.time() + timeout
        while True:
            req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    if r.status == 200:
                        break
            except urllib.error.HTTPError as e:
                if e.code != 400 or time.time() > deadline:
                    raise RuntimeError(f"{url}/flush_cache: HTTP {e.code}") from None
            time.sleep(0.5)


def figures(result, slo_ms: float, target_ms=None) -> dict:
    """`mode_row`'s figures, where `slo_violation_rate` counts TTFT over each request's own
    target `target_ms(record)` (`isolated.py`) when given, and `fixed_slo_violation_rate`
    over the one `slo_ms` for all (a failed request is a violation of both)."""
    row = mode_row(result, slo_ms)
    row["fixed_slo_violation_rate"] = row["slo_violation_rate"]
    if target_ms is not None:
        reqs = result.requests
        miss = sum(not (r.status == 200 and r.ttft_s is not None
                        and r.ttft_s * 1000 <= target_ms(r)) for r in reqs)
        row["slo_violation_rate"] = miss / max(len(reqs), 1)
    return row


def run_round(work, instances: list[Process], routers: list[RouterSpec], slo_ms: float,
              short_threshold: int, log_dir: str, log=print, tag: str = "",
              target_ms=None) -> dict[str, dict]:
    """One replay of `work` through each router in turn: {router name: figures}. With a
    `tag`, every request's record (and our routers' final /router/status: routes, groups,
    moves) goes to `log_dir/requests_TAG_ROUTER.jsonl`, to see why a router missed."""
    urls = [p.url for p in instances]
    out = {}
    for spec in routers:
        flush_caches(urls)
        router = start_router(spec, urls, log_dir)
        status = None
        pids = {"router": [router.proc.pid], "instances": [p.proc.pid for p in instances],
                "client": [os.getpid()]}  # (the replay runs in this process)
        try:
            cpu0 = _cpu(pids)
            result = asyncio.run(replay(router.url, work, ReplayConfig(
                short_threshold=short_threshold, progress=False, api=spec.api)))
            cpu1 = _cpu(pids)
            status = _router_status(router.url) if spec.kind == "laps" else None
        finally:
            router.stop()
        if tag:
            _write_records(os.path.join(
                log_dir, f"requests_{tag}_{spec.name.replace(':', '_')}.jsonl"),
                result.requests, status)
        out[spec.name] = figures(result, slo_ms, target_ms)
        for who in pids:  # CPU per request of the router, the instances, the client: they
            if cpu0[who] is not None and cpu1[who] is not None:  # share the cores
                out[spec.name][f"{who}_cpu_ms_per_request"] = (
                    1000 * (cpu1[who] - cpu0[who]) / max(len(result.requests), 1))
        errors = failure_counts(result.requests)
        if errors:  # kept in routers.json: a failure is a violation, and its cause matters
            out[spec.name]["errors"] = errors
        log(f"  {spec.name}: " + ", ".join(f"{k}={v}" for k, v in out[spec.name].items()
                                           if k != "errors")
            + (f"; errors: {errors}" if errors else ""))
    return out


def _cpu(pids: dict[str, list[int]]) -> dict[str, float | None]:
    """CPU seconds used so far by each group of processes (None where one is unreadable)."""
    out = {}
    for who, ps in pids.items():
        secs = [process_seconds(p) for p in ps]
        out[who] = None if None in secs else sum(secs)
    return out


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


def rotated(routers: list, k: int) -> list:
    k %= max(len(routers), 1)
    return routers[k:] + routers[:k]


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
    return out


def _cell(f: dict | None, pct: bool = False) -> str:
    if f is None:
        return "-"
    show = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:,.0f}" if abs(x) >= 100
                                               else f"{x:.3g}")
    return f"{show(f['median'])} [{show(f['min'])}, {show(f['max'])}]"


def markdown(summary: dict) -> str:
    """One row per router: median [range] of each figure, then its ratios to the references."""
    refs = list(summary["ratios"])
    head = ["router", "SLO viol.", "TTFT > fixed", "mean TTFT ms", "p90 TTFT ms", "short p90 TTFT ms",
            "tok/s", "failed", "router CPU ms/req"] + [f"viol. / {r}" for r in refs] + [f"tok/s / {r}" for r in refs]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, f in summary["routers"].items():
        row = [name, _cell(f["slo_violation_rate"], pct=True),
               _cell(f.get("fixed_slo_violation_rate"), pct=True),
               _cell(f["prefill_latency_ms_mean"]), _cell(f["ttft_ms_p90"]),
               _cell(f["ttft_short_ms_p90"]), _cell(f["throughput_tokens_per_s"]),
               _cell(f["failed"]), _cell(f.get("router_cpu_ms_per_request"))]
        for key in ("slo_violation_rate", "throughput_tokens_per_s"):
            for r in refs:
                x = summary["ratios"][r][name].get(key)
                row.append("-" if x is None else f"{x:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
