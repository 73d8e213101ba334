"""Command-line options of `scripts/simulate.py`, and building specs from them.

Kept here (not in the script) so that every knob is documented in one place and tests can build
the same specs the CLI does.
"""

from __future__ import annotations

import argparse
import os

from laps_jax.scheduler import flags as scheduler_flags
from laps_jax.scheduler.policy import MODES
from laps_jax.cluster.inprocess import POLICIES
from laps_jax.sim import hardware
from laps_jax.sim.driver import RunSpec
from laps_jax.sim.instance import GPU_WIDTHS, GridSpec, InstanceSpec
from laps_jax.sim.sweep import WorkloadSource
from laps_jax.workload.family import MEMBERS
from laps_jax.workload.load import add_trace_args
from laps_jax.workload.traces import detect_format

TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "..", "shared", "traces")


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def per_workload(s: str) -> dict[str, int]:
    """'azure=800,lmsys=3000' -> {'azure': 800, 'lmsys': 3000}."""
    out = {}
    for part in s.split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[k.strip()] = int(v)
    return out


REQUESTS = {"azure": 800, "mooncake": 300, "lmsys": 3000, "sessions": 800,
            **{m: 800 for m in MEMBERS}}
ROUTED_REQUESTS = {"azure": 400, "mooncake": 150, "lmsys": 1500, "sessions": 400,
                   **{m: 400 for m in MEMBERS}}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("latency model (roofline from device figures, or a CPU profile)")
    g.add_argument("--preset", default="qwen2.5-32b",
                   help="model preset whose shapes the roofline uses (default qwen2.5-32b)")
    g.add_argument("--hardware", default="h200", choices=sorted(hardware.HARDWARE),
                   help="device figures: h200 = 790 TFLOP/s (80%% of the 989 dense BF16 of the "
                        "datasheet), 4.8 TB/s, 141 GB, 2 ms per step (default)")
    g.add_argument("--peak-tflops", type=float, help="override the attainable TFLOP/s")
    g.add_argument("--mem-tbps", type=float, help="override the memory bandwidth (TB/s)")
    g.add_argument("--step-overhead-ms", type=float, help="override the fixed cost per step")
    g.add_argument("--profile", help="use a profile JSON of scripts/profile_latency.py instead "
                                     "of the roofline (its model preset, e.g. bench-cpu)")


def add_instance_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("instance (one serving process on one device)")
    g.add_argument("--max-chunk", type=int, default=2048, help="widest prefill bucket (2048)")
    g.add_argument("--max-prefill-batch", type=int, default=8, help="rows per prefill bucket (8)")
    g.add_argument("--max-decode-batch", type=int, default=64, help="largest decode bucket (64)")
    g.add_argument("--budget-tokens", type=int, default=None,
                   help="padded tokens per prefill step (default: --max-chunk)")
    g.add_argument("--pow2-widths", action="store_true",
                   help="prefill widths as powers of two only (like the CPU engine) instead of "
                        f"{','.join(map(str, GPU_WIDTHS))}")
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV pool per instance (default: what the device memory holds beside "
                        "the weights; 65536 with --profile)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    g.add_argument("--max-model-len", type=int, default=32768, help="context limit (32768)")
    scheduler_flags.add_args(g, ("threshold", "order", "long_order", "window", "overload_requests",
                                 "no_overload_check", "finish_slack", "static_window_ms"))
    g.add_argument("--spatial-devices", type=int, choices=(1, 2), default=1,
                   help="laps-spatial: both lanes share one device (1, default) or own one each")
    g.add_argument("--spatial-overlap", type=float, default=0.0,
                   help="shared device: extra throughput when both lanes run, 0..1 (0)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")


def add_run_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("workload and serving")
    g.add_argument("--trace-dir", default=os.path.normpath(TRACES),
                   help="directory with azure_llm_2023_conv.csv and "
                        "mooncake_conversation_trace.jsonl (default ../shared/traces)")
    g.add_argument("--sessions-file", default=None, help="a sessions JSONL ('sessions' workload)")
    add_trace_args(g, only=("length_scale", "sample"))
    g.add_argument("--decode", choices=("disaggregated", "colocated"), default="disaggregated",
                   help="disaggregated: prefill instances of a PD deployment (the paper's "
                        "setting; answers' KV returns for the next turn); colocated: each "
                        "instance also decodes (what compare_modes runs)")
    g.add_argument("--tpot-ms", type=float, default=30.0,
                   help="disaggregated: decode time per output token, for session turns (30)")
    g.add_argument("--max-output", type=int, default=None, help="cap output tokens")
    g.add_argument("--slo-scale", type=float, default=5.0,
                   help="TTFT SLO = this x the isolated predicted prefill latency (5)")
    g.add_argument("--seed", type=int, default=0, help="token ids and generated sessions (0)")


def add_run_trace_args(ap: argparse.ArgumentParser, rate_group) -> None:
    """`run`: a trace file of one's own, and the trace flags compare_modes and bench_serving
    take (--time-scale joins `rate_group`: it sets the arrivals as --load and --rate do)."""
    add_trace_args(ap.add_argument_group("trace (as in compare_modes and bench_serving)"),
                   trace_default="--workload's file",
                   max_requests_default="--requests per instance x --instances",
                   only=("trace", "trace_format", "max_requests"))
    add_trace_args(ap, only=("time_scale",), time_scale_group=rate_group,
                   time_scale_default="from --load or --rate")


def resolve_workload(args) -> str:
    """The workload kind of `run`: --trace's format (given or detected) with --trace, else
    --workload (azure)."""
    if not getattr(args, "trace", None):
        if getattr(args, "trace_format", None):
            raise ValueError("--trace-format needs --trace")
        return args.workload or "azure"
    kind = args.trace_format or detect_format(args.trace)
    if args.workload not in (None, kind):
        raise ValueError(f"--workload {args.workload}, but --trace holds a {kind} trace")
    return kind


def model_source(args) -> hardware.ModelSource:
    if args.profile:
        return hardware.from_profile(args.profile)
    hw = hardware.HARDWARE[args.hardware].with_overrides(args.peak_tflops, args.mem_tbps,
                                                         args.step_overhead_ms)
    return hardware.roofline(args.preset, hw)


def instance_spec(args, src: hardware.ModelSource, mode: str = "laps") -> InstanceSpec:
    kv = args.kv_cache_tokens or (hardware.kv_capacity_tokens(src.cfg, src.hardware)
                                  if src.hardware else 65536)
    grid = GridSpec(args.max_chunk, 16, args.max_prefill_batch, args.max_decode_batch,
                    args.budget_tokens, None if args.pow2_widths else
                    tuple(w for w in GPU_WIDTHS if w <= args.max_chunk) + (args.max_chunk,))
    sched = scheduler_flags.from_args(args, mode)
    return InstanceSpec(mode, grid, kv, args.page_size, args.max_model_len, sched,
                        args.spatial_devices, args.spatial_overlap,
                        prefix_cache=not args.no_prefix_cache)


def run_spec(args, inst: InstanceSpec) -> RunSpec:
    return RunSpec(inst, decode=args.decode, tpot_s=args.tpot_ms * 1e-3,
                   max_output=args.max_output, slo_scale=args.slo_scale)


def workload_sources(args, src: hardware.ModelSource) -> dict[str, WorkloadSource]:
    common = {"length_scale": args.length_scale, "sample": args.sample,
              "max_len": min(args.max_model_len, src.cfg.max_context),
              "seed": args.seed}
    paths = {"azure": os.path.join(args.trace_dir, "azure_llm_2023_conv.csv"),
             "mooncake": os.path.join(args.trace_dir, "mooncake_conversation_trace.jsonl"),
             "lmsys": None, "sessions": args.sessions_file, **{m: None for m in MEMBERS}}
    if getattr(args, "trace", None):  # run --trace: that file for its kind
        paths[args.workload] = args.trace
    req = {**REQUESTS, **getattr(args, "requests_per", {})}
    routed = {**ROUTED_REQUESTS, **getattr(args, "router_requests", {})}
    return {k: WorkloadSource(k, path, requests=req[k], routed_requests=routed[k], **common)
            for k, path in paths.items() if k != "sessions" or path}


MODE_HELP = f"modes: {', '.join(MODES)}"
POLICY_HELP = f"router policies: {', '.join(POLICIES)}"
