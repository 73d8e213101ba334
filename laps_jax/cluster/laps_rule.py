"""The `laps` routing decision: the instance where a request is predicted to finish its prefill
first, with short and long groups that keep long work away from short requests.

Why not plain least-load: on a laps instance a short request runs before any queued long work,
so what it waits for is the instance's pending *short* work plus at most one long chunk (the
step in progress), not the instance's whole queue; a long request waits for everything ahead
of it. And an instance with no long work at all gives a short request no chunk to wait out:
that is what the short group is for. So for each eligible instance `i` (none that drains,
unless every one does):

    new_i    = prompt - cached_i          (the history holder computes only the new part;
                                           elsewhere the whole prompt counts)
    wait_i   = short_i + min(long_i, chunk_i)  for a short request (by new_i)
             = short_i + long_i                for a long one, or, when the caller knows
               each pending long request's work: short_i + the long work smaller than this
               request's + at most one chunk of the larger (the long pool runs the least
               remaining first)
    (chunk_i: instance i's own long chunk when the caller knows it, else `chunk_s`)
    wait_i  += decode_i x its prefill steps (cost / chunk, at least one), when the caller knows
               decode_i, one decode step's work on i (0 when nothing decodes there): a laps
               instance runs a decode step before each prefill step while sequences decode
    finish_i = (wait_i + cost(new_i, cached_i)) x speed_i + margin when i is in the other
               group (speed_i: how slow i has lately run against the others, when the caller
               measures it: cluster/pace.py, on by default in router.py; else 1)
    key_i    = finish_i + harm x (cost(new_i, cached_i) - the least cost over the instances)

and the request goes to the least `key_i`. `laps-inflow` stretches a long request's
`wait_i + cost` by 1 / (1 - rho_i), rho_i the share of i's time that the long work no larger
than it, routed there in the last 5 s, takes (`inflow.py`): what arrives while it waits
overtakes it. The margin is `spill_s` (one full prefill step) for long work entering the
short group — zero when that instance is idle, so an idle instance of either group takes the
other group's work — and `cross_s` for short work entering the long group. The last term
charges history recomputed away from its holder as work taken from the other requests, as the
delay a long request adds to larger queued ones is (`harm`): without it laps recomputed 1-5%
more LMSYS tokens than least-load, and with it the simulated H200 study misses fewer SLOs in 7
of its 18 cells and more in 1 (docs/SIMULATION.md; Azure has no shared prefixes and does not
change). The groups follow the compute (`groups.Groups`).

`adaptive` (policy `laps-adaptive`) changes three things, from the same numbers, for traffic
where every instance queues:
- once every eligible instance is `BEHIND_CHUNKS` of its own long chunks behind, and the caller
  counts each instance's requests in flight, the request goes where the SGLang gateway's
  cache-aware rule sends it (`cache_aware.py`: the holder of most of the prompt while the
  counts are balanced, else the fewest in flight). That deep in the queue a predicted finish
  is a poor guide: each instance runs the least remaining first and lets long waiters jump
  ahead, so what a request waits for is mostly work that arrives after it. On the simulated
  H200's overloaded code-chat (8 instances, load 1.3) laps's predicted finish for a request
  under 2,000 new tokens was a third of its real one, and counting requests missed 73 SLOs
  where laps missed 125 (352 vs 475 over five seeds; docs/SIMULATION.md, "Routers on the
  trace family"). The groups still count those requests' work, so a surge placed that way
  sizes them after it. Three chunks is about 0.2 s on an H200, so the rule also fires in
  ordinary Azure and Mooncake bursts, where laps without it does better; the narrower
  conditions tried there (long requests only; pending work also past the request's own cost;
  behind for 0.3-1 s) lost the overloaded case, and 2, 4 or 5 chunks trade the family's
  medium band against its heavy one within five seeds' noise (SIMULATION.md);
- once every eligible instance has at least its own long chunk pending, history recomputed
  away from its holder is charged at `BUSY_RECOMPUTE` x harm: with no instance idle nothing
  absorbs the extra work, it is capacity lost to every request queued behind it, so the
  holder keeps a request while it is up to (1 + 2 harm) x the recomputed cost behind
  (1 + harm without the branch). A first version dropped the group margins in that state
  instead (shortest predicted finish across the groups); the screening had it miss more SLOs
  on RAG under overload (docs/SIMULATION.md, "Routers on the trace family"), so it went;
- a long request that fits one chunk (the 257-1,024-token band on the default grid) waits,
  when the caller cannot list the pending long requests, for the chunk in progress and not for
  all the long work (the long pool runs the least remaining first), plus the delay it adds to
  the one larger request it overtakes (`harm`). Without it the network router priced such a
  request at every queued long token and pushed it where long work was least, not where it
  would start first (the simulator lists the items, so its screening does not see this part).

`busy_shorts` (policy `laps-inflow`): once every eligible instance has short work pending, a
short request is priced at the short work ahead of it and no long chunk. An instance runs its
short batches before its long pool (up to the postpone bound, scheduler/policy.py), so where
short work is pending the chunk a short request would wait out is mostly not in its way; the
chunk priced there steered short requests off the instances with long work onto longer short
queues. On the simulated trace family this took RAG over shared documents under overload from
1.02x prefix's misses to 0.96x (five seeds; its worst cell from 1.30x to 1.15x) and left the
light and medium bands and the issue-#24 cells as they were; pricing no chunk at all, or
none wherever the instance itself has short work pending, lost light load (chat-lmsys 87 and
48 misses against 36; docs/SIMULATION.md, "Routers on the trace family").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence as Seq

from laps_jax.cluster.groups import Groups
from laps_jax.cluster.inflow import stretch
from laps_jax.scheduler.request import LONG, SHORT

IDLE_S = 1e-9
BUSY_RECOMPUTE = 2.0  # adaptive: recomputed history's weight (x harm) when every instance queues
BEHIND_CHUNKS = 3.0   # adaptive: long chunks pending on every instance past which it counts


@dataclasses.dataclass
class LapsInputs:
    """What the rule needs to know about every instance (load units: the caller's, seconds of
    predicted prefill in the simulator, tokens in the network router)."""

    prompt_len: int
    cached: Seq[int]
    loads: Seq[float]          # pending prefill work, both pools
    short_loads: Seq[float]    # of which short
    ok: Seq[bool]              # eligible
    long_items: Seq[Seq[float]] | None = None  # each pending long request's remaining work
    decode_step: Seq[float] | None = None  # per instance, one decode step's work (0: none
                                           # decoding); None: not known
    chunk: Seq[float] | None = None  # per instance, its long chunk's work; None: `chunk_s`
    speed: Seq[float] | None = None  # per instance, how slow it runs now against the others
                                     # (1: as they do; cluster/pace.py); None: all alike
    inflow: Callable[[int, float], float] | None = None  # (instance, work) -> the share of
                                     # its time long work no larger lately takes (inflow.py);
                                     # None: not counted


@dataclasses.dataclass
class LapsDecision:
    instance: int
    short: bool
    cost: float
    cross: bool                # sent to the other group's instance


def old_kind_left(groups: Groups, inp: LapsInputs) -> Callable[[int], float]:
    """Pending work of the kind an instance is leaving (the opposite of its group)."""
    return lambda i: (inp.loads[i] - inp.short_loads[i] if groups.group[i] == SHORT
                      else inp.short_loads[i])


def pending_of(inp: LapsInputs) -> Callable[[int, str], float]:
    return lambda i, kind: (inp.short_loads[i] if kind == SHORT
                            else inp.loads[i] - inp.short_loads[i])


def every_instance_behind(loads: Seq[float], chunk: Seq[float], ok: Seq[bool]) -> bool:
    """Every eligible instance has at least `BEHIND_CHUNKS` of its long chunks pending."""
    return all(loads[i] >= BEHIND_CHUNKS * chunk[i] for i in range(len(loads)) if ok[i])


def pick_laps(inp: LapsInputs, groups: Groups, now: float,
              is_short: Callable[[int, int], bool], cost: Callable[[int, int, bool], float],
              chunk_s: float, spill_s: float, cross_s: float,
              tie: Callable[[int], int], harm: float = 0.0,
              adaptive: bool = False, busy_shorts: bool = False) -> LapsDecision:
    n = len(inp.loads)
    groups.update_draining(old_kind_left(groups, inp))
    total_short = sum(inp.short_loads)
    share = groups.short_share(total_short, sum(inp.loads) - total_short, now)
    groups.rebalance(now, share, inp.ok, pending_of(inp))
    spill_s *= share  # protect the short group as far as there is short work
    members = [i for i in range(n) if inp.ok[i] and not groups.draining[i]]
    members = members or [i for i in range(n) if inp.ok[i]]
    shape = {}  # instance -> (short, predicted cost there)
    for i in members:
        new = max(inp.prompt_len - inp.cached[i], 1)
        short = is_short(new, inp.cached[i])
        shape[i] = short, cost(new, inp.cached[i], short)
    least = min(c for _, c in shape.values())
    chunk_of = lambda i: chunk_s if inp.chunk is None else inp.chunk[i]
    all_queue = adaptive and all(inp.loads[i] >= chunk_of(i) for i in members)
    # laps-inflow: short work pending everywhere, so a short request waits for short work
    shorts_everywhere = busy_shorts and all(inp.short_loads[i] > IDLE_S for i in members)
    best: tuple | None = None
    for i in members:
        short, c = shape[i]
        kind = SHORT if short else LONG
        long_left = max(inp.loads[i] - inp.short_loads[i], 0.0)
        chunk = chunk_of(i)
        if short:  # the long chunk in progress, unless short batches run there now
            ahead = 0.0 if shorts_everywhere else min(long_left, chunk)
        elif adaptive and inp.long_items is None and c <= chunk:  # starts after the chunk
            ahead = min(long_left, chunk) + (harm * c if long_left > chunk else 0.0)
        elif inp.long_items is None:
            ahead = long_left
        else:  # the long pool runs the least remaining first: larger work waits, but for a chunk
            smaller = sum(x for x in inp.long_items[i] if x <= c)
            ahead = smaller + min(long_left - smaller, chunk)
            ahead += harm * c * sum(x > c for x in inp.long_items[i])
        wait = inp.short_loads[i] + ahead
        if inp.decode_step is not None:  # a decode step runs before each of its prefill steps
            wait += inp.decode_step[i] * max(1, math.ceil(c / chunk - 1e-9))
        cross = groups.group[i] != kind
        margin = 0.0
        if cross:
            margin = cross_s if short else (0.0 if inp.loads[i] <= IDLE_S else spill_s)
        if inp.speed is not None:  # the work ahead and its own, at the instance's pace
            wait, c_here = wait * inp.speed[i], c * inp.speed[i]
        else:
            c_here = c
        if inp.inflow is not None and not short:  # smaller long work arriving overtakes it
            f = stretch(inp.inflow(i, c))
            wait, c_here = wait * f, c_here * f
        recompute = harm * (c - least) * (BUSY_RECOMPUTE if all_queue else 1.0)
        key = (wait + c_here + margin + recompute, tie(i))
        if best is None or key < best[0]:
            best = (key, LapsDecision(i, short, c, cross))
    d = best[1]
    groups.observe(SHORT if d.short else LONG, d.cost, now)
    return d
