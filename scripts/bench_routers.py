"""Live router benchmark: the same arrivals through each router in front of the same serve.py
instances, several rounds, median and range (laps_jax/bench/routers.py; docs/BENCHMARKS.md).

    python scripts/bench_routers.py --rounds 3 --max-requests 60 --max-requests-for azure=200 \\
        --length-scale 0.25 --length-scale-for mooncake=0.1 --time-scale 2.2 \\
        --time-scale-for sessions=0.15 --time-scale-for mooncake=5 --output-dir runs/routers

Choose each trace's time scale for a load the instances can serve (a round-robin round
missing a few percent of its SLOs): at their limit every instance is busy and every router
looks alike (docs/SIMULATION.md, "Router policies"). A time scale is not a load from one day to the
next on a shared machine: the isolated-TTFT ladder printed first says how fast it is today.

Mooncake's follow-up turns come minutes after their previous turn (median 123 s), so its
first requests reuse almost nothing (3% of blocks in the first 100) and a time scale only
stretches the turns further apart. `--sample-for mooncake=0.05` keeps 5% of its
conversations, whole: a window of the same load that holds the trace's prefix reuse.

`--block 100` compares routers a minute apart instead of a round apart: every router replays
the trace's first 100 requests, then every router the next 100, and so on (each block is one
pair in routers.json and bench_router_pairs.py). Cutting loses the queue carried over a block
boundary and, on Mooncake, the history a later block would reuse from an earlier one. A
sessions trace is closed loop and replays whole.

Where each router put the work: each replay's records keep the instance the router named
(`served_by`), and routers.json each round's `placement` (requests, prompt tokens computed and
tokens decoded per instance) and `busiest_prefill_share` (laps_jax/bench/placement.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile

from laps_jax.bench import bands
from laps_jax.bench.load_groups import load_markdown
from laps_jax.bench import router_procs as rp
from laps_jax.bench import routers as rb
from laps_jax.bench.isolated import measure as measure_isolated
from laps_jax.bench.order import round_order
from laps_jax.workload.load import FORMATS, add_trace_args, load, trace_options_from_args
from laps_jax.workload.sampling import is_fraction

HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = (f"azure:{HERE}/../../shared/traces/azure_llm_2023_conv.csv",
          f"mooncake:{HERE}/../../shared/traces/mooncake_conversation_trace.jsonl",
          f"sessions:{HERE}/../docs/data/sessions_200.jsonl")


# A trace option one trace kind may set for itself: (type, valid value, why)
PER_KIND = {
    "time_scale": (float, lambda v: 0 <= v < float("inf"),
                   "each trace replayed at a load the instances can serve"),
    "max_requests": (int, lambda n: n >= 1, "enough requests for rare violations to count on "
                     "one trace, a short replay on another"),
    "length_scale": (float, lambda v: 0 < v < float("inf"), "a long-context trace (Mooncake) cut "
                     "further than the others, so its replay stays short"),
    "sample": (float, is_fraction, "a trace whose follow-up turns come minutes apart "
               "(Mooncake) thinned by conversation, so its window holds them"),
}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="append", metavar="[NAME=]KIND:PATH",
                    help=f"a trace to replay, KIND one of {', '.join(FORMATS)}, reported as "
                         "NAME (default: KIND; name two traces of one kind, e.g. "
                         "code-chat=sessions:runs/family/code-chat.jsonl) (repeat; default: "
                         "the Azure conversation trace, the Mooncake trace and "
                         "docs/data/sessions_200.jsonl)")
    add_trace_args(ap, only=("max_requests", "length_scale", "time_scale", "sample"))
    for field, (cast, _, why) in PER_KIND.items():
        meta = "N" if cast is int else "X"
        ap.add_argument(f"--{field.replace('_', '-')}-for", dest=f"{field}_for", action="append",
                        default=[], metavar=f"NAME={meta}",
                        help=f"--{field.replace('_', '-')} for one trace, by its name or "
                             f"kind (repeat): {why}")
    ap.add_argument("--routers", default=",".join(rb.DEFAULT_ROUTERS),
                    help="comma-separated: POLICY of scripts/router.py, or smg:POLICY, or "
                         "LABEL=POLICY FLAGS... to add the router's own flags under a name "
                         "(e.g. 'rr-affinity=round-robin' for ours with its prefix-affinity rule; default: "
                         "%(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--block", type=int, default=0, metavar="N",
                    help="cut each open-loop trace into consecutive blocks of N requests and "
                         "run every router over a block before the next block starts (the "
                         "order changing each block: bench/order.py); each block is a pair in "
                         "routers.json's rounds, so routers are compared a minute apart "
                         "rather than a round apart on a machine whose speed drifts; a "
                         "sessions trace still replays whole (default 0: whole replays)")
    ap.add_argument("--instances", type=int, default=3, help="serve.py instances (default 3)")
    ap.add_argument("--model", default="bench-cpu", help="model of every instance (default "
                    "bench-cpu)")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="context of every instance; prompts are cut to fit (default 2048)")
    ap.add_argument("--serve-args", default="", help="more serve.py flags, one string")
    ap.add_argument("--pin-cpus", default=None, metavar="0,1,2",
                    help="pin instance k to core k (mod the list) with taskset (default: no "
                         "pinning; every instance runs one XLA thread either way)")
    ap.add_argument("--slo-scale", type=float, default=5.0,
                    help="each request's TTFT SLO is this x its isolated TTFT, measured on an "
                         "idle instance before the replays, as the simulator's --slo-scale "
                         "(default 5; 0: only the fixed --slo-ms)")
    ap.add_argument("--slo-ms", type=float, default=1000.0,
                    help="a fixed TTFT target for every request, reported beside the SLO "
                         "(as compare_modes --http-slo-ms; default 1000)")
    ap.add_argument("--short-threshold", type=int, default=256,
                    help="new tokens at or under this count as short (default 256)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed warm-up replay (by default, after the isolated-TTFT "
                         "ladder, the first trace goes through a round-robin router once "
                         "before anything is measured: the first replay after start missed "
                         "several times the SLOs of the same routing later)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    ap.add_argument("--output-dir", required=True)
    args = ap.parse_args(argv)
    args.trace = args.trace or list(TRACES)
    try:
        args.routers = [rp.RouterSpec.parse(n.strip()) for n in args.routers.split(",")
                        if n.strip()]
        args.trace = [_trace_spec(t) for t in args.trace]
    except (ValueError, IndexError) as e:
        ap.error(str(e))
    names = [n for n, _, _ in args.trace]
    if len(set(names)) < len(names):
        ap.error(f"two traces are named alike ({', '.join(names)}): give each NAME=KIND:PATH")
    for field, (cast, ok, _) in PER_KIND.items():
        flag, meta = f"--{field.replace('_', '-')}-for", "N" if cast is int else "X"
        try:
            pairs = (kv.split("=", 1) for kv in getattr(args, f"{field}_for"))
            values = {k: cast(x) for k, x in pairs}
        except ValueError:
            ap.error(f"{flag} takes NAME={meta}")
        if not all(ok(v) for v in values.values()):
            ap.error(f"{flag}: {field.replace('_', ' ')} out of range in {values}")
        setattr(args, f"{field}_for", values)
    bad = [k for _, k, _ in args.trace if k not in FORMATS]
    bad += [k for field in PER_KIND for k in getattr(args, f"{field}_for")
            if k not in FORMATS and k not in names]
    if args.slo_scale < 0 or args.slo_ms <= 0:
        ap.error("--slo-scale must be >= 0 and --slo-ms > 0")
    if args.block < 0:
        ap.error("--block must be >= 0")
    if bad or args.rounds < 1 or args.instances < 1:
        ap.error(f"unknown trace kind or name {bad} (a kind is one of {', '.join(FORMATS)})"
                 if bad
                 else "--rounds and --instances must be >= 1")
    return args


def _trace_spec(text: str) -> tuple[str, str, str]:
    """`[NAME=]KIND:PATH` -> (name, kind, path); the name defaults to the kind."""
    name, sep, rest = text.partition("=")
    if not sep or ":" in name:  # no name given (or the "=" belongs to the path)
        name, rest = "", text
    kind, sep, path = rest.partition(":")
    if not sep or not path:
        raise ValueError(f"--trace wants [NAME=]KIND:PATH, got {text!r}")
    return name or kind, kind, path


def options_for(args, name: str, vocab: int):
    """The trace options of one trace (by its name): the common flags, then its kind's --*-for
    ones, then its name's."""
    kind = {n: k for n, k, _ in args.trace}.get(name, name)
    opts = trace_options_from_args(args, vocab_size=vocab, max_len=args.max_model_len - 1,
                                   seed=args.seed)
    own = {}
    for key in (kind, name):
        own.update({field: getattr(args, f"{field}_for")[key] for field in PER_KIND
                    if key in getattr(args, f"{field}_for")})
    return dataclasses.replace(opts, **own)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rp.exit_on_sigterm()  # a stopped run keeps its results and leaves no instance
    from laps_jax.config import resolve_model
    vocab = resolve_model(args.model)[0].vocab_size
    serve_args = ["--model", args.model, "--max-model-len", str(args.max_model_len),
                  *shlex.split(args.serve_args)]
    works = {name: load(kind, path, options_for(args, name, vocab))
             for name, kind, path in args.trace}
    os.makedirs(args.output_dir, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="bench_routers_", dir=args.output_dir)
    cpus = [int(c) for c in args.pin_cpus.split(",")] if args.pin_cpus else None
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say(f"starting {args.instances} instances ({' '.join(serve_args)}); logs in {logs}")
    instances = rp.start_instances(args.instances, serve_args, logs, cpus)
    rounds: dict[str, list] = {name: [] for name in works}
    parts = {name: rb.blocks(work, args.block) for name, work in works.items()}
    per_round = {name: len(blocks) for name, blocks in parts.items()}
    isolated, target_ms = None, None
    try:
        if args.slo_scale > 0:
            say("timing isolated TTFT on an idle instance")
            isolated = measure_isolated(instances[0].url, vocab, args.max_model_len - 2)
            say("isolated TTFT ms: " + ", ".join(f"{n}: {m:.0f}" for n, m in
                                                 zip(isolated.tokens, isolated.ms)))
            target_ms = lambda rec: args.slo_scale * isolated(rec.new_tokens)  # noqa: E731
        if not args.no_warmup:  # the first replay after start, or after the isolated ladder
            # (once: 11% more instance CPU for the same work), runs slow
            say("warm-up: one untimed round-robin replay of the first trace")
            rb.run_round(next(iter(works.values())), instances,
                         [rp.RouterSpec("laps", "round-robin")], args.slo_ms,
                         args.short_threshold, logs, lambda m: None)
        for r in range(args.rounds):
            for name, blocks in parts.items():
                for b, part in enumerate(blocks):
                    block_no = b + 1 if len(blocks) > 1 else 0  # 0: the trace replays whole
                    say(f"round {r + 1}/{args.rounds}, {name}"
                        + (f", block {block_no}/{len(blocks)}" if block_no else ""))
                    order = round_order(args.routers, r * len(blocks) + b)
                    tag = rb.round_tag(name, r + 1, block_no)
                    rounds[name].append(rb.run_round(part, instances, order, args.slo_ms,
                                                     args.short_threshold, logs, say, tag=tag,
                                                     target_ms=target_ms))
                    write_results(args, isolated, rounds, per_round, complete=False)
    finally:
        for p in instances:
            p.stop()
    print(write_results(args, isolated, rounds, per_round, complete=True))
    return 0


def write_results(args, isolated, rounds: dict[str, list], per_round: dict[str, int],
                  complete: bool) -> str:
    """routers.json and routers.md from the rounds done so far (written after every trace's
    round, so a run stopped early keeps them; `complete` says whether it ran to its end;
    `per_round`: each trace's blocks per round, 1 for a whole replay)."""
    out = {"args": {k: v for k, v in vars(args).items() if k != "routers"},
           "routers": [s.name for s in args.routers], "xla_flags": rp.ONE_THREAD_XLA_FLAGS,
           "complete": complete, "isolated_ttft": isolated.to_json() if isolated else None,
           "blocks_per_round": per_round,
           "traces": {name: {"rounds": rs, "summary": rb.summarize(rs)}
                      for name, rs in rounds.items() if rs}}
    with open(os.path.join(args.output_dir, rb.RUN_FILE), "w") as f:
        json.dump(out, f, indent=1)
    text = "".join(f"\n### {name}\n\n{rb.markdown(v['summary'])}"
                   + (f"\n{b}" if (b := bands.band_markdown(v["summary"])) else "")
                   + (f"\n{g}" if (g := load_markdown(v["summary"].get("load_groups", {})))
                      else "")
                   for name, v in out["traces"].items())
    with open(os.path.join(args.output_dir, "routers.md"), "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
