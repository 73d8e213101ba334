"""Readers for the public request traces (Azure LLM 2023, Mooncake FAST'25).

Both traces give arrival times and lengths only. The readers turn them into
:class:`TraceRequest` records with arrivals in seconds from the first request and prompts
described as token segments; for Mooncake, equal leading ``hash_ids`` become equal leading
512-token blocks so prefix-cache hits in a replay match the ones in production.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
import os
import re

from .records import (Segment, Trace, TraceFormatError, TraceOptions, TraceRequest,
                      iter_json_objects, parse_count, require_field, segment_key)
from .sampling import PrefixConversations, keeps

MOONCAKE_BLOCK = 512
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


_STAMP = re.compile(r"(?P<base>[^.]+?)(?:\.(?P<frac>\d+))?(?P<tz>Z|[+-]\d\d:?\d\d)?")


def parse_azure_timestamp(text: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (naive: UTC), also with an
    offset or ``Z`` (``2024-05-10 00:00:00.009930+00:00``, as the 2024 traces write it), or
    plain seconds (``12.5``).

    The 2023 trace has 7 fractional digits, which ``datetime.fromisoformat`` rejects before
    Python 3.11 and truncates after; parse the fraction ourselves to keep it whole.
    """
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise ValueError(f"not a time: {text!r}")
        return seconds
    m = _STAMP.fullmatch(text)
    if m is None:
        raise ValueError(f"not a timestamp: {text!r}")
    tz = m["tz"] or ""
    stamp = dt.datetime.fromisoformat(m["base"].replace("T", " ") + tz.replace("Z", "+00:00"))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.timezone.utc)
    frac = m["frac"] or ""
    return stamp.timestamp() + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _finish(source: str, rows: list[tuple[float, TraceRequest]], opts: TraceOptions,
            truncated: int, read: int) -> Trace:
    """Sort by arrival, make arrivals relative to the first and apply ``time_scale``;
    ``read`` is how many requests were read to keep ``rows``."""
    notes: list[str] = []
    if opts.sample < 1:
        notes.append(f"sample {opts.sample:g}: kept {len(rows)} of the {read} requests read, "
                     "whole conversations")
    if any(rows[i][0] > rows[i + 1][0] for i in range(len(rows) - 1)):
        rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
        notes.append("timestamps were out of order; requests sorted by arrival")
    t0 = rows[0][0] if rows else 0.0
    requests = []
    for t, req in rows:
        req.arrival_s = (t - t0) * opts.time_scale
        requests.append(req)
    if truncated:
        notes.append(f"{truncated} of {len(requests)} requests cut to max_len={opts.max_len} "
                     "(prompt + output tokens)")
    return Trace(source, requests, notes, truncated)


def read_azure_csv(path: str | os.PathLike[str], opts: TraceOptions | None = None) -> Trace:
    """Azure LLM inference trace 2023 (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    opts, path = opts or TraceOptions(), os.fspath(path)
    space = opts.token_space
    rows: list[tuple[float, TraceRequest]] = []
    truncated = n_rows = 0
    with open(path, newline="", encoding="utf-8-sig") as f:  # a BOM is not part of the header
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(path, 1, "empty file, expected a CSV header")
        header = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise TraceFormatError(path, 1, f"header lacks column(s) {missing}: {header}")
        i_ts, i_in, i_out = (header.index(c) for c in AZURE_COLUMNS)
        for row in reader:
            if opts.max_requests is not None and len(rows) >= opts.max_requests:
                break
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            n_rows += 1
            if len(row) != len(header):
                raise TraceFormatError(path, line, f"expected {len(header)} fields, got "
                                                   f"{len(row)}: {row}")
            try:
                t = parse_azure_timestamp(row[i_ts])
            except ValueError as e:
                raise TraceFormatError(path, line, f"bad TIMESTAMP {row[i_ts]!r}: {e}") from None
            n_in = parse_count(row[i_in].strip(), "ContextTokens", path, line)
            n_out = parse_count(row[i_out].strip(), "GeneratedTokens", path, line)
            # the trace links no requests: each is its own conversation (a row left out by
            # the sample is still checked above: a broken file fails whatever the sample)
            if not keeps(n_rows, opts.sample, opts.seed):
                continue
            n_in, n_out, cut = opts.fit(opts.scale_len(n_in), opts.scale_len(n_out))
            truncated += cut
            rid = f"azure-{len(rows)}"
            seg = (Segment(segment_key("azure", len(rows)), n_in),)
            rows.append((t, TraceRequest(rid, 0.0, n_in, n_out, seg, token_space=space)))
    return _finish(path, rows, opts, truncated, n_rows)


def mooncake_segments(hash_ids: tuple[int, ...], input_len: int, block: int,
                      request_key: int) -> tuple[Segment, ...]:
    """Full blocks named by their hash id, then the rest from the request's own stream.

    Only *full* blocks follow the hash ids; the last partial block (and any block past the
    listed ids) is per request, so two requests share exactly ``block * k`` leading tokens
    when they share ``k`` leading ids.
    """
    full = min(len(hash_ids), input_len // block)
    segs = [Segment(segment_key("mooncake-block", h), block) for h in hash_ids[:full]]
    rest = input_len - full * block
    if rest:
        segs.append(Segment(request_key, rest))
    return tuple(segs)


def read_mooncake_jsonl(path: str | os.PathLike[str], opts: TraceOptions | None = None) -> Trace:
    """Mooncake trace: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``.

    With ``length_scale`` the block size scales too (``round(512 * scale)``, at least 1),
    so the share of each prompt that is reusable prefix stays what the trace says. With
    ``sample``, conversations are told apart by their leading blocks (``PrefixConversations``).
    """
    opts, path = opts or TraceOptions(), os.fspath(path)
    space = opts.token_space
    block = max(1, round(MOONCAKE_BLOCK * opts.length_scale))
    rows: list[tuple[float, TraceRequest]] = []
    truncated = 0
    conversations = PrefixConversations()
    for line, obj in iter_json_objects(path):
        if opts.max_requests is not None and len(rows) >= opts.max_requests:
            break
        ts = require_field(obj, "timestamp", path, line)
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TraceFormatError(path, line, f"timestamp must be a number, got {ts!r}")
        n_in = parse_count(require_field(obj, "input_length", path, line), "input_length",
                                 path, line)
        n_out = parse_count(require_field(obj, "output_length", path, line), "output_length",
                                  path, line)
        raw_ids = obj.get("hash_ids", [])
        if not isinstance(raw_ids, list):
            raise TraceFormatError(path, line, f"hash_ids must be a list, got {raw_ids!r}")
        hash_ids = tuple(parse_count(h, "hash_ids entry", path, line) for h in raw_ids)
        if not keeps(conversations.assign(hash_ids), opts.sample, opts.seed):
            continue
        n_in, n_out, cut = opts.fit(opts.scale_len(n_in), opts.scale_len(n_out))
        truncated += cut
        index = len(rows)
        segs = mooncake_segments(hash_ids, n_in, block, segment_key("mooncake-req", index))
        req = TraceRequest(f"mooncake-{index}", 0.0, n_in, n_out, segs, hash_ids=hash_ids,
                           block_size=block, token_space=space)
        rows.append((ts / 1000.0, req))
    return _finish(path, rows, opts, truncated, len(conversations.root))


def detect_format(path: str | os.PathLike[str]) -> str:
    """'azure', 'mooncake' or 'sessions', from the extension and the first record."""
    path = os.fspath(path)
    if path.endswith(".csv"):
        return "azure"
    for line, obj in iter_json_objects(path):
        if "turns" in obj:
            return "sessions"
        if "hash_ids" in obj or "input_length" in obj:
            return "mooncake"
        raise TraceFormatError(path, line, "cannot tell the trace format from this record")
    raise TraceFormatError(path, None, "empty trace file")
