"""Violations by new-token band for a finished (or stopped) bench_routers.py run, recounted
from its per-request records: for runs made before routers.md had the band table, or to
read one trace of a run alone (docs/BENCHMARKS.md, "Routers, live").

    python scripts/bench_router_bands.py runs/s26all

Reads RUN_DIR/routers.json (the measured isolated TTFT and the SLO scale) and the
`requests_TRACE_rN_ROUTER.jsonl` files bench_routers.py left beside it; each request's target
is the run's own (`--slo-scale` x its isolated TTFT at its new tokens), the bands and the
pooling are bench_routers.py's (`laps_jax.bench.bands`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from types import SimpleNamespace

from laps_jax.bench import bands as bb
from laps_jax.bench.isolated import IsolatedTTFT

RECORDS = re.compile(r"requests_(?P<trace>.+)_r(?P<round>\d+)_(?P<router>.+)\.jsonl$")


def recount(run_dir: str) -> dict[str, dict]:
    """{trace: {"bands": {router: pooled bands}}}, as `routers.summarize` would give them."""
    with open(os.path.join(run_dir, "routers.json")) as f:
        run = json.load(f)
    if not run.get("isolated_ttft") or not run["args"].get("slo_scale"):
        raise SystemExit(f"{run_dir}: the run timed no isolated TTFT (--slo-scale 0): "
                         "no per-request targets to count against")
    iso = IsolatedTTFT(tuple(run["isolated_ttft"]["tokens"]), tuple(run["isolated_ttft"]["ms"]))
    scale = run["args"]["slo_scale"]
    names = {n.replace(":", "_"): n for n in run["routers"]}
    rounds: dict[str, dict[int, dict]] = {}
    paths = sorted(glob.glob(os.path.join(run_dir, "bench_routers_*", "requests_*.jsonl")))
    for path in paths:
        m = RECORDS.search(os.path.basename(path))
        if m is None or m["router"] not in names:
            continue
        with open(path) as f:
            recs = [SimpleNamespace(**r) for r in map(json.loads, f) if "request_id" in r]
        counts = bb.by_band(recs, lambda r: scale * iso(r.new_tokens))
        rounds.setdefault(m["trace"], {}).setdefault(int(m["round"]), {})[
            names[m["router"]]] = {"bands": counts}
    if not rounds:
        raise SystemExit(f"{run_dir}: no requests_*.jsonl records under bench_routers_*/")
    return {trace: {"bands": {name: bb.pooled_bands([r[name] for r in by.values() if name in r])
                              for name in run["routers"]
                              if any(name in r for r in by.values())}}
            for trace, by in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a bench_routers.py --output-dir")
    args = ap.parse_args(argv)
    for trace, summary in recount(args.run_dir).items():
        print(f"\n### {trace}\n\n{bb.band_markdown(summary)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
