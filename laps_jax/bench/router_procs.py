"""The processes of the live router benchmark: the serve.py instances (one XLA thread each,
optionally pinned to a core), the router in front of them (ours, `scripts/router.py`, or the
SGLang Model Gateway, `smg launch`; `RouterSpec`), and flushing the instances' prefix caches
between routers. `routers.py` runs the replays through them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from laps_jax.workload.http_compare import free_port, wait_ready

# XLA CPU: one intra-op thread, no multi-threaded Eigen
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# the CPU instances' serve flags in the router benchmarks (docs/BENCHMARKS.md's `SA`)
BENCH_SERVE_ARGS = ("--max-chunk 256 --max-prefill-batch 4 --max-decode-batch 8 "
                    "--kv-cache-tokens 32768")
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


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark as Ctrl-C does (SystemExit through every `finally`), so its
    instances and routers stop with it instead of serving on, orphaned. A benchmark started
    in the background of a shell ignores SIGINT: SIGTERM is what stops it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


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


def start_router(spec: RouterSpec, urls: list[str], log_dir: str, tag: str = "",
                 timeout: float = 120.0) -> Process:
    """The router in front of `urls`, once it answers /v1/models with a model (smg registers
    its workers in the background after it listens) and, for smg, a short settling wait for
    its first health round over every worker. Its log: `log_dir/router_[TAG_]NAME.log`."""
    port = free_port()
    name = "_".join(x for x in (tag, spec.name.replace(":", "_")) if x)
    p = Process(spec.command(urls, port, free_port()), port,
                os.path.join(log_dir, f"router_{name}.log"))
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
