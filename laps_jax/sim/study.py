"""The subcommands of `scripts/simulate.py`: one run, a sweep (study), plots.

Each writes a results JSON that carries everything needed to trust or redo it: the latency
model and its sources, the instance spec, the workload summaries, the exact command line.
`validate` (a real compare_modes run against the simulator) is the harness's:
bench/validate_command.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from laps_jax.sim import cli, plots, route_screen, screen, sweep, tables
from laps_jax.sim.driver import simulate
from laps_jax.sim.summary import summarize


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
    if args.instances > 1:  # NAME, or NAME+hold: long requests bound late (cluster/hold.py)
        spec.router, spec.hold_steps = sweep.router_of(args.policy)
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


def _members_known(members: list[str], sources: dict) -> bool:
    """False, with the names it knows on stderr, where --members names a workload it has not."""
    unknown = [m for m in members if m not in sources]
    if unknown:
        print(f"error: unknown --members {', '.join(unknown)}: one of {', '.join(sources)}",
              file=sys.stderr)
    return not unknown


def cmd_screen(args) -> int:
    """laps vs FCFS, HRRN and SRPT on the trace family, at fractions of FCFS's capacity."""
    src = cli.model_source(args)
    inst = cli.instance_spec(args, src)
    sources = cli.workload_sources(args, src)
    if not _members_known(args.members, sources):
        return 2
    policies = dict(screen.POLICIES)
    if args.laps_settings:  # laps screened with settings changed (a candidate default)
        policies["laps"] = ("laps", tuple(args.laps_settings.items()))
    capacity = None
    if args.capacity_from:  # the capacities an earlier screen found: no bisection again
        with open(args.capacity_from) as f:
            capacity = json.load(f)["capacity_load"]
    result = screen.screen(args.members, args.fractions, policies, src, inst, sources,
                           cli.run_spec(args, inst), _log, args.requests, capacity)
    os.makedirs(args.output_dir, exist_ok=True)
    meta = _meta(args, src, inst)
    with open(os.path.join(args.output_dir, "screen.json"), "w") as f:
        json.dump({"meta": meta, **result}, f, indent=1, default=str)
    text = f"command: `{meta['command']}`\n" + screen.markdown(result)
    with open(os.path.join(args.output_dir, "screen.md"), "w") as f:
        f.write(text)
    if not args.no_figure:
        plots.load_sweep(result["rows"], os.path.join(args.output_dir, "screen.png"),
                         "laps vs one queue (FCFS, HRRN, SRPT), simulated", by="policy",
                         x="fraction", metrics=plots.SCREEN_METRICS,
                         xlabel="load (x FCFS capacity)")
    print(text)
    return 0


def cmd_route_screen(args) -> int:
    """Every router policy behind N laps instances on the trace family, by round-robin's load."""
    os.makedirs(args.output_dir, exist_ok=True)
    if args.from_rows:
        rows = route_screen.merge_rows(args.from_rows)
        text = route_screen.markdown(rows)
        with open(os.path.join(args.output_dir, "route_screen.md"), "w") as f:
            f.write(text)
        print(text)
        return 0
    src = cli.model_source(args)
    inst = cli.instance_spec(args, src)
    sources = cli.workload_sources(args, src)
    if not _members_known(args.members, sources):
        return 2
    try:
        for p in args.policies:
            sweep.router_of(p)
    except ValueError as e:
        print(f"simulate.py route-screen: --policies: {e} (or one of those + "
              f"{sweep.HOLD_SUFFIX!r})", file=sys.stderr)
        return 2
    rows = route_screen.screen(args.members, args.instances, args.loads, src, inst, sources,
                               cli.run_spec(args, inst), args.requests, _log,
                               os.path.join(args.output_dir, "rows.jsonl"), args.policies,
                               args.miss_split)
    meta = _meta(args, src, inst)
    with open(os.path.join(args.output_dir, "route_screen.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    text = f"command: `{meta['command']}`\n\n" + route_screen.markdown(rows)
    with open(os.path.join(args.output_dir, "route_screen.md"), "w") as f:
        f.write(text)
    print(text)
    return 0
