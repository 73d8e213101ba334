"""Replay a trace against a running OpenAI-compatible server over HTTP, and summarize it.

Open-loop traces (Azure, Mooncake) send each request at its arrival time. Sessions run closed
loop (``workload.driver``): a session's first turn goes at its arrival, turn k ``think_s`` after
turn k-1's answer completed, with the prompt = turn k-1's prompt + the answer ids the server
actually returned + the new input, so the shared prefix really repeats and the prefix cache is
exercised. A turn whose predecessor failed is not sent (recorded as failed: its prompt cannot
be built).

    result = await replay("http://127.0.0.1:8000", load("sessions", path, opts),
                          ReplayConfig(concurrency_limit=64))
    print(format_summary(result.summary))
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from .driver import SessionTurn, run_session
from .http_client import (ReplayConfig, RequestRecord, ServerInfo, fetch_server_info,
                          stream_completion)
from .records import TokenSpace, Trace
from .sessions import Session, SessionTrace


@dataclasses.dataclass
class ReplayResult:
    config: dict[str, Any]
    summary: dict[str, Any]
    requests: list[RequestRecord]

    def to_json(self, with_ids: bool = False) -> dict[str, Any]:
        return {"config": self.config, "summary": self.summary,
                "requests": [r.to_json(with_ids) for r in self.requests]}

    def write(self, path: str | os.PathLike[str], with_ids: bool = False) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(with_ids), f, indent=1)
            f.write("\n")


class _Runner:
    """Shared state of one replay: HTTP session, clock origin, slots, progress bar."""

    def __init__(self, http, base_url: str, info: ServerInfo, config: ReplayConfig, total: int):
        self.http, self.base_url, self.info, self.config = http, base_url, info, config
        self.slots = asyncio.Semaphore(config.concurrency_limit or 1 << 30)
        self.bar = tqdm(total=total, unit="req", disable=not config.progress, dynamic_ncols=True)
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def sleep(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    async def send(self, rec: RequestRecord, prompt_ids: list[int]) -> list[int]:
        async with self.slots:
            ids = await stream_completion(self.http, self.base_url, self.info.model, prompt_ids,
                                          rec, self.config, self.t0)
        if self.config.keep_token_ids:
            rec.prompt_ids, rec.answer_ids = prompt_ids, ids
        self.bar.update(1)
        if not rec.ok:
            self.bar.set_postfix_str(f"failed: {rec.error[:60]}", refresh=False)
        return ids

    async def request(self, req, rec: RequestRecord) -> None:
        await self.sleep(req.arrival_s - self.now())
        await self.send(rec, req.prompt_token_ids())

    async def session(self, s: Session, space: TokenSpace, recs: list[RequestRecord]) -> None:
        """One session through the shared driver (times already scaled by the reader); a
        failed turn ends it, and the turns after it are recorded as not sent."""
        def scheduled(turn: SessionTurn) -> None:
            recs[turn.index].arrival_s = turn.arrival_s

        async def submit(turn: SessionTurn) -> list[int] | None:
            rec = recs[turn.index]
            ids = await self.send(rec, turn.prompt)
            return ids if rec.ok else None

        end = await run_session(s, space, submit, self, 0.0, scheduled=scheduled)
        if end.reason == "failed":
            for later in recs[end.sent:]:
                later.error = f"not sent: turn {recs[end.sent - 1].turn} of the session failed"
                self.bar.update(1)


def _records(work: Trace | SessionTrace) -> tuple[list[RequestRecord], list[list[RequestRecord]]]:
    """Records in arrival order (open loop) or per session, in session and turn order."""
    if isinstance(work, SessionTrace):
        per = [[RequestRecord(f"{s.session_id}/{k}", s.arrival_s if k == 0 else None,
                              t.output_tokens, s.session_id, k, new_tokens=t.new_input_tokens)
                for k, t in enumerate(s.turns)] for s in work.sessions]
        return [r for recs in per for r in recs], per
    recs = [RequestRecord(r.request_id, r.arrival_s, r.output_len, r.session_id, r.turn,
                          prompt_tokens=r.input_len, new_tokens=r.new_input_len) for r in work]
    return recs, []


async def replay(base_url: str, work: Trace | SessionTrace,
                 config: ReplayConfig | None = None) -> ReplayResult:
    """Replay ``work`` against the server at ``base_url``; every request ends in a record."""
    config = config or ReplayConfig()
    records, per_session = _records(work)
    limit = config.concurrency_limit or 0
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, config.timeout_s))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                     timeout=timeout) as http:
        info = await fetch_server_info(http, base_url, config)
        run = _Runner(http, base_url, info, config, len(records))
        if per_session:
            tasks = [asyncio.create_task(run.session(s, work.token_space, recs))
                     for s, recs in zip(work.sessions, per_session)]
        else:
            tasks = [asyncio.create_task(run.request(req, rec))
                     for req, rec in zip(work, records)]
        _, pending = await asyncio.wait(tasks, timeout=config.deadline_s) if tasks else ((), ())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = run.now()
        run.bar.close()
    for rec in records:
        if rec.error == "not sent" and pending:
            rec.error = "not sent: the replay's deadline was reached"
    cfg = {"base_url": base_url, "source": work.source, "model": info.model,
           "max_model_len": info.max_model_len, "kind": "sessions" if per_session else "trace",
           "notes": list(work.notes), **dataclasses.asdict(config)}
    cfg.pop("api_key")
    cfg["deadline_reached"] = bool(pending)
    return ReplayResult(cfg, summarize_records(records, config.short_threshold, wall_s), records)


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 3) if values else None


def summarize_records(records: list[RequestRecord], short_threshold: int = 256,
                      wall_s: float | None = None) -> dict[str, Any]:
    """Counts, TTFT/e2e percentiles (ms), throughput and cache use over completed requests.

    Throughput divides by ``wall_s`` (first send to last completion if not given); short/long
    split by ``new_tokens <= short_threshold``.
    """
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.sent_s is not None]
    if wall_s is None:
        wall_s = max((r.sent_s + r.e2e_s for r in sent), default=0.0) \
            - min((r.sent_s for r in sent), default=0.0)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    short = [r.ttft_s for r in ok if r.ttft_s is not None and r.new_tokens <= short_threshold]
    long = [r.ttft_s for r in ok if r.ttft_s is not None and r.new_tokens > short_threshold]
    itl = [r.itl_s_mean for r in ok if r.itl_s_mean is not None]
    prompt_tok = sum(r.prompt_tokens for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    rate = (lambda n: round(n / wall_s, 3) if wall_s > 0 else None)
    return {
        "count": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "not_sent": len(records) - len(sent), "duration_s": round(wall_s, 3),
        "ttft_ms_p50": _ms(ttft, 50), "ttft_ms_p90": _ms(ttft, 90), "ttft_ms_p99": _ms(ttft, 99),
        "e2e_ms_p50": _ms([r.e2e_s for r in ok], 50), "e2e_ms_p90": _ms([r.e2e_s for r in ok], 90),
        "itl_ms_mean": round(float(np.mean(itl)) * 1e3, 3) if itl else None,
        "prompt_tokens": prompt_tok, "output_tokens": out_tok, "cached_tokens": cached,
        "cached_fraction": round(cached / prompt_tok, 4) if prompt_tok else None,
        "prompt_tokens_per_s": rate(prompt_tok), "output_tokens_per_s": rate(out_tok),
        "throughput_tokens_per_s": rate(prompt_tok + out_tok),
        "requests_per_s": rate(len(ok)), "short_threshold": short_threshold,
        "short_count": len(short), "long_count": len(long),
        "ttft_short_ms_p90": _ms(short, 90), "ttft_long_ms_p90": _ms(long, 90),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The summary as an aligned two-column table."""
    def v(x) -> str:
        return "-" if x is None else (f"{x:,.1f}" if isinstance(x, float) else f"{x:,}")
    rows = [
        ("requests (completed / failed)", f"{s['count']} ({s['completed']} / {s['failed']})"),
        ("duration (s)", v(s["duration_s"])),
        ("TTFT p50 / p90 / p99 (ms)",
         f"{v(s['ttft_ms_p50'])} / {v(s['ttft_ms_p90'])} / {v(s['ttft_ms_p99'])}"),
        ("e2e p50 / p90 (ms)", f"{v(s['e2e_ms_p50'])} / {v(s['e2e_ms_p90'])}"),
        ("inter-token latency mean (ms)", v(s["itl_ms_mean"])),
        ("throughput prompt / output (tok/s)",
         f"{v(s['prompt_tokens_per_s'])} / {v(s['output_tokens_per_s'])}"),
        ("cached-token fraction", "-" if s["cached_fraction"] is None
         else f"{s['cached_fraction']:.1%}"),
        (f"TTFT p90 short <= {s['short_threshold']} new tok (ms)",
         f"{v(s['ttft_short_ms_p90'])}  (n={s['short_count']})"),
        ("TTFT p90 long (ms)", f"{v(s['ttft_long_ms_p90'])}  (n={s['long_count']})"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {val}" for k, val in rows)
