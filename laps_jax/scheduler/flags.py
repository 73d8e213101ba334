"""The command-line flags of `SchedulerConfig` (policy.py), declared once.

serve.py, compare_modes.py and simulate.py each expose some of them (`add_args(group, only)`,
in the order given) and read them back with `from_args`, so a flag means the same thing, with
the same default, wherever it appears. A flag a script does not declare keeps the dataclass
default. Plain Python, like the rest of the serving core.
"""

from __future__ import annotations

from typing import Iterable

from laps_jax.scheduler.policy import ORDERS, SchedulerConfig
from laps_jax.scheduler.window import WindowConfig


def count_or_off(value: str) -> int | None:
    """A whole number, or 'off'/'none' for a setting that None turns off."""
    return None if value.lower() in ("off", "none") else int(value)


def slack_or_off(value: str) -> float | None:
    """A share >= 0, or 'off'/'none' for a setting that None turns off."""
    return None if value.lower() in ("off", "none") else float(value)


def threshold_arg(value: str) -> int | None:
    """An integer, or 'auto' (None: the latency model's crossover)."""
    return None if value.lower() == "auto" else int(value)


_S = SchedulerConfig()
# argparse dest -> add_argument keywords; the flag is --dest with dashes
FLAGS: dict[str, dict] = {
    "threshold": dict(
        type=threshold_arg, default=None,
        help="short/long cut in new tokens after the prefix match: an integer, or 'auto' for "
             "the latency model's compute-bound crossover (256 with no latency model) "
             "(default: auto)"),
    "window": dict(
        choices=("adaptive", "static", "off"), default=WindowConfig.mode,
        help="short-pool waiting window: adaptive (arrival rate and SLO slack), static (a "
             f"fixed length) or off (dispatch at once; ablation) (default: {WindowConfig.mode})"),
    "static_window": dict(
        type=float, default=WindowConfig.static_s,
        help=f"static window length in seconds (default: {WindowConfig.static_s})"),
    "static_window_ms": dict(
        type=float, default=WindowConfig.static_s * 1e3,
        help=f"static window length in ms (default: {WindowConfig.static_s * 1e3:g})"),
    "window_max": dict(
        type=float, default=None,
        help="cap of the adaptive window in seconds (default: half the cheapest predicted "
             "step)"),
    "order": dict(
        choices=ORDERS, default=None,
        help="order of the waiting prefill work: srpt, fewest remaining tokens first with "
             "requests waiting past the wait bound (16 long chunks as predicted) ahead; ratio "
             "(HRRN), highest response ratio (waited + service) / service first, service the "
             "predicted prefill time of the remaining tokens; aging, remaining tokens minus a "
             "linear credit; fcfs, arrival order. laps orders inside each pool by it (default: "
             f"{_S.order}); mixed orders its one queue by it (default: {_S.queue_order}, the "
             "paper's baseline). Where mixed is the baseline beside laps (compare_modes, "
             "simulate.py sweep) it sets laps' order only: a variant such as "
             "hrrn=mixed:order=ratio orders mixed; docs/BENCHMARKS_SCHEDULER.md compares them"),
    "long_order": dict(
        choices=ORDERS, default=None,
        help="laps: order of the long pool alone, e.g. ratio: the largest prompts age instead "
             "of waiting behind every smaller one (default: the --order given, else "
             f"{_S.long_order or _S.order})"),
    "max_wait": dict(
        type=float, default=None,
        help="with --order srpt: seconds after which a request goes ahead of shorter ones "
             "(default: 16 full-budget prefill steps as predicted)"),
    "aging": dict(
        type=float, default=None, metavar="TOKENS_PER_S",
        help="with --order aging: tokens of credit per second waited (default: a quarter of a "
             "full step's tokens per step waited; 0: shortest remaining first, the starvation "
             "bound still applies)"),
    "cross_pool": dict(
        choices=("aging", "short-first"), default=_S.cross_pool,
        help="laps: a ready short batch always runs first (short-first, the LAPS policy), or "
             f"yields to a long request whose score is lower (aging) (default: {_S.cross_pool})"),
    "decode_gap": dict(
        type=float, default=None,
        help="seconds prefill may hold the next decode step back (default: one full-budget "
             "prefill step as predicted, the same bound in every mode; 0: a decode step after "
             "every prefill step)"),
    "long_budget": dict(
        type=int, default=None,
        help="laps: padded tokens per long-pool chunk (default: the widest bucket predicted "
             "to take at most 5 of the cheapest prefill steps, SchedulerConfig."
             "long_chunk_ratio: 256 of 512 for bench-cpu here; laps-spatial: the step budget). "
             "Smaller chunks let short requests in sooner at some throughput cost; while more "
             "than SchedulerConfig.overload_requests (4) long requests wait, laps' long steps "
             "may take twice the chunk where that pads no more tokens"),
    "overload_requests": dict(
        type=count_or_off, default=_S.overload_requests,
        help="laps: long requests waiting past which long steps may take twice the long chunk "
             "(where that pads no more tokens), or 'off' "
             f"(default: {_S.overload_requests})"),
    "finish_slack": dict(
        type=slack_or_off, default=_S.finish_slack,
        help="laps: a long step that finishes its first request carries other requests' "
             "tokens only while predicted at most this share slower than it alone (0.1: 10%%), "
             "or 'off': long steps are filled to the chunk. Needs a latency model (serve.py: "
             "--latency-profile) "
             f"(default: {'off' if _S.finish_slack is None else _S.finish_slack})"),
    "no_overload_check": dict(
        action="store_true",
        help="laps: widen long steps past the overload mark even where that pads more tokens "
             "(the overload mode before its padding check)"),
}

# dest -> the SchedulerConfig field it sets (the window flags set WindowConfig's)
FIELDS = {"threshold": "threshold", "cross_pool": "cross_pool",
          "decode_gap": "decode_gap_s", "long_budget": "long_budget_tokens",
          "aging": "aging_tokens_per_s", "max_wait": "max_wait_s",
          "overload_requests": "overload_requests", "finish_slack": "finish_slack"}


def add_args(g, only: Iterable[str]) -> None:
    """Declares the flags `only` names (argparse dests, keys of FLAGS) on `g`, in that order."""
    for dest in only:
        g.add_argument("--" + dest.replace("_", "-"), **FLAGS[dest])


def from_args(args, mode: str | None = None, **fields) -> SchedulerConfig:
    """The SchedulerConfig the declared flags ask for; `fields` set more of it. A given
    --order orders mixed's one queue when `mode` is mixed, laps' pools otherwise (a script
    that runs mixed as the baseline beside laps passes no mode: its baseline stays FCFS)."""
    has = lambda dest: hasattr(args, dest)
    given = {field: getattr(args, dest) for dest, field in FIELDS.items() if has(dest)}
    if getattr(args, "order", None) is not None:
        given["queue_order" if mode == "mixed" else "order"] = args.order
        if mode != "mixed":  # one order asked for: both of laps' pools, unless --long-order
            given["long_order"] = None
    if getattr(args, "long_order", None) is not None:
        given["long_order"] = args.long_order
    if has("no_overload_check"):
        given["overload_check"] = not args.no_overload_check
    window = {}
    if has("window"):
        window["mode"] = args.window
    if has("static_window"):
        window["static_s"] = args.static_window
    if has("static_window_ms"):
        window["static_s"] = args.static_window_ms * 1e-3
    if has("window_max"):
        window["max_s"] = args.window_max
    return SchedulerConfig(**given, window=WindowConfig(**window), **fields)
