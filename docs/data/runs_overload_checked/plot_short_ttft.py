# The README's figure: TTFT of short requests under laps and under FCFS (mixed), every round of
# the committed Azure run at 0.8 of mixed's capacity (azure_cap_check_r8, 2026-12-01), drawn by
# compare_modes' own plotting (laps_jax.bench.report.plot).
# Run from the repository root: python docs/data/runs_overload_checked/plot_short_ttft.py
import gzip, json, os, tempfile, warnings
from laps_jax.bench.report import plot
from laps_jax.scheduler.request import SHORT, RequestStats

RUN = "docs/data/runs_overload_checked/azure_cap_check_r8/requests.jsonl.gz"
FIELDS = set(RequestStats.__dataclass_fields__)
per_mode = {"FCFS (mixed)": [], "laps": []}
with gzip.open(RUN, "rt") as f:
    for line in f:
        r = json.loads(line)
        name = {"mixed": "FCFS (mixed)", "laps": "laps"}.get(r["mode"])
        if name and r["pool"] == SHORT:
            per_mode[name].append(RequestStats(**{k: v for k, v in r.items() if k in FIELDS}))
warnings.filterwarnings("ignore", "No artists")  # the split's empty long panel
with tempfile.TemporaryDirectory() as tmp:  # plot() also draws a short/long split: not kept
    plot(per_mode, "docs/figures/ttft_short_laps_vs_fcfs.png", os.path.join(tmp, "split.png"),
         title="short requests, Azure trace, 8 rounds")
