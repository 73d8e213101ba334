#!/usr/bin/env python
"""Offline batch prefill: next-token top log-probs (and optionally prompt log-probs) per line.

Input lines: {"id", "prompt": str} | {"id", "prompt_token_ids": [int]} | {"id", "messages": [...]}.
Output lines, one per input line, in input order: {"id", "num_prompt_tokens", "top_logprobs":
[[token_id, logprob]...], "prompt_logprobs": [null, lp1, ...]} or {"id", "error": "..."} for a
line that cannot run (blank, not UTF-8, not JSON, too long for the context, ...).

Every line is read and checked before anything compiles; only the buckets the input needs are
compiled (the persistent compilation cache keeps them for the next run). Output is written as
the job goes, a window of lines at a time, so an interrupted job keeps what it finished and
--resume carries on after it.
"""

from __future__ import annotations

import argparse
import os
import sys

from laps_jax.cli import add_engine_args, build_engine, setup_logging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="JSONL file of requests ('-' for stdin)")
    ap.add_argument("--output", required=True, help="JSONL file to write ('-' for stdout)")
    ap.add_argument("--top-logprobs", type=int, default=5, metavar="K",
                    help="log-probs of the K most likely next tokens (0-20, default 5)")
    ap.add_argument("--prompt-logprobs", action="store_true",
                    help="also report log p(token | tokens before it) for every prompt token")
    ap.add_argument("--resume", action="store_true",
                    help="--output holds an interrupted run of this input: keep its lines and "
                         "append the rest")
    ap.add_argument("--window", type=int, default=256, metavar="LINES",
                    help="lines prefilled and then written (and flushed) together (default 256)")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(ap, default_model=None)
    args = ap.parse_args(argv)
    if not 0 <= args.top_logprobs <= 20:
        ap.error("--top-logprobs must be between 0 and 20")
    if args.window < 1:
        ap.error("--window must be at least 1")
    if args.resume and args.output == "-":
        ap.error("--resume needs --output to be a file")
    setup_logging()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    try:
        src = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")
    except OSError as e:
        log(f"error: --input: {e}")
        return 2
    try:
        return run(args, src, log)
    except ValueError as e:  # settings that cannot work, a bad model directory, --resume
        log(f"error: {e}")
        return 2
    finally:
        src.close()


def run(args, src, log) -> int:
    from laps_jax.offline.job import PrefillJob
    from laps_jax.offline.lines import resume_point
    built = build_engine(args, prompt_logprobs=args.prompt_logprobs, warmup=False, log=log)
    lines = list(src)
    skip = 0
    if args.resume and os.path.exists(args.output):
        with open(args.output, "rb") as f:
            written = f.readlines()
        skip = resume_point(written, lines)
        with open(args.output, "rb+") as f:  # drop a cut-off last line
            f.truncate(sum(len(w) for w in written[:skip]))
        log(f"--resume: {skip} of {len(lines)} lines already written")
    job = PrefillJob(built.engine, args.top_logprobs, args.prompt_logprobs)
    mode = "a" if args.resume else "w"
    dst = sys.stdout if args.output == "-" else open(args.output, mode, encoding="utf-8")
    with dst:
        summary = job.run(lines, built.tokenizer, dst, progress=not args.no_progress, skip=skip,
                          window=args.window)
    log(summary.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
