"""Write seeded multi-turn sessions as sessions JSONL: LMSYS-Chat-1M-shaped chat, or a member
of the generated trace family (laps_jax/workload/family.py) that compare_modes, bench_serving
and simulate.py replay with --trace.

    python scripts/make_sessions.py --sessions 200 --seed 0 --rate 2 --output runs/sessions.jsonl
    python scripts/make_sessions.py --member rag-docs --sessions 300 --rate 2 --output runs/rag.jsonl
    python scripts/make_sessions.py --list
"""

from __future__ import annotations

import argparse
import os
import sys

import dataclasses

from laps_jax.workload.family import MEMBERS, member
from laps_jax.workload.generator import SessionGenConfig, generate_sessions
from laps_jax.workload.sessions import session_summary, write_sessions_jsonl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--member", default=None,
                   help="a trace family member (its lengths, turns, think times, bursts and "
                        "shared prefixes; --mean-turns and --max-turns then do not apply)")
    p.add_argument("--list", action="store_true", help="list the family's members and exit")
    p.add_argument("--sessions", type=int, default=None, help="number of sessions")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed (default 0; with --member, added to the member's own)")
    p.add_argument("--rate", type=float, default=1.0,
                   help="Poisson session arrival rate, sessions per second (default 1)")
    p.add_argument("--output", default=None, help="sessions JSONL file to write")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every input/output length (min 1 token), e.g. 0.25 for CPU")
    p.add_argument("--mean-turns", type=float, default=3.0,
                   help="mean turns per session, geometric (default 3)")
    p.add_argument("--max-turns", type=int, default=16, help="cap on turns per session")
    args = p.parse_args(argv)
    if args.list:
        for m in MEMBERS.values():
            print(f"{m.name:22s} {m.kind:6s} {m.what}")
        return 0
    if args.sessions is None or args.output is None:
        p.error("--sessions and --output are required (or --list)")
    try:
        if args.member:
            m = member(args.member)
            cfg = dataclasses.replace(m.config, rate=args.rate, length_scale=args.length_scale)
            seed = m.seed + args.seed
        else:
            cfg = SessionGenConfig(rate=args.rate, mean_turns=args.mean_turns,
                                   max_turns=args.max_turns, length_scale=args.length_scale)
            seed = args.seed
        sessions = generate_sessions(args.sessions, cfg, seed=seed)
    except ValueError as e:
        p.error(str(e))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    write_sessions_jsonl(sessions, args.output)
    n_req = sum(len(s.turns) for s in sessions)
    print(f"wrote {len(sessions)} sessions ({n_req} requests) to {args.output}", file=sys.stderr)
    for name, s in session_summary(sessions).items():
        print(f"  {name:22s} n={s.count:6d} p50={s.p50:8.1f} p90={s.p90:8.1f} "
              f"under {s.threshold}: {s.frac_under:.1%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
