"""The prefill/decode split under load, as a user runs it: `serve.py --model builtin --role
prefill`, `--role decode`, and `router.py --prefill URL --decode URL --tokenizer builtin`, each
its own process, sharing the split's secret through LAPS_PD_SECRET.

Forty concurrent requests of 1,800 random prompt tokens, on pools small enough that most of
them wait for pages on both sides: every one must finish, or get a clean 503 with Retry-After
from the router, and nothing may hang (this load used to leave 6-8 of 40 waiting forever, with
0 pages used: a release that did not wake the queue). 35 s later no instance holds a page.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import pytest

from server_utils import ROOT, ServerProcess, free_port

pytestmark = pytest.mark.slow
SECRET = "load-test-secret-0123456789abcdef"
N, PROMPT, MAX_TOKENS = 40, 1800, 200
POOL = ("--max-model-len", "2048", "--kv-cache-tokens", "12288", "--page-size", "16",
        "--max-chunk", "256", "--max-decode-batch", "8")


def _router(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"laps_router_{port}.log"), "w+")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "router.py"), "--prefill", prefill,
         "--decode", decode, "--tokenizer", "builtin", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/router/status", timeout=2) as r:
                if json.loads(r.read()).get("healthy") == 2:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    log.seek(0)
    raise RuntimeError(f"router not ready:\n{log.read()}")


async def _load(url: str, timeout_s: float) -> list[tuple[int, str | None]]:
    import aiohttp
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(PROMPT)] for _ in range(N)]

    async def one(s, prompt) -> tuple[int, str | None]:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0}
        try:
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")
        except asyncio.TimeoutError:
            return -1, None  # hung

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        return await asyncio.gather(*(one(s, p) for p in prompts))


def test_forty_long_requests_through_the_split_all_end_and_free_their_pages(monkeypatch):
    monkeypatch.setenv("LAPS_PD_SECRET", SECRET)
    procs = {}
    router = None
    try:
        import threading  # both compile at once

        def start(role):
            procs[role] = ServerProcess("builtin", "--role", role, *POOL, timeout=600)
        threads = [threading.Thread(target=start, args=(r,)) for r in ("prefill", "decode")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(procs) == 2, "an instance did not start (its log is in TMPDIR)"
        router, url = _router(procs["prefill"].url, procs["decode"].url)
        t0 = time.time()
        results = asyncio.run(_load(url, 240))
        wall = time.time() - t0
        ok = sum(1 for s, _ in results if s == 200)
        refused = [(s, ra) for s, ra in results if s == 503]
        print(f"\n{ok}/{N} finished, {len(refused)} refused (503) in {wall:.1f} s")
        assert all(s in (200, 503) for s, _ in results), results  # none hung, none failed
        assert all(ra for _, ra in refused), refused  # a 503 says when to come back
        assert ok >= N // 2, results
        deadline, used = time.time() + 35, None
        while time.time() < deadline:
            used = {r: p.metric("laps_kv_pages_used") for r, p in procs.items()}
            if not any(used.values()):
                break
            time.sleep(1)
        print(f"pages held {time.time() - t0 - wall:.0f} s later: {used}")
        assert not any(used.values()), used
    finally:
        if router is not None:
            router.kill()
            router.wait()
        for p in procs.values():
            p.stop()
