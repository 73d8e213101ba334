"""One streamed ``/v1/completions`` call, timed: the wire half of the HTTP replay.

A replay sends token-id prompts (``"prompt": [ids]``) with ``temperature: 0``, ``stream: true``,
``stream_options.include_usage`` and the server's ``return_token_ids`` extension, so each
streamed chunk carries the id of the token it adds. From the stream it records TTFT (the first
chunk that carries a token), end-to-end latency, the mean inter-token latency, the answer's
token ids and the usage's ``cached_tokens``. A request that fails (non-200, connection error,
timeout, a stream cut short) is recorded with its status and message, never raised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import aiohttp


APIS = ("openai", "sglang")
# the headers a router names the instance that served a request in: ours (cluster/proxy.py:
# its place in the router's list) and the SGLang gateway's (its URL)
ROUTED_HEADERS = ("X-Laps-Routed-Instance", "x-smg-routed-worker-id")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """How to replay. ``model=None`` asks the server (``GET /v1/models``) for its first model.

    ``timeout_s`` bounds each request, ``deadline_s`` the whole replay (what is still running
    then is cancelled and recorded as failed); ``concurrency_limit`` caps requests in flight
    (a request waiting for a slot keeps its scheduled arrival, so the wait shows as ``queue_s``).
    ``keep_token_ids`` keeps every prompt and answer in the records (memory: off for big traces).
    """

    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    deadline_s: float | None = 3600.0
    concurrency_limit: int | None = None
    short_threshold: int = 256
    keep_token_ids: bool = False
    progress: bool = True
    api: str = "openai"  # "sglang": POST /generate (input_ids), for gateways such as smg

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {self.concurrency_limit}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclasses.dataclass
class RequestRecord:
    """One request of a replay. Times in seconds; ``arrival_s``/``sent_s`` from replay start.

    ``new_tokens``: prompt tokens beyond the previous turn's prompt + answer (the whole prompt
    for a first turn or an open-loop request). ``status`` is the HTTP status (None: no answer).
    ``served_by``: the instance a router says served it (``ROUTED_HEADERS``; None: not said).
    """

    request_id: str
    arrival_s: float | None  # None: a later turn that was never scheduled
    max_tokens: int
    session_id: str | None = None
    turn: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    sent_s: float | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s_mean: float | None = None
    cached_tokens: int = 0
    status: int | None = None
    finish_reason: str | None = None
    served_by: str | None = None
    error: str | None = "not sent"
    prompt_ids: list[int] | None = dataclasses.field(default=None, repr=False)
    answer_ids: list[int] | None = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def queue_s(self) -> float | None:
        if self.sent_s is None or self.arrival_s is None:
            return None
        return max(0.0, self.sent_s - self.arrival_s)

    def to_json(self, with_ids: bool = False) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("prompt_ids", "answer_ids")}
        out["queue_s"] = self.queue_s
        if with_ids:
            out["prompt_ids"], out["answer_ids"] = self.prompt_ids, self.answer_ids
        return out


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    model: str
    max_model_len: int | None


async def fetch_server_info(http: aiohttp.ClientSession, base_url: str,
                            config: ReplayConfig, unavailable_wait_s: float = 30.0,
                            retry_s: float = 0.5) -> ServerInfo:
    """The served model (``config.model`` if set) and its context length, from /v1/models.

    A 503 is asked again every `retry_s` for up to `unavailable_wait_s`: a router answers it
    while none of its instances is available, which a stall of the machine causes for a
    second or two (seen live: a router that had just started missed its instances' first
    polls in a stall of the VM, and a benchmark that took that 503 as final lost its rounds)."""
    deadline = time.monotonic() + unavailable_wait_s
    while True:
        async with http.get(base_url.rstrip("/") + "/v1/models", headers=config.headers(),
                            timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status == 200:
                data = (await r.json()).get("data") or []
                break
            body = await r.text()
        if r.status != 503 or time.monotonic() >= deadline:
            waited = f" (503 for {unavailable_wait_s:g} s)" if r.status == 503 else ""
            raise RuntimeError(f"GET /v1/models answered {r.status}{waited}: {body}")
        await asyncio.sleep(retry_s)
    entry = next((m for m in data if config.model in (None, m.get("id"))), None)
    if entry is None:
        names = [m.get("id") for m in data]
        raise RuntimeError(f"the server does not serve {config.model!r} (it serves {names})")
    max_len = entry.get("max_model_len")
    return ServerInfo(entry["id"], int(max_len) if isinstance(max_len, int) else None)


def _error_message(status: int, body: str) -> str:
    try:
        return f"HTTP {status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:300]}"


def request_body(api: str, model: str, prompt_ids: list[int], max_tokens: int
                 ) -> tuple[str, dict]:
    """(path, body) of one greedy streamed request: OpenAI's /v1/completions with token ids
    (and the server's return_token_ids), or SGLang's /generate with input_ids."""
    if api == "sglang":
        return "/generate", {"input_ids": prompt_ids, "stream": True, "sampling_params": {
            "max_new_tokens": max_tokens, "temperature": 0}}
    return "/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens,
                               "temperature": 0, "stream": True, "return_token_ids": True,
                               "stream_options": {"include_usage": True}}


def read_chunk(api: str, chunk: dict, have: int, usage: dict | None):
    """(new token ids, new text, finish reason or None, usage so far) of one streamed chunk;
    SGLang's chunks carry the whole answer so far, `have` ids of which were already read."""
    if api == "sglang":
        meta = chunk.get("meta_info") or {}
        finish = (meta.get("finish_reason") or {}).get("type")
        if meta:
            usage = {"completion_tokens": meta.get("completion_tokens", 0),
                     "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)}}
        return (chunk.get("output_ids") or [])[have:], "", finish, usage
    new, text, finish = [], "", None
    for choice in chunk.get("choices") or ():
        new += choice.get("token_ids") or []
        text += choice.get("text") or ""
        finish = choice.get("finish_reason") or finish
    return new, text, finish, chunk.get("usage") or usage


async def stream_completion(http: aiohttp.ClientSession, base_url: str, model: str,
                            prompt_ids: list[int], rec: RequestRecord, config: ReplayConfig,
                            t0: float) -> list[int]:
    """Send ``prompt_ids``, fill ``rec`` in, return the answer's token ids ([] on failure).

    ``t0`` is the replay's ``time.perf_counter()`` origin (for ``rec.sent_s``).
    """
    path, body = request_body(config.api, model, prompt_ids, rec.max_tokens)
    rec.prompt_tokens, rec.error = len(prompt_ids), None
    start = time.perf_counter()
    rec.sent_s = start - t0
    ids: list[int] = []
    stamps: list[float] = []
    usage: dict | None = None
    done = False
    try:
        async with asyncio.timeout(config.timeout_s):
            async with http.post(base_url.rstrip("/") + path, json=body,
                                 headers=config.headers()) as r:
                rec.status = r.status
                rec.served_by = next((r.headers[h][:200] for h in ROUTED_HEADERS
                                      if h in r.headers), None)
                if r.status != 200:
                    rec.error = _error_message(r.status, await r.text())
                    return []
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and chunk.get("error"):  # a router's or server's
                        err = chunk["error"]                            # error event
                        rec.error = "error event: " + str(
                            err.get("message") if isinstance(err, dict) else err)
                        continue
                    now = time.perf_counter()
                    new, text, finish, usage = read_chunk(config.api, chunk, len(ids), usage)
                    if new or text:
                        stamps.append(now)
                    ids.extend(new)
                    rec.finish_reason = finish or rec.finish_reason
    except TimeoutError:
        rec.error = f"timeout after {config.timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        rec.error = "cancelled: the replay's deadline was reached"
        raise
    finally:
        end = time.perf_counter()
        rec.e2e_s = end - start
        rec.ttft_s = stamps[0] - start if stamps else None
        if len(stamps) >= 2:
            rec.itl_s_mean = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        rec.output_tokens = len(ids)
        if usage:
            rec.output_tokens = int(usage.get("completion_tokens", len(ids)))
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens") or 0)
        if rec.error is None and not done:
            rec.error = "the stream ended before [DONE]"
        if rec.error is None and rec.finish_reason not in ("stop", "length"):
            rec.error = f"finish_reason {rec.finish_reason!r}"
    return ids if rec.error is None else []
