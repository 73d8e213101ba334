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

from laps_jax.bench.loads import TARGET_BAND  # noqa: E402
from laps_jax.cli import DefaultsHelpFormatter, add_engine_args, engine_config_from_args  # noqa: E402
from laps_jax.scheduler import flags as scheduler_flags  # noqa: E402
from laps_jax.workload.load import add_trace_args  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=DefaultsHelpFormatter)
    add_engine_args(ap)
    ap.set_defaults(model="bench-cpu", max_model_len=4096, max_chunk=512, max_decode_batch=16,
                    kv_cache_tokens=32768)
    g = ap.add_argument_group("workload")
    add_trace_args(g, time_scale_default="derived from --load, so that mixed runs at that "
                                         "share of its capacity (with --http: 1); give an "
                                         "earlier run's value to replay the same arrivals")
    g.add_argument("--max-output", type=int, default=None,
                   help="cap each request's output tokens (decode steps are costly on a CPU)")
    g.add_argument("--load", type=float, default=None,
                   help="run at this one fraction of mixed's capacity (measured by replaying "
                        "the first --capacity-requests at once) instead of --loads")
    g.add_argument("--loads", default=None, metavar="X,Y,...",
                   help="run the whole comparison at each of these fractions of mixed's "
                        "capacity (capacity measured once, at the first), each in "
                        "DIR/load_X.XX, with DIR/loads.md holding every load's ratios "
                        "(default: 0.5,0.7,0.9 unless --load, --time-scale, "
                        "--target-violation or --http)")
    g.add_argument("--target-violation", nargs="?", const=",".join(map(str, TARGET_BAND)),
                   default=None,
                   metavar="LO,HI",
                   help="instead of a fraction of capacity, probe mixed (FCFS) alone until it "
                        "misses LO-HI of its SLOs (default 0.2,0.4: loaded, not past "
                        "saturation), then compare every mode at that load; the probes are "
                        "in DIR/target_probes and loads.md")
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
    s.add_argument("--profile", default=None,
                   help="profile JSON from scripts/profile_latency.py (default: profile 24 "
                        "shapes now)")
    s.add_argument("--no-rescale-profile", action="store_true",
                   help="use --profile's rates as they are (default: time 8 of its shapes "
                        "now and scale the model by how much slower or faster they run: SLOs "
                        "and plans then fit this machine's speed this hour)")
    scheduler_flags.add_args(s, ("threshold", "window", "static_window", "window_max",
                                 "order", "long_order", "max_wait", "aging", "cross_pool",
                                 "decode_gap",
                                 "long_budget"))
    s.add_argument("--variant", action="append", default=[], metavar="NAME=MODE:KEY=VALUE,...",
                   help="run one more mode: MODE (laps, laps-spatial or mixed) with scheduler "
                        "settings changed, named NAME, with its own ratio to mixed; e.g. "
                        "laps-srpt=laps:order=srpt,max_wait_s=1.5, or a well-ordered single "
                        "queue, hrrn=mixed:order=ratio (keys: order, cross_pool, "
                        "threshold, window_mode, long_budget_tokens, long_chunk_ratio, "
                        "decode_gap_s, aging_tokens_per_s, max_postpone_s, max_wait_s, fill_rows, "
                        "fill_slack, overload_requests: a count or off, overload_check). "
                        "Repeatable: the fair "
                        "A/B of two settings on a shared machine (same arrivals and rounds)")
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
    _resolve_loads(ap, args)
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


def _resolve_loads(ap, args) -> None:
    """One of: --target-violation, one --load / --time-scale / --http run, or --loads (by
    default 0.5, 0.7 and 0.9 of mixed's capacity)."""
    from laps_jax.bench.loads import DEFAULT_LOADS
    single = args.load is not None or args.time_scale is not None or args.http
    if args.target_violation is not None:
        try:
            lo, hi = (float(x) for x in args.target_violation.split(","))
        except ValueError:
            ap.error(f"--target-violation wants LO,HI (e.g. 0.2,0.4), got "
                     f"{args.target_violation!r}")
        if not 0 < lo < hi < 1:
            ap.error(f"--target-violation wants 0 < LO < HI < 1, got {lo},{hi}")
        if single or args.loads is not None:
            ap.error("--target-violation sets the load: it cannot be combined with --load, "
                     "--loads, --time-scale or --http")
        args.target_violation = (lo, hi)
    if args.loads is not None:
        try:
            args.loads = [float(x) for x in args.loads.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--loads wants numbers separated by commas, got {args.loads!r}")
        if not args.loads or any(not x > 0 for x in args.loads) or single:
            ap.error("--loads wants loads > 0 (and no --load, --time-scale or --http)")
    elif not single and args.target_violation is None:
        args.loads = list(DEFAULT_LOADS)
    if args.load is None:
        args.load = 0.8
    elif not args.load > 0:
        ap.error(f"--load must be > 0, got {args.load}")


def main_http(args) -> int:
    """--http: one real server per mode, the trace replayed over loopback."""
    import json
    from laps_jax.workload.http_compare import HttpCompareOptions, run_http_comparison
    from laps_jax.workload.load import load, trace_options_from_args
    e = engine_config_from_args(args)
    serve_args = ["--model", args.model, "--max-model-len", str(e.max_model_len),
                  "--kv-cache-tokens", str(e.kv_cache_tokens), "--page-size", str(e.page_size),
                  "--max-chunk", str(e.max_chunk), "--max-prefill-batch",
                  str(e.max_prefill_batch), "--max-decode-batch", str(e.max_decode_batch)]
    if args.threshold is not None:
        serve_args += ["--threshold", str(args.threshold)]
    # --order is laps' here: mixed stays the FCFS baseline (serve.py would order its queue)
    laps_args = ["--order", args.order] if args.order is not None else []
    if args.profile:
        serve_args += ["--latency-profile", args.profile]
    if e.layer_loop:
        serve_args += ["--layer-loop", e.layer_loop]
    if e.attention_backend:
        serve_args += ["--attention-backend", e.attention_backend]
    from laps_jax.config import resolve_model
    vocab = resolve_model(args.model)[0].vocab_size
    work = load(args.trace_format, args.trace, trace_options_from_args(
        args, vocab_size=vocab, max_len=e.max_model_len - 1, seed=args.seed))
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    out = run_http_comparison(work, HttpCompareOptions(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py"), serve_args, modes,
        args.http_slo_ms, laps_args=laps_args), lambda m: print(m, file=sys.stderr, flush=True))
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
    sched = scheduler_flags.from_args(args)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    opts = CompareOptions(
        model=args.model, trace=args.trace, trace_format=args.trace_format,
        output_dir=args.output_dir, ecfg=engine_config_from_args(args), modes=modes,
        max_requests=args.max_requests, load=args.load, length_scale=args.length_scale,
        sample=args.sample,
        slo_scale=args.slo_scale, threshold=sched.threshold, window=sched.window,
        buckets=not args.no_buckets, cross_pool=sched.cross_pool, order=sched.order,
        long_order=sched.long_order,
        decode_gap_s=sched.decode_gap_s, long_budget_tokens=sched.long_budget_tokens,
        repeats=args.repeats, aging_tokens_per_s=sched.aging_tokens_per_s,
        max_wait_s=sched.max_wait_s,
        time_scale=args.time_scale, profile=args.profile,
        rescale_profile=not args.no_rescale_profile,
        capacity_requests=args.capacity_requests,
        capacity_repeats=args.capacity_repeats, max_output=args.max_output,
        capacity_mode=args.capacity_mode, dtype=args.dtype or "float32", seed=args.seed,
        compile_cache=args.compile_cache, simulate=args.simulate, variants=tuple(args.variant),
        max_others_cpu=None if args.max_others_cpu < 0 else args.max_others_cpu,
        busy_reruns=args.busy_reruns)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    if args.loads or args.target_violation:
        return _run_loads(args, opts, run_comparison, log)
    out = run_comparison(opts, log)
    with open(os.path.join(args.output_dir, "comparison.md")) as f:
        print(f.read())
    if "ratio" in out:
        print("goals met (laps/mixed):", out["goals_met"])
    for name, goals in out.get("goals_met_variants", {}).items():
        print(f"goals met ({name}/mixed):", goals)
    return 0


def _run_loads(args, opts, run_comparison, log) -> int:
    """Every mode at each load of --loads, or at the load --target-violation finds; loads.md."""
    import dataclasses
    from laps_jax.bench.loads import find_target_load, loads_markdown, run_loads
    head, loads = "", args.loads
    if args.target_violation:
        t = find_target_load(opts, args.target_violation, run_comparison, log)
        probes = ", ".join(f"{x:.2f} -> {m:.0%}" for x, m in t.probes)
        head = (f"Load set by --target-violation {args.target_violation[0]:.2f},"
                f"{args.target_violation[1]:.2f}: mixed (FCFS) alone at load (x capacity) -> "
                f"its SLO miss rate: {probes}; "
                + ("in the band" if t.in_band else "none in the band, the closest kept")
                + f"; compared at load {t.load:.2f}.\n\n")
        opts, loads = dataclasses.replace(opts, time_scale=t.time_scale), [t.load]
    table = head + loads_markdown(run_loads(opts, loads, run_comparison, log))
    with open(os.path.join(args.output_dir, "loads.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
