"""One router against another over the rounds of one or more bench_routers.py runs made with
the same settings (docs/BENCHMARKS.md, "Routers, live"): each round's SLO violations of both,
their ratio, and over all rounds the median and geometric mean of the ratios, the pooled ratio
with a 90% bootstrap interval, and the rounds won (`laps_jax.bench.pairs`).

    python scripts/bench_router_pairs.py runs/azure_a runs/azure_b runs/azure_c \\
        --trace azure --router laps --against smg:cache_aware

Runs whose settings for the trace differ (load, lengths, instances, serve args, SLO) are
refused, naming the settings, unless --allow-mixed.
"""

from __future__ import annotations

import argparse
import os
import sys

from laps_jax.bench import pairs as bp
from laps_jax.bench.routers import read_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR",
                    help="bench_routers.py --output-dir folders (each holds routers.json)")
    ap.add_argument("--trace", required=True, help="trace kind as the runs name it (azure, ...)")
    ap.add_argument("--router", default="laps", help="the router judged (default laps)")
    ap.add_argument("--against", default="smg:cache_aware",
                    help="the reference router (default smg:cache_aware)")
    ap.add_argument("--allow-mixed", action="store_true",
                    help="pool runs whose settings for the trace differ")
    ap.add_argument("--speed-adjusted", action="store_true",
                    help="recount each replay's misses against targets scaled by how slow the "
                         "instances ran in it (its prefill ms per request over the pair's "
                         "mean): takes the machine's drift within a run out, and also any "
                         "slowdown the router itself causes (read it beside the raw counts); "
                         "needs runs that recorded it and their per-request records")
    ap.add_argument("--draws", type=int, default=10000, help="bootstrap draws (default 10000)")
    args = ap.parse_args(argv)
    dirs = {os.path.basename(os.path.normpath(d)): d for d in args.runs}
    runs = {name: read_run(d) for name, d in dirs.items()}
    if len(runs) != len(args.runs):
        ap.error("two run dirs share a name; give each run its own folder name")
    differ = bp.mismatched(runs, args.trace)
    if differ and not args.allow_mixed:
        print("the runs' settings for this trace differ (--allow-mixed to pool anyway):\n" +
              "\n".join(f"  {k}: {v}" for k, v in differ.items()), file=sys.stderr)
        return 2
    ps = (bp.speed_adjusted(dirs, runs, args.trace, args.router, args.against)
          if args.speed_adjusted else bp.pairs(runs, args.trace, args.router, args.against))
    if not ps:
        print(f"no round of trace {args.trace!r} has both {args.router!r} and "
              f"{args.against!r}" + (" with their speed and per-request records"
                                     if args.speed_adjusted else ""), file=sys.stderr)
        return 2
    print(bp.markdown(ps, bp.summary(ps, args.draws), args.router, args.against), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
