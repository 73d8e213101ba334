"""`scripts/simulate.py validate`: a real compare_modes run against the simulator, as tables.

One round or every round the run kept, each real round against the next (the noise floor), the
median over the rounds against its own noise floor, and optionally the same-speed laps/mixed
ratios and a second run of the same settings. Exit status 1 when the prediction misses the
tolerance. Here, not in sim/study.py: validating real runs is the harness's job, and bench may
import sim, never the reverse.
"""

from __future__ import annotations

import dataclasses
import json
import os

from laps_jax.bench import report
from laps_jax.bench.cells import markdown, over_rounds, repeatability, run_rounds
from laps_jax.bench.validate import ValidationOptions, same_speed, validate
from laps_jax.bench.variants import parse_settings
from laps_jax.sim import plots


def cmd_validate(args) -> int:
    if not 0.0 <= args.sensitivity < 0.5:
        raise ValueError(f"--sensitivity is a fraction in [0, 0.5), got {args.sensitivity}")
    vo = ValidationOptions(args.run_dir, args.profile_override, args.spatial_overlap,
                           args.host_overhead_ms * 1e-3, args.calibrate, args.fit_overlap,
                           args.tolerance, calibrate_by=args.calibrate_by,
                           jitter=not args.no_jitter, round=args.round,
                           sensitivity=args.sensitivity)
    with open(os.path.join(args.run_dir, "comparison.json")) as f:
        kept = run_rounds(json.load(f))
    rounds = range(1, kept + 1) if args.all_rounds else [args.round]
    results, table, med = [], "", None
    for k in rounds:
        result = validate(dataclasses.replace(vo, round=k))
        results.append(result)
        table += (f"\nRound {k} of {kept}:\n\n" if args.all_rounds else "") + markdown(result)
    if args.all_rounds and kept > 1:  # the run's own rounds against each other: the noise floor
        for k in range(1, kept):
            rep = repeatability(args.run_dir, args.run_dir, args.tolerance, rounds=(k, k + 1))
            results[k - 1]["repeatability_next_round"] = rep
            table += (f"\nReal round {k} against real round {k + 1} (noise floor):\n\n"
                      + markdown(rep, (f"round {k}", f"round {k + 1}")))
        med = over_rounds(results, args.tolerance)
        table += (f"\nMedian over the {kept} rounds, real against simulated (what a "
                  f"--repeats run reports):\n\n" + markdown(med)
                  + "\nNoise floor of such a median: real, odd rounds' median against even "
                    "rounds':\n\n" + markdown(med["halves"], ("odd", "even")))
        passed = sum(r["within_tolerance"] for r in results)
        table += (f"\n{passed}/{kept} rounds predicted within {100 * args.tolerance:.0f}% in "
                  f"every cell; cells within per round: "
                  + ", ".join(f"{r['cells_within_tolerance']}/{r['cells']}" for r in results)
                  + "\n")
    if args.same_speed:
        settings = parse_settings(args.same_speed_laps)
        same = [same_speed(dataclasses.replace(vo, round=k), settings, args.same_speed_trace)
                for k in rounds]
        table += same_speed_markdown(same)
        for r, sp in zip(results, same):
            r["same_speed"] = sp
    result = results[0]
    if args.repeat:
        rep = repeatability(args.run_dir, args.repeat, args.tolerance)
        result["repeatability"] = rep
        table += ("\nSame settings run twice on this machine (noise floor):\n\n"
                  + markdown(rep, ("run 1", "run 2")))
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"rounds": results, "over_rounds": med} if args.all_rounds else result,
                      f, indent=1)
        with open(os.path.splitext(args.output)[0] + ".md", "w") as f:
            f.write(table)
    if args.figure:
        plots.validation(result, args.figure)
    if args.all_rounds and kept > 1:  # the run's result is its median over the rounds
        return 0 if med["within_tolerance"] else 1
    return 0 if all(r["within_tolerance"] for r in results) else 1


def same_speed_markdown(rounds: list[dict]) -> str:
    keys = list(report.GOALS)
    changed = ", ".join(f"{k}={v}" for k, v in rounds[0]["laps_settings"].items())
    lines = ["\nlaps / mixed as if both modes had run at mixed's speed (simulated, mixed's "
             f"calibration for both; trace {rounds[0]['trace']}"
             + (f"; laps with {changed}" if changed else "") + "):\n",
             "| round | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for r in rounds:
        lines.append(f"| {r['round']} | " + " | ".join(
            "-" if r["ratio"].get(k) is None else f"{r['ratio'][k]:.2f}" for k in keys) + " |")
    if len(rounds) > 1:
        med = report.median_ratio([r["ratio"] for r in rounds])
        lines.append("| median | " + " | ".join(
            "-" if med.get(k) is None else f"{med[k]:.2f}" for k in keys) + " |")
    return "\n".join(lines) + "\n"
