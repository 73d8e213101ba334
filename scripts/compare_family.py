"""Tabulate the live single-queue check on the trace family: per member, laps (or a candidate
variant) against FCFS and the better of HRRN and SRPT, medians of per-round ratios, and the
worst member at each load.

    python scripts/compare_family.py runs/family_live [--laps laps-ratio]

reads RUN_DIR/MEMBER[/load_X.XX]/comparison.json as `compare_modes.py --output-dir
RUN_DIR/MEMBER` writes them (with --variant hrrn=mixed:order=ratio --variant
srpt=mixed:order=srpt).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from laps_jax.bench.family_live import read_runs  # noqa: E402
from laps_jax.sim.screen import markdown, worst_lines  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                    help="folders holding one compare_modes output folder per member")
    ap.add_argument("--laps", default="laps",
                    help="the mode or variant judged as laps, e.g. a candidate default "
                         "(default: laps)")
    ap.add_argument("--output", default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    try:
        result = read_runs(args.run_dirs, args.laps)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = (f"judged: {args.laps}\n"
            + "".join(f"skipped: {line}\n" for line in result["skipped"])
            + markdown(result, capacity="mixed capacity {:.2f} requests/s"))
    if len({c["fraction"] for c in result["cells"]}) > 1:  # members run at their own loads
        text += "\n".join(worst_lines(result["cells"], "over every run")) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
