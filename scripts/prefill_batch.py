#!/usr/bin/env python
"""Offline batch prefill: next-token top log-probs (and optionally prompt log-probs) per line.

Input lines: {"id", "prompt": str} | {"id", "prompt_token_ids": [int]} | {"id", "messages": [...]}.
Output lines, in input order: {"id", "num_prompt_tokens", "top_logprobs": [[token_id, logprob]...],
"prompt_logprobs": [null, lp1, ...]} or {"id", "error": "..."} for a line that cannot run.
"""

from __future__ import annotations

import argparse
import sys

from laps_jax.cli import add_engine_args, build_engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="JSONL file of requests ('-' for stdin)")
    ap.add_argument("--output", required=True, help="JSONL file to write ('-' for stdout)")
    ap.add_argument("--top-logprobs", type=int, default=5, metavar="K",
                    help="log-probs of the K most likely next tokens (0-20, default 5)")
    ap.add_argument("--prompt-logprobs", action="store_true",
                    help="also report log p(token | tokens before it) for every prompt token")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(ap, default_model=None)
    args = ap.parse_args(argv)
    if not 0 <= args.top_logprobs <= 20:
        ap.error("--top-logprobs must be between 0 and 20")

    from laps_jax.server.prefill_job import PrefillJob
    built = build_engine(args, prompt_logprobs=args.prompt_logprobs)
    job = PrefillJob(built.engine, args.top_logprobs, args.prompt_logprobs)
    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    dst = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    with src, dst:
        summary = job.run(src, built.tokenizer, dst, progress=not args.no_progress)
    print(summary.format(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
