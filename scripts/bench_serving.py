"""Replay a request trace against a running OpenAI-compatible server and measure it over HTTP.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --trace ../shared/traces/azure_llm_2023_conv.csv --trace-format azure \\
        --max-requests 200 --length-scale 0.1 --time-scale 0.2 --output runs/azure.json

Prompts are token ids of the trace's exact lengths, drawn from [10, --vocab-size): keep that
below the model's vocabulary (the server does not publish it; ids it rejects come back as 400
and are recorded as failures). Sessions run closed loop: each later turn re-sends the previous
prompt + the answer actually returned + its new tokens. Answers may end early at EOS (the
server has no ignore_eos); the actual output length is recorded. Writes
{"config", "summary", "requests"} as JSON and prints a summary table. Exit status: 0, or 1 when
no request completed, or 2 when the server or the trace cannot be read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

import aiohttp

from laps_jax.workload.http_client import ReplayConfig, fetch_server_info
from laps_jax.workload.http_replay import format_summary, replay
from laps_jax.workload.load import add_trace_args, load, trace_options_from_args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    add_trace_args(p)
    p.add_argument("--output", required=True, help="result JSON file to write")
    p.add_argument("--max-len", type=int, default=None,
                   help="cap prompt + output tokens (default: the server's max_model_len)")
    p.add_argument("--vocab-size", type=int, default=1000,
                   help="prompt token ids are below this; must not exceed the model's "
                        "vocabulary (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--concurrency-limit", type=int, default=None,
                   help="most requests in flight (default: unlimited, pure open loop)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="per-request timeout in seconds (default 600)")
    p.add_argument("--deadline", type=float, default=3600.0,
                   help="stop the whole replay after this many seconds (default 3600)")
    p.add_argument("--short-threshold", type=int, default=256,
                   help="'short' = at most this many new prompt tokens (default 256)")
    p.add_argument("--save-token-ids", action="store_true",
                   help="also write each request's prompt and answer token ids")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


async def main_async(args: argparse.Namespace) -> int:
    config = ReplayConfig(model=args.model, api_key=args.api_key, timeout_s=args.timeout,
                          deadline_s=args.deadline, concurrency_limit=args.concurrency_limit,
                          short_threshold=args.short_threshold,
                          keep_token_ids=args.save_token_ids, progress=not args.no_progress)
    async with aiohttp.ClientSession() as http:
        info = await fetch_server_info(http, args.base_url, config)
    opts = trace_options_from_args(args, vocab_size=args.vocab_size,
                                   max_len=args.max_len or info.max_model_len, seed=args.seed)
    work = load(args.trace_format, args.trace, opts)
    for note in work.notes:
        print(f"note: {note}", file=sys.stderr)
    result = await replay(args.base_url, work, dataclasses.replace(config, model=info.model))
    result.config.update(trace_format=args.trace_format, **{
        k: getattr(opts, k) for k in ("max_requests", "length_scale", "time_scale",
                                      "vocab_size", "max_len", "seed")})
    result.write(args.output, with_ids=args.save_token_ids)
    print(format_summary(result.summary))
    print(f"wrote {args.output}", file=sys.stderr)
    return 1 if result.summary["count"] and not result.summary["completed"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except (OSError, ValueError, RuntimeError, aiohttp.ClientError) as e:
        print(f"bench_serving: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
