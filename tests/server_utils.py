"""Runs `scripts/serve.py` as a real process on a free loopback port for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--max-chunk", "64", "--max-prefill-batch", "4", "--max-decode-batch", "8",
         "--max-model-len", "512", "--kv-cache-tokens", "8192", "--page-size", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *extra: str, timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                     f"laps_server_{self.port}.log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--model", model,
             "--port", str(self.port), *SMALL, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.output()}")

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
