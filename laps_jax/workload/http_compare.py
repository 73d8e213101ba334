"""`compare_modes.py --http`: the same trace against real servers, one per mode, over HTTP.

Each mode gets its own `scripts/serve.py` process on a free loopback port (same model and
engine flags), the trace is replayed with `http_replay.replay`, and the server is stopped before
the next mode starts, so the modes never share the machine. Over HTTP the prefill end is not
visible, so `prefill_latency_ms_mean` is the mean TTFT (first token = prefill end + one step),
and the SLO is a fixed TTFT target (`slo_ms`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.request

from .http_client import ReplayConfig
from .http_replay import replay

FIELDS = ("ttft_ms_p50", "ttft_ms_p90", "ttft_short_ms_p90", "ttft_long_ms_p90",
          "prefill_latency_ms_mean", "slo_violation_rate", "throughput_tokens_per_s",
          "completed", "failed")


@dataclasses.dataclass
class HttpCompareOptions:
    serve_script: str            # path of scripts/serve.py
    serve_args: list[str]        # --model ... and engine flags, passed to every server
    modes: tuple[str, ...] = ("mixed", "laps", "laps-spatial")
    slo_ms: float = 1000.0
    short_threshold: int = 256
    startup_timeout_s: float = 900.0
    laps_args: list[str] = dataclasses.field(default_factory=list)  # laps modes' servers only


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Polls /health until it answers 200; raises if the process dies or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"server at {url} not ready after {timeout} s")


def mode_row(result, slo_ms: float) -> dict:
    """The comparison.json fields from one replay."""
    s = result.summary
    done = [r for r in result.requests if r.status == 200 and r.ttft_s is not None]
    ttfts = [r.ttft_s * 1000 for r in done]
    row = {k: s.get(k) for k in ("ttft_ms_p50", "ttft_ms_p90", "ttft_short_ms_p90",
                                 "ttft_long_ms_p90", "throughput_tokens_per_s", "completed",
                                 "failed")}
    row["prefill_latency_ms_mean"] = sum(ttfts) / len(ttfts) if ttfts else None
    row["slo_violation_rate"] = (sum(t > slo_ms for t in ttfts) + (len(result.requests) - len(done))
                                 ) / max(len(result.requests), 1)
    return row


def run_http_comparison(work, o: HttpCompareOptions, log=print) -> dict:
    out: dict = {"transport": "http", "slo_ms": o.slo_ms}
    for mode in o.modes:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, o.serve_script, "--mode", mode, "--port",
                                 str(port), *o.serve_args,
                                 *(o.laps_args if mode != "mixed" else ())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            log(f"[{mode}] starting server at {url}")
            wait_ready(url, proc, o.startup_timeout_s)
            result = asyncio.run(replay(url, work, ReplayConfig(
                short_threshold=o.short_threshold, progress=True)))
            out[mode] = mode_row(result, o.slo_ms)
            log(f"[{mode}] {json.dumps(out[mode])}")
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if "mixed" in out and "laps" in out:
        out["ratio"] = {k: (out["laps"][k] / out["mixed"][k]
                            if isinstance(out["laps"].get(k), (int, float))
                            and out["mixed"].get(k) else None) for k in FIELDS}
    return out
