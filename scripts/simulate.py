"""Discrete-event simulation of LAPS serving: the real scheduler on virtual time.

The dispatcher, pools, waiting window, bucket choice and router are the scheduler's own code;
only the device is simulated (each step lasts what a latency model predicts: a roofline from a
device's figures, by default Qwen2.5-32B in bf16 on an H200, or a CPU profile of
scripts/profile_latency.py). Subcommands:

  run       one simulation (a workload at a load, rate or concurrency; 1..N instances)
  sweep     the study: single-instance load sweeps per mode, routed instances per policy,
            fixed-concurrency throughput; writes results.json, tables.md (with the paper's
            claims checked) and PNG figures
  validate  replay a compare_modes output directory in the simulator and put real and
            simulated TTFT p50/p90 per mode and pool side by side (exit 1 beyond tolerance)
  plot      redraw figures and tables from a results.json

Examples:
  python scripts/simulate.py run --workload azure --mode laps --load 0.7
  python scripts/simulate.py run --workload lmsys --mode mixed --instances 4 --policy round-robin --load 0.8
  python scripts/simulate.py sweep --output-dir runs/sim_h200 --figures-dir docs/figures
  python scripts/simulate.py validate runs/sim_validation/azure80 --output runs/sim_validation/v.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laps_jax.bench import validate_command
from laps_jax.sim import cli, route_screen, study

WORKLOADS = "azure, mooncake (../shared/traces), lmsys (generated LMSYS-like sessions), " \
            "sessions (--sessions-file), or a member of the generated trace family " \
            "(laps_jax/workload/family.py: chat-lmsys, code-chat, rag-docs, agent-loop, ...)"


def _settings(text: str) -> dict:
    from laps_jax.bench.variants import parse_settings
    try:
        return parse_settings(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _family_members(text: str) -> list[str]:
    """--members: a comma list, or 'all' for every member of the trace family."""
    if text.strip() == "all":
        from laps_jax.workload.family import MEMBERS
        return list(MEMBERS)
    return cli.csv(str)(text)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="one simulation")
    r.add_argument("--workload", default=None,
                   help=WORKLOADS + " (azure; with --trace: that file's format)")
    r.add_argument("--mode", default="laps", help=cli.MODE_HELP + " (laps)")
    r.add_argument("--instances", type=int, default=1, help="instances behind the router (1)")
    r.add_argument("--policy", default="length-aware",
                   help=cli.POLICY_HELP + "; NAME+hold binds long requests late "
                        "(cluster/hold.py; length-aware)")
    how = r.add_mutually_exclusive_group()
    how.add_argument("--load", type=float, default=0.7,
                     help="offered new tokens/s as a fraction of the devices' physical limit (0.7)")
    how.add_argument("--rate", type=float, default=None, help="offered requests/s instead")
    how.add_argument("--concurrency", type=int, default=None,
                     help="closed loop: this many requests in flight (open-loop traces only)")
    r.add_argument("--requests", type=int, default=None,
                   help="requests per instance (azure 800, mooncake 300, lmsys 3000); "
                        "--max-requests gives the number in all instead")
    r.add_argument("--output", default=None, help="write the result JSON here too")
    for add in (cli.add_model_args, cli.add_instance_args, cli.add_run_args):
        add(r)
    cli.add_run_trace_args(r, how)
    r.set_defaults(func=study.cmd_run)

    s = sub.add_parser("sweep", help="the study (load sweeps, routers, concurrency)")
    s.add_argument("--workloads", type=cli.csv(str), default=["azure", "mooncake", "lmsys"],
                   help=WORKLOADS + " (azure,mooncake,lmsys)")
    s.add_argument("--modes", type=cli.csv(str), default=["mixed", "laps", "laps-spatial"],
                   help="single-instance and concurrency modes (mixed,laps,laps-spatial)")
    s.add_argument("--loads", type=cli.csv(float),
                   default=[0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1],
                   help="single instance: offered loads, new tokens / physical limit "
                        "(0.2,0.4,0.6,0.7,0.8,0.9,1.0,1.1); empty: skip")
    s.add_argument("--requests", dest="requests_per", type=cli.per_workload, default={},
                   help="requests per single-instance run, per workload (azure=800,"
                        "mooncake=300,lmsys=3000: sessions need time to reach steady state)")
    s.add_argument("--instances", type=cli.csv(int), default=[2, 4, 8],
                   help="routed instance counts (2,4,8); empty: skip")
    s.add_argument("--policies", type=cli.csv(str),
                   default=["round-robin", "least-load", "length-aware"], help=cli.POLICY_HELP)
    s.add_argument("--router-modes", type=cli.csv(str), default=["mixed", "laps"],
                   help="instance modes behind the router (mixed,laps)")
    s.add_argument("--router-loads", type=cli.csv(float), default=[0.7, 0.9],
                   help="routed runs: offered loads (0.7,0.9)")
    s.add_argument("--router-requests", type=cli.per_workload, default={},
                   help="requests per instance of a routed run, per workload (azure=400,"
                        "mooncake=150,lmsys=1500)")
    s.add_argument("--concurrency", type=cli.csv(int), default=[8, 32, 128],
                   help="fixed-concurrency throughput runs on azure and mooncake "
                        "(8,32,128); empty: skip")
    s.add_argument("--concurrency-requests", type=int, default=None,
                   help="requests per concurrency run (default: the workload's --requests)")
    s.add_argument("--output-dir", required=True, help="results.json and tables.md go here")
    s.add_argument("--figures-dir", default=None, help="PNG figures (default: --output-dir)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    for add in (cli.add_model_args, cli.add_instance_args, cli.add_run_args):
        add(s)
    s.set_defaults(func=study.cmd_sweep)

    c = sub.add_parser("screen", help="laps vs FCFS, HRRN and SRPT on the trace family")
    from laps_jax.workload.family import MEMBERS
    c.add_argument("--members", type=cli.csv(str), default=list(MEMBERS),
                   help="trace family members, or the study's workloads azure, mooncake, "
                        "lmsys (default: every family member)")
    c.add_argument("--fractions", type=cli.csv(float), default=[0.5, 0.7, 0.9],
                   help="loads as fractions of FCFS's capacity, the load at which FCFS misses "
                        "half its SLOs (0.5,0.7,0.9)")
    c.add_argument("--requests", type=int, default=400, help="requests per run (400)")
    c.add_argument("--laps-settings", type=_settings, default={}, metavar="KEY=VALUE,...",
                   help="screen laps with these scheduler settings changed (compare_modes "
                        "--variant keys), e.g. order=ratio or long_chunk_ratio=10")
    c.add_argument("--capacity-from", default=None, metavar="SCREEN_JSON",
                   help="take each member's FCFS capacity from an earlier screen.json instead "
                        "of finding it again (same members, requests and model)")
    c.add_argument("--output-dir", required=True,
                   help="screen.json, screen.md and screen.png (per workload: short and long "
                        "TTFT p90 and SLO misses by load, a line per policy) go here")
    c.add_argument("--no-figure", action="store_true", help="no screen.png")
    for add in (cli.add_model_args, cli.add_instance_args, cli.add_run_args):
        add(c)
    c.set_defaults(func=study.cmd_screen)

    rs = sub.add_parser("route-screen", help="router policies on the trace family, by load")
    rs.add_argument("--members", type=_family_members, default=["chat-lmsys", "code-chat",
                                                                "rag-docs", "agent-loop"],
                    help="trace family members, or 'all' for every one (default: chat-lmsys,"
                         "code-chat,rag-docs,agent-loop, the four the router was screened on)")
    rs.add_argument("--instances", type=cli.csv(int), default=[2, 4, 8],
                    help="instance counts (2,4,8)")
    rs.add_argument("--loads", type=cli.csv(float), default=[0.5, 0.7, 0.9],
                    help="offered loads, new tokens / physical limit (0.5,0.7,0.9)")
    rs.add_argument("--policies", type=cli.csv(str), default=list(route_screen.POLICIES),
                    help=f"router policies ({','.join(route_screen.POLICIES)})")
    rs.add_argument("--requests", type=int, default=100, help="requests per instance (100)")
    rs.add_argument("--output-dir", required=True,
                    help="rows.jsonl (as it runs), route_screen.json and .md go here")
    rs.add_argument("--miss-split", action="store_true",
                    help="also log and keep where each run's misses are: by pool (short or "
                         "long), history cached or not, and instance (sim/miss_split.py)")
    rs.add_argument("--from-rows", nargs="+", default=None, metavar="ROWS_JSONL",
                    help="run nothing: tabulate these rows.jsonl files (a later file's row "
                         "replaces an earlier one of the same member, N, load and policy)")
    for add in (cli.add_model_args, cli.add_instance_args, cli.add_run_args):
        add(rs)
    rs.set_defaults(func=study.cmd_route_screen)

    v = sub.add_parser("validate", help="simulate a compare_modes run and compare")
    v.add_argument("run_dir", help="compare_modes --output-dir (comparison.json, requests.jsonl)")
    v.add_argument("--profile-override", default=None,
                   help="latency model profile JSON (default: the one the run recorded)")
    v.add_argument("--calibrate", action="store_true",
                   help="scale step times by the run's measured / simulated mean seconds per "
                        "step, per mode (the machine's speed during that mode; not fitted to "
                        "TTFT), add the run's measured host time per step to every step, and "
                        "submit each request as late as the real replay did on average")
    v.add_argument("--calibrate-by", choices=("bucket", "kind", "step"), default="bucket",
                   help="with --calibrate: a factor per compiled shape the run ran 5+ times and "
                        "else per step kind (bucket, default: under load batches grow and the "
                        "shape mix moves, which one factor per kind averages away), one per "
                        "step kind, prefill and decode (kind), or one per mode (step)")
    v.add_argument("--no-jitter", action="store_true",
                   help="with --calibrate-by kind/bucket: leave out the run's measured step jitter")
    v.add_argument("--round", type=int, default=1,
                   help="which round of a compare_modes --repeats run to predict (1)")
    v.add_argument("--all-rounds", action="store_true",
                   help="predict every round the run kept, and show each real round against "
                        "the next (the noise floor); then each cell's median over the rounds, "
                        "real against simulated (what a --repeats run reports; it sets the exit "
                        "status), beside the odd rounds' median against the even rounds'. "
                        "--output then holds {\"rounds\": [...], \"over_rounds\": {...}}")
    v.add_argument("--same-speed", action="store_true",
                   help="also replay both modes with mixed's per-kind calibration and report "
                        "laps/mixed as if the machine had run both modes at the same speed")
    v.add_argument("--same-speed-laps", action="append", metavar="KEY=VALUE",
                   help="with --same-speed: replay laps with this scheduler setting changed "
                        "(order, cross_pool, long_budget_tokens, long_chunk_ratio, "
                        "decode_gap_s, ...: the keys of compare_modes --variant; repeatable)")
    v.add_argument("--same-speed-trace", default=None,
                   help="with --same-speed: replay this trace (same format) on each round's "
                        "calibration instead of the run's")
    v.add_argument("--fit-overlap", action="store_true",
                   help="with --calibrate: laps-spatial takes laps' speed factor and fits the "
                        "overlap of its two lanes on the shared CPU to its measured step seconds")
    v.add_argument("--host-overhead-ms", type=float, default=0.0,
                   help="extra time per step outside the executables (0)")
    v.add_argument("--spatial-overlap", type=float, default=0.0,
                   help="laps-spatial lanes on the shared CPU: extra throughput, 0..1 (0)")
    v.add_argument("--tolerance", type=float, default=0.20, help="allowed relative error (0.20)")
    v.add_argument("--sensitivity", type=float, default=0.0, metavar="D",
                   help="also simulate every step D times slower and faster (e.g. 0.03) and "
                        "show each cell's gain: its relative change per relative change of step "
                        "time. Near saturation gains grow past 5: a 20%% test then asks for step "
                        "times known within 4%%, finer than this machine's drift between rounds "
                        "(2 more simulations per mode)")
    v.add_argument("--repeat", default=None,
                   help="a second compare_modes run with the same settings: also show real vs "
                        "real (the machine's noise floor)")
    v.add_argument("--output", default=None, help="result JSON (+ .md table beside it)")
    v.add_argument("--figure", default=None, help="PNG of real vs simulated")
    v.set_defaults(func=validate_command.cmd_validate)

    p = sub.add_parser("plot", help="redraw tables and figures from results.json files")
    p.add_argument("results", nargs="+", help="results.json of one or more sweeps (merged)")
    p.add_argument("--output-dir", default=None,
                   help="tables.md (and a merged results.json) here (default: beside the first)")
    p.add_argument("--figures-dir", default=None, help="PNG figures (default: --output-dir)")
    p.set_defaults(func=study.cmd_plot)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, not a traceback
        print(f"simulate.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
