"""Runs `scripts/serve.py` as a real process on a free loopback port for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request

from laps_jax.workload.http_compare import free_port, wait_ready

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--max-chunk", "64", "--max-prefill-batch", "4", "--max-decode-batch", "8",
         "--max-model-len", "512", "--kv-cache-tokens", "8192", "--page-size", "8"]


class ServerProcess:
    def __init__(self, model: str, *extra: str, timeout: float = 300.0, port: int | None = None):
        self.port = port or free_port()  # (a port: a restart where a router expects it)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     f"laps_server_{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--model", model,
             "--port", str(self.port), *SMALL, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            wait_ready(self.url, self.proc, timeout)
        except (RuntimeError, TimeoutError) as e:
            log = self.output()
            self.stop()
            raise RuntimeError(f"{e}:\n{log}") from None

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str) -> float:
        """Sum of every sample of a Prometheus metric."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
