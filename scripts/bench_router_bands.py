"""Violations by new-token band for a finished (or stopped) bench_routers.py run, recounted
from its per-request records: for runs made before routers.md had the band table, or to
read one trace of a run alone (docs/BENCHMARKS.md, "Routers, live").

    python scripts/bench_router_bands.py runs/routers_3traces

Reads RUN_DIR/routers.json (the measured isolated TTFT, the SLO scale, the replays each round
ran) and the per-request records bench_routers.py left beside it (`routers.records_path`);
each request's target is the run's own (`--slo-scale` x its isolated TTFT at its new tokens),
the bands and the pooling are bench_routers.py's (`laps_jax.bench.bands`).
"""

from __future__ import annotations

import argparse
import sys

from laps_jax.bench import bands as bb
from laps_jax.bench.routers import read_run, replay_records, run_targets


def recount(run_dir: str) -> dict[str, dict]:
    """{trace: {"bands": {router: pooled bands}}}, as `routers.summarize` would give them, for
    every replay routers.json lists whose records are on disk."""
    run = read_run(run_dir)
    target = run_targets(run)
    if target is None:
        raise SystemExit(f"{run_dir}: the run timed no isolated TTFT (--slo-scale 0): "
                         "no per-request targets to count against")
    out = {}
    for trace, t in run.get("traces", {}).items():
        rounds = []
        for k, routers in enumerate(t["rounds"]):
            row = {}
            for name in routers:
                recs = replay_records(run_dir, trace, k + 1, name)
                if recs is not None:
                    row[name] = {"bands": bb.by_band(recs, target)}
            rounds.append(row)
        names = list(dict.fromkeys(n for r in rounds for n in r))
        if names:
            out[trace] = {"bands": {n: bb.pooled_bands([r[n] for r in rounds if n in r])
                                    for n in names}}
    if not out:
        raise SystemExit(f"{run_dir}: no request records of its replays under bench_routers_*/")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a bench_routers.py --output-dir")
    args = ap.parse_args(argv)
    for trace, summary in recount(args.run_dir).items():
        print(f"\n### {trace}\n\n{bb.band_markdown(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
