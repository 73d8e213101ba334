"""Replay one trace against mixed, laps and laps-spatial in one process; write the comparison.

    python scripts/compare_modes.py --model bench-cpu --trace ../shared/traces/azure_llm_2023_conv.csv \
        --trace-format azure --max-requests 200 --length-scale 0.1 --output-dir runs/azure

Writes DIR/comparison.json (per mode, the laps/mixed `ratio`, goals met, run settings, scheduler
metrics), DIR/comparison.md (table), DIR/requests.jsonl (every request's stats) and
DIR/ttft_cdf.png, DIR/ttft_short_long.png.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laps_jax.cli import DefaultsHelpFormatter, add_engine_args, engine_config_from_args  # noqa: E402
from laps_jax.scheduler.policy import ORDERS, SchedulerConfig  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=DefaultsHelpFormatter)
    add_engine_args(ap)
    ap.set_defaults(model="bench-cpu", max_model_len=4096, max_chunk=512, max_decode_batch=16,
                    kv_cache_tokens=32768)
    g = ap.add_argument_group("workload")
    g.add_argument("--trace", required=True, help="trace file (Azure CSV, Mooncake or sessions JSONL)")
    g.add_argument("--trace-format", required=True, choices=("azure", "mooncake", "sessions"),
                   help="format of --trace")
    g.add_argument("--max-requests", type=int, default=None,
                   help="replay only the first N requests (sessions: N turns)")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply prompt and output lengths (fit a CPU); lengths are also cut "
                        "to --max-model-len")
    g.add_argument("--max-output", type=int, default=None,
                   help="cap each request's output tokens (decode steps are costly on a CPU)")
    g.add_argument("--load", type=float, default=0.8,
                   help="scale arrivals so mixed runs at this fraction of its prefill capacity, "
                        "measured by replaying the first --capacity-requests at once")
    g.add_argument("--time-scale", type=float, default=None,
                   help="multiply arrival and think times by this instead of deriving it from "
                        "--load (use the value of an earlier run to replay the same arrivals)")
    g.add_argument("--capacity-mode", choices=("serving", "prefill"), default="serving",
                   help="capacity measured with each request's decode interleaved as when "
                        "serving, or prefill only (one output token each)")
    g.add_argument("--capacity-requests", type=int, default=24,
                   help="requests replayed at once to measure mixed's capacity")
    g.add_argument("--capacity-repeats", type=int, default=3,
                   help="bursts to measure; the median capacity sets the time scale (3)")
    g.add_argument("--slo-scale", type=float, default=5.0,
                   help="a request's TTFT SLO = this x the predicted isolated prefill latency "
                        "of its new tokens")
    s = ap.add_argument_group("scheduler")
    s.add_argument("--modes", default="mixed,laps,laps-spatial",
                   help="comma-separated modes to run (ratios need mixed)")
    s.add_argument("--threshold", default="auto",
                   help="short/long cut in new tokens after the prefix match: an integer, or "
                        "'auto' for the latency model's compute-bound crossover")
    s.add_argument("--profile", default=None,
                   help="profile JSON from scripts/profile_latency.py (default: profile 24 "
                        "shapes now)")
    s.add_argument("--no-rescale-profile", action="store_true",
                   help="use --profile's rates as they are (default: time 8 of its shapes "
                        "now and scale the model by how much slower or faster they run: SLOs "
                        "and plans then fit this machine's speed this hour)")
    s.add_argument("--window", choices=("adaptive", "static", "off"), default="adaptive",
                   help="short-pool waiting window: adaptive (arrival rate and SLO slack), "
                        "static (--static-window seconds) or off (dispatch at once; ablation)")
    s.add_argument("--static-window", type=float, default=0.005,
                   help="static window length in seconds")
    s.add_argument("--window-max", type=float, default=None,
                   help="cap of the adaptive window in seconds (default: half the cheapest "
                        "predicted step)")
    s.add_argument("--order", choices=ORDERS, default=SchedulerConfig.order,
                   help="order inside each pool: srpt, fewest remaining tokens first with "
                        "requests waiting past --max-wait ahead; ratio, highest response ratio "
                        "(waited + service) / service first; or aging, remaining tokens minus "
                        "a linear credit")
    s.add_argument("--max-wait", type=float, default=None,
                   help="with --order srpt: seconds after which a request goes ahead of shorter "
                        "ones (default: 16 full-budget prefill steps as predicted)")
    s.add_argument("--aging", type=float, default=None, metavar="TOKENS_PER_S",
                   help="with --order aging: tokens of credit per second waited (default: a "
                        "quarter of a full step's tokens per step waited; 0: shortest remaining "
                        "first, the starvation bound still applies)")
    s.add_argument("--variant", action="append", default=[], metavar="NAME=MODE:KEY=VALUE,...",
                   help="run one more mode: MODE (laps, laps-spatial or mixed) with scheduler "
                        "settings changed, named NAME, with its own ratio to mixed; e.g. "
                        "laps-srpt=laps:order=srpt,max_wait_s=1.5 (keys: order, cross_pool, "
                        "threshold, window_mode, long_budget_tokens, long_chunk_ratio, "
                        "decode_gap_s, aging_tokens_per_s, max_postpone_s, max_wait_s, fill_rows, "
                        "fill_slack, overload_requests: a count or off, overload_check). "
                        "Repeatable: the fair "
                        "A/B of two settings on a shared machine (same arrivals and rounds)")
    s.add_argument("--cross-pool", choices=("aging", "short-first"), default="short-first",
                   help="laps: a ready short batch always runs first (short-first, the LAPS "
                        "policy), or yields to a long request whose score is lower (aging)")
    s.add_argument("--decode-gap", type=float, default=None,
                   help="seconds prefill may hold the next decode step back (default: one "
                        "full-budget prefill step as predicted, the same bound in every mode; "
                        "0: a decode step after every prefill step)")
    s.add_argument("--long-budget", type=int, default=None,
                   help="laps: padded tokens per long-pool chunk (default: the widest bucket "
                        "predicted to take at most 5 of the cheapest prefill steps, "
                        "SchedulerConfig.long_chunk_ratio: 256 of 512 for bench-cpu here; "
                        "laps-spatial: the step budget). Smaller chunks let "
                        "short requests in sooner at some throughput cost; while more than "
                        "SchedulerConfig.overload_requests (4) long requests wait, laps' long "
                        "steps may take twice the chunk where that pads no more tokens")
    s.add_argument("--no-buckets", action="store_true",
                   help="ablation: compile one prefill executable (1 x --max-chunk) so every "
                        "prefill step pads to it, instead of the (batch, tokens) bucket grid")
    s.add_argument("--simulate", action="store_true",
                   help="no engine: run the same dispatcher on simulated executors in virtual "
                        "time, each step taking the --profile latency model's prediction "
                        "(laps-spatial then gets two such devices)")
    s.add_argument("--http", action="store_true",
                   help="replay over HTTP against a real scripts/serve.py per mode instead of the "
                        "in-process engine (TTFT SLO: --http-slo-ms)")
    s.add_argument("--http-slo-ms", type=float, default=1000.0,
                   help="with --http: the TTFT target counted as an SLO violation (ms)")
    s.add_argument("--repeats", type=int, default=1,
                   help="run every mode this many times on the same arrivals (order alternating "
                        "each round) and report the median of the per-round laps/mixed ratios; "
                        "tables and plots show round 1; requests.jsonl holds every round")
    s.add_argument("--max-others-cpu", type=float, default=0.1, metavar="SHARE",
                   help="run a mode's replay again when others (other processes, the "
                        "hypervisor's steal) took more than this share (0..1) of all cores "
                        "meanwhile: a busy neighbour slows one mode and not another "
                        "(negative: never)")
    s.add_argument("--busy-reruns", type=int, default=2,
                   help="at most this many such reruns per mode and round; the last run is "
                        "kept and named in comparison.md as suspect")
    s.add_argument("--output-dir", required=True, help="directory for the results")
    s.add_argument("--seed", type=int, default=0, help="weights, token ids and profiling seed")
    args = ap.parse_args(argv)
    if args.busy_reruns < 0:
        ap.error("--busy-reruns must be >= 0")
    if args.http:  # these steer the in-process dispatcher; serve.py does not take them
        steer = ("repeats", "long_budget", "decode_gap", "aging", "max_wait", "variant",
                 "cross_pool", "window", "no_buckets", "simulate", "busy_reruns",
                 "max_others_cpu")
        bad = ["--" + n.replace("_", "-") for n in steer if getattr(args, n) != ap.get_default(n)]
        if bad:
            ap.error(f"{', '.join(bad)} cannot be combined with --http")
    try:
        from laps_jax.bench.variants import parse_variant
        args.variant = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        ap.error(f"--variant: {e}")
    return args


def main_http(args) -> int:
    """--http: one real server per mode, the trace replayed over loopback."""
    import json
    from laps_jax.workload.http_compare import HttpCompareOptions, run_http_comparison
    from laps_jax.workload.http_replay import load_workload
    from laps_jax.workload.records import TraceOptions
    e = engine_config_from_args(args)
    serve_args = ["--model", args.model, "--max-model-len", str(e.max_model_len),
                  "--kv-cache-tokens", str(e.kv_cache_tokens), "--page-size", str(e.page_size),
                  "--max-chunk", str(e.max_chunk), "--max-prefill-batch",
                  str(e.max_prefill_batch), "--max-decode-batch", str(e.max_decode_batch)]
    if args.threshold != "auto":
        serve_args += ["--threshold", str(args.threshold)]
    serve_args += ["--order", args.order]
    if args.profile:
        serve_args += ["--latency-profile", args.profile]
    if e.layer_loop:
        serve_args += ["--layer-loop", e.layer_loop]
    if e.attention_backend:
        serve_args += ["--attention-backend", e.attention_backend]
    from laps_jax.config import resolve_model
    vocab = resolve_model(args.model)[0].vocab_size
    work = load_workload(args.trace, args.trace_format, TraceOptions(
        max_requests=args.max_requests, length_scale=args.length_scale,
        time_scale=args.time_scale or 1.0, vocab_size=vocab, max_len=e.max_model_len - 1,
        seed=args.seed))
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    out = run_http_comparison(work, HttpCompareOptions(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py"), serve_args, modes,
        args.http_slo_ms), lambda m: print(m, file=sys.stderr, flush=True))
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "comparison.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    try:
        engine_config_from_args(args)  # settings that cannot work: refused before compiling
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.http:
        return main_http(args)
    from laps_jax.bench.compare import CompareOptions, run_comparison
    from laps_jax.scheduler.window import WindowConfig
    threshold = None if args.threshold == "auto" else int(args.threshold)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    opts = CompareOptions(
        model=args.model, trace=args.trace, trace_format=args.trace_format,
        output_dir=args.output_dir, ecfg=engine_config_from_args(args), modes=modes,
        max_requests=args.max_requests, load=args.load, length_scale=args.length_scale,
        slo_scale=args.slo_scale, threshold=threshold,
        window=WindowConfig(mode=args.window, static_s=args.static_window, max_s=args.window_max),
        buckets=not args.no_buckets, cross_pool=args.cross_pool, order=args.order,
        decode_gap_s=args.decode_gap, long_budget_tokens=args.long_budget, repeats=args.repeats,
        aging_tokens_per_s=args.aging, max_wait_s=args.max_wait,
        time_scale=args.time_scale, profile=args.profile,
        rescale_profile=not args.no_rescale_profile,
        capacity_requests=args.capacity_requests,
        capacity_repeats=args.capacity_repeats, max_output=args.max_output,
        capacity_mode=args.capacity_mode, dtype=args.dtype or "float32", seed=args.seed,
        compile_cache=args.compile_cache, simulate=args.simulate, variants=tuple(args.variant),
        max_others_cpu=None if args.max_others_cpu < 0 else args.max_others_cpu,
        busy_reruns=args.busy_reruns)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    out = run_comparison(opts, log)
    with open(os.path.join(args.output_dir, "comparison.md")) as f:
        print(f.read())
    if "ratio" in out:
        print("goals met (laps/mixed):", out["goals_met"])
    for name, goals in out.get("goals_met_variants", {}).items():
        print(f"goals met ({name}/mixed):", goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
