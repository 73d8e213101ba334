"""The one way a script gets its trace: ``load(kind, path, options)``, and the flags behind it.

Every replayer (compare_modes in-process, the simulator, bench_serving over HTTP) reads its
trace here, and every script declares the shared trace flags with ``add_trace_args``, so
``--max-requests 200 --length-scale 0.1`` cuts the same 200 requests to the same lengths
whichever script is given it. What differs per script (where the time scale comes from when
``--time-scale`` is not given; what runs without ``--trace``) is said in that flag's help.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection
from typing import Any

from .records import Trace, TraceOptions
from .sampling import check_fraction
from .sessions import SessionTrace, read_sessions_jsonl
from .traces import detect_format, read_azure_csv, read_mooncake_jsonl

FORMATS = ("azure", "mooncake", "sessions")
TRACE_FLAGS = ("trace", "trace_format", "max_requests", "length_scale", "time_scale", "sample")


def load(kind: str | None, path: str | os.PathLike[str],
         options: TraceOptions | None = None) -> Trace | SessionTrace:
    """Azure or Mooncake requests (open loop), or sessions (closed loop); ``kind=None`` detects
    the format from the file (extension, then first record)."""
    kind = kind or detect_format(path)
    if kind == "azure":
        return read_azure_csv(path, options)
    if kind == "mooncake":
        return read_mooncake_jsonl(path, options)
    if kind == "sessions":
        return read_sessions_jsonl(path, options)
    raise ValueError(f"unknown trace format {kind!r}; expected one of {', '.join(FORMATS)}")


def _fraction(text: str) -> float:
    try:
        return check_fraction(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_trace_args(parser: argparse._ActionsContainer, *, trace_default: str | None = None,
                   time_scale_default: str = "1, the trace's own times",
                   max_requests_default: str = "all",
                   only: Collection[str] = TRACE_FLAGS,
                   time_scale_group: argparse._ActionsContainer | None = None) -> None:
    """Declares the shared trace flags (those named in ``only``) on ``parser``.

    ``trace_default`` says what runs without ``--trace`` (None: ``--trace`` is required);
    ``time_scale_default`` and ``max_requests_default`` say what a script does without
    ``--time-scale`` and ``--max-requests``;
    ``time_scale_group`` (e.g. a mutually exclusive group of rate settings) takes
    ``--time-scale`` instead of ``parser``. Every flag defaults to "not given" (None), except
    ``--length-scale`` (1.0): a script fills in its own defaults from the values.
    """
    unknown = set(only) - set(TRACE_FLAGS)
    if unknown:
        raise ValueError(f"not trace flags: {sorted(unknown)}")
    if "trace" in only:
        parser.add_argument("--trace", required=trace_default is None, default=None,
                            help="trace file: Azure CSV, Mooncake JSONL or sessions JSONL"
                                 + (f" (default: {trace_default})" if trace_default else ""))
    if "trace_format" in only:
        parser.add_argument("--trace-format", choices=FORMATS, default=None,
                            help="format of --trace (default: detected from the file)")
    if "max_requests" in only:
        parser.add_argument("--max-requests", type=int, default=None,
                            help="replay only the first N requests of the trace (session "
                                 f"turns count one each; default: {max_requests_default})")
    if "length_scale" in only:
        parser.add_argument("--length-scale", type=float, default=1.0,
                            help="multiply prompt and output lengths (at least 1 token each; "
                                 "to fit a CPU); lengths are then cut to the context "
                                 "(default: 1.0)")
    if "sample" in only:
        parser.add_argument("--sample", type=_fraction, default=1.0, metavar="F",
                            help="keep a fraction F of the trace's conversations, whole (a "
                                 "Mooncake conversation: requests that continue a previous "
                                 "prompt; a session; an Azure request), before --max-requests "
                                 "counts: a lower rate that keeps the follow-up turns and their "
                                 "prefix reuse, where --time-scale stretches the minutes between "
                                 "turns out of the window (default: 1, all)")
    if "time_scale" in only:
        (time_scale_group or parser).add_argument(
            "--time-scale", type=float, default=None,
            help="multiply arrival gaps and think times by this (0.1 = 10x faster; default: "
                 f"{time_scale_default})")


def trace_options_from_args(args: argparse.Namespace, **fixed: Any) -> TraceOptions:
    """TraceOptions from the shared flags (a time scale not given is 1); ``fixed`` sets what
    a script decides itself (``vocab_size``, ``max_len``, ``seed``)."""
    time_scale = getattr(args, "time_scale", None)
    return TraceOptions(max_requests=getattr(args, "max_requests", None),
                        length_scale=getattr(args, "length_scale", 1.0),
                        sample=getattr(args, "sample", 1.0),
                        time_scale=1.0 if time_scale is None else time_scale, **fixed)
