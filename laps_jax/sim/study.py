"""The subcommands of `scripts/simulate.py`: one run, a sweep (study), validation, plots.

Each writes a results JSON that carries everything needed to trust or redo it: the latency
model and its sources, the instance spec, the workload summaries, the exact command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from laps_jax.cluster.inprocess import RouterConfig
from laps_jax.sim import cli, plots, sweep, tables
from laps_jax.sim.driver import simulate
from laps_jax.sim.summary import summarize
from laps_jax.bench import report
from laps_jax.bench.variants import parse_settings
from laps_jax.sim.cells import markdown, over_rounds, repeatability, run_rounds
from laps_jax.sim.validate import ValidationOptions, same_speed, validate


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _meta(args, src, inst) -> dict:
    return {"command": " ".join(["python", "scripts/simulate.py"] + sys.argv[1:]),
            "model_source": src.describe(), "instance": dataclasses.asdict(inst),
            "args": {k: v for k, v in vars(args).items() if k != "func"}}


def cmd_run(args) -> int:
    args.workload = cli.resolve_workload(args)
    if args.requests is not None and args.max_requests is not None:
        raise ValueError("--requests (per instance) and --max-requests (in all) exclude each other")
    src = cli.model_source(args)
    inst = cli.instance_spec(args, src, args.mode)
    spec = cli.run_spec(args, inst)
    spec.instances, spec.concurrency = args.instances, args.concurrency
    spec.time_scale = args.time_scale
    spec.router = RouterConfig(policy=args.policy) if args.instances > 1 else None
    source = cli.workload_sources(args, src)[args.workload]
    per = args.requests or (source.routed_requests if args.instances > 1 else source.requests)
    w = source.get(per * args.instances if args.max_requests is None else args.max_requests)
    if args.concurrency is None and args.time_scale is None:
        spec.rate = (args.rate if args.rate is not None else sweep.rate_for_load(
            args.load, w, src, args.instances * inst.devices))
    result = simulate(spec, src, w)
    out = {"meta": _meta(args, src, inst), "workload": w.summary(),
           "summary": summarize(result, spec, src), "router": result.router}
    text = json.dumps(out, indent=1, default=str)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)
    return 0


def cmd_sweep(args) -> int:
    src = cli.model_source(args)
    inst = cli.instance_spec(args, src)
    base = cli.run_spec(args, inst)
    sources = cli.workload_sources(args, src)
    points = []
    if args.loads:
        points += sweep.single_instance(args.workloads, args.modes, args.loads)
    if args.instances and args.router_loads:
        points += sweep.routed(args.workloads, args.instances, args.policies,
                               args.router_modes, args.router_loads)
    if args.concurrency:
        open_loop = [w for w in args.workloads if w in ("azure", "mooncake")]
        points += sweep.concurrency(open_loop, args.modes, args.concurrency,
                                    args.concurrency_requests)
    _log(f"{len(points)} simulations; model: {src.describe()['latency_model']['device']}")
    os.makedirs(args.output_dir, exist_ok=True)
    rows = sweep.run_points(points, src, inst, sources, base, progress=not args.no_progress,
                            checkpoint=os.path.join(args.output_dir, "points.jsonl"))
    meta = _meta(args, src, inst)
    sweep.save(os.path.join(args.output_dir, "results.json"), meta, rows)
    write_report(rows, meta, args.output_dir, args.figures_dir)
    return 0


def write_report(rows: list[dict], meta: dict, out_dir: str, fig_dir: str | None) -> None:
    """tables.md (all tables + claims) and the figures."""
    names = sorted({r["workload"] for r in rows})
    parts = [f"command: `{meta['command']}`\n"]
    for w in names:
        if any(r["workload"] == w and r["instances"] == 1 and r.get("load") for r in rows):
            parts.append(f"\n### {w}: one instance\n\n" + tables.load_table(rows, w))
        if any(r["workload"] == w and r["instances"] > 1 for r in rows):
            parts.append(f"\n### {w}: routed instances\n\n" + tables.router_table(rows, w))
    if any(r.get("concurrency") for r in rows):
        parts.append("\n### fixed concurrency\n\n" + tables.concurrency_table(rows))
    parts.append("\n### claims\n\n" + tables.claims_table(tables.claims(rows)))
    with open(os.path.join(out_dir, "tables.md"), "w") as f:
        f.write("".join(parts))
    fig_dir = fig_dir or out_dir
    os.makedirs(fig_dir, exist_ok=True)
    title = f"{meta['model_source']['model']} on {meta['model_source'].get('hardware', {}).get('name', 'profile')} (simulated)"
    if any(r["instances"] == 1 and r.get("load") for r in rows):
        plots.load_sweep(rows, os.path.join(fig_dir, "sim_load_sweep.png"), title)
    multi = [r for r in rows if r["instances"] > 1]
    for load in sorted({r["load"] for r in multi}):
        plots.router(rows, os.path.join(fig_dir, f"sim_router_load{load:.2f}.png"), load, title)
    if any(r.get("concurrency") for r in rows):
        plots.concurrency(rows, os.path.join(fig_dir, "sim_concurrency.png"), title)


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


def cmd_plot(args) -> int:
    """Tables and figures from one or more results.json (rows merged; later files win on the
    same point), written to --output-dir (default: beside the first file)."""
    merged: dict[tuple, dict] = {}
    metas = []
    for path in args.results:
        with open(path) as f:
            d = json.load(f)
        metas.append(d["meta"])
        for r in d["points"]:
            key = tuple(r.get(k) for k in ("workload", "mode", "instances", "policy", "load",
                                           "concurrency"))
            merged[key] = r
    rows = list(merged.values())
    out = args.output_dir or os.path.dirname(os.path.abspath(args.results[0]))
    os.makedirs(out, exist_ok=True)
    meta = dict(metas[0], command=" + ".join(m["command"] for m in metas))
    if len(args.results) > 1:
        sweep.save(os.path.join(out, "results.json"), meta, rows)
    write_report(rows, meta, out, args.figures_dir)
    return 0
