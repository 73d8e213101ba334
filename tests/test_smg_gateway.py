"""laps_jax instances behind the SGLang Model Gateway (`smg`, the `test` extra), unchanged:
two real serve.py processes of a tiny checkpoint behind `smg launch --policy cache_aware`.
A completion and a chat stream through smg equal the instance's own greedy answers; SGLang's
`/generate` with token ids through smg equals `/v1/completions` on an instance; the same
prompt again lands where its prefix is cached (smg's cache_aware), so it reports cached tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from laps_jax.bench.router_procs import RouterSpec, start_router
from test_router import MODEL, post, sse, stream_text

pytestmark = pytest.mark.slow


def _smg_cannot_run() -> str | None:
    exe = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
    try:
        r = subprocess.run([exe, "launch", "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the smg binary cannot run here ({type(e).__name__}: {e})"
    return None if r.returncode == 0 else f"smg launch --help exited {r.returncode}"


@pytest.fixture(scope="module")
def gateway(cluster, tmp_path_factory):
    why = _smg_cannot_run()
    if why:
        pytest.skip(why + "; install the test extra (pip install smg)")
    _, procs = cluster
    g = start_router(RouterSpec("smg", "cache_aware"), [p.url for p in procs],
                     str(tmp_path_factory.mktemp("smg")))
    yield g
    g.stop()


def test_completion_chat_stream_and_generate_through_smg(cluster, gateway):
    _, procs = cluster
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}
    status, direct, _ = post(procs[0].url, "/v1/completions", body)
    assert status == 200
    for _ in range(2):
        status, got, _ = post(gateway.url, "/v1/completions", body)
        assert status == 200, got
        assert got["choices"][0]["text"] == direct["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Grüße 😀 hello"}],
            "max_tokens": 12, "temperature": 0}
    status, want, _ = post(procs[1].url, "/v1/chat/completions", chat)
    assert status == 200
    events = sse(gateway.url, "/v1/chat/completions", dict(chat, stream=True))
    assert events[-1] == "[DONE]"
    assert stream_text(events, "chat") == want["choices"][0]["message"]["content"]

    ids = [(7 * k + 3) % 200 + 5 for k in range(48)]
    status, ref, _ = post(procs[0].url, "/v1/completions", {
        "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert status == 200
    gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    cached = []
    for _ in range(2):
        status, got, _ = post(gateway.url, "/generate", gen)
        assert status == 200, got
        assert got["output_ids"] == ref["choices"][0]["token_ids"]
        cached.append(got["meta_info"]["cached_tokens"])
    assert cached[1] >= 40, cached  # cache_aware sent the repeat where its prefix is
    events = sse(gateway.url, "/generate", dict(gen, stream=True))
    assert events[-1] == "[DONE]"
    assert events[-2]["output_ids"] == ref["choices"][0]["token_ids"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
