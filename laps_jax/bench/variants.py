"""Named scheduler variants: one mode run with some settings changed, beside the others.

Two orders (or thresholds, windows, ...) can only be compared fairly on this shared CPU inside
one compare_modes run: the same arrivals, the same hour, rounds alternating. A variant
`laps-srpt=laps:order=srpt,max_wait_s=1.5` is the mode `laps` with those settings; it runs as a
mode of its own and gets its own ratio to mixed. In a mixed variant `order` orders the one
queue (`hrrn=mixed:order=ratio`, `srpt=mixed:order=srpt`: a well-ordered single queue as a
baseline beside FCFS). The same KEY=VALUE settings serve the
simulator's same-speed replay (`simulate.py validate --same-speed-laps`), and a recorded run's
variants replay in the simulator with their settings.
"""

from __future__ import annotations

import dataclasses

from laps_jax.scheduler.flags import count_or_off, slack_or_off
from laps_jax.scheduler.policy import MODES, ORDERS, SchedulerConfig, check


def flag(value: str) -> bool:
    """'1'/'true'/'on'/'yes' or '0'/'false'/'off'/'no'."""
    v = value.lower()
    if v in ("1", "true", "on", "yes"):
        return True
    if v in ("0", "false", "off", "no"):
        return False
    raise ValueError(value)


# setting -> type. Keys are the names a compare_modes run records in comparison.json `run`;
# `window_mode` is the short pool's waiting window (adaptive, static, off).
SETTINGS = {"order": str, "queue_order": str, "long_order": str, "cross_pool": str,
            "long_budget_tokens": int,
            "long_chunk_ratio": float, "decode_gap_s": float, "window_mode": str, "threshold": int,
            "aging_tokens_per_s": float, "max_postpone_s": float, "max_wait_s": float,
            "fill_rows": flag, "fill_slack": float, "overload_requests": count_or_off,
            "overload_check": flag, "finish_slack": slack_or_off}
# comparison.json keys beside the modes' own: a variant may not be named like one
RESERVED = ("ratio", "ratio_spatial", "goals_met", "ratio_variants", "goals_met_variants", "run",
            "metrics", "rounds", "metrics_rounds")
_CHOICES = {"order": ORDERS, "queue_order": ORDERS, "long_order": ORDERS,
            "cross_pool": ("short-first", "aging"),
            "window_mode": ("adaptive", "static", "off")}


def parse_setting(item: str) -> tuple[str, object]:
    """'KEY=VALUE' -> (key, typed value); a ValueError names what is wrong."""
    key, eq, value = (s.strip() for s in item.partition("="))
    if key not in SETTINGS or not eq or not value:
        raise ValueError(f"a setting is KEY=VALUE with KEY one of {', '.join(SETTINGS)}; "
                         f"got {item!r}")
    try:
        typed = SETTINGS[key](value)
    except ValueError:
        raise ValueError(f"{key} wants a {SETTINGS[key].__name__}; got {value!r}") from None
    if key in _CHOICES and typed not in _CHOICES[key]:
        raise ValueError(f"{key} is one of {', '.join(_CHOICES[key])}; got {value!r}")
    if isinstance(typed, (int, float)) and typed < 0:
        raise ValueError(f"{key} must be >= 0; got {value!r}")
    return key, typed


def parse_settings(items) -> dict:
    """A list of 'KEY=VALUE' (or one comma-separated string of them) -> {key: typed value}."""
    if isinstance(items, str):
        items = [s for s in items.split(",") if s.strip()]
    return dict(parse_setting(i) for i in items or [])


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    mode: str                 # the mode it runs: laps, laps-spatial or mixed
    settings: dict            # SETTINGS keys -> values, applied over the run's own

    def to_dict(self) -> dict:
        return {"mode": self.mode, "settings": dict(self.settings)}


def parse_variant(text: str) -> Variant:
    """'NAME=MODE:KEY=VALUE[,KEY=VALUE...]' -> Variant."""
    name, eq, rest = text.partition("=")
    mode, colon, settings = rest.partition(":")
    name, mode = name.strip(), mode.strip()
    if not eq or not colon or not name:
        raise ValueError(f"a variant is NAME=MODE:KEY=VALUE[,KEY=VALUE], e.g. "
                         f"laps-srpt=laps:order=srpt; got {text!r}")
    if name in MODES or name in RESERVED or "/" in name:
        raise ValueError(f"variant name {name!r} is taken or has a '/': pick another")
    if mode not in MODES:
        raise ValueError(f"variant {name!r}: mode is one of {', '.join(MODES)}; got {mode!r}")
    parsed = parse_settings(settings)
    if mode == "mixed" and "order" in parsed:  # mixed's order is its one queue's
        parsed["queue_order"] = parsed.pop("order")
    if not parsed:
        raise ValueError(f"variant {name!r} changes no setting")
    try:  # refused now, not when its turn comes after minutes of warm-up and other modes
        check(apply(SchedulerConfig(), parsed))
    except ValueError as e:
        raise ValueError(f"variant {name!r}: {e}") from None
    return Variant(name, mode, parsed)


def apply(cfg: SchedulerConfig, settings: dict) -> SchedulerConfig:
    """The scheduler config with `settings` changed."""
    s = dict(settings)
    if "order" in s and "long_order" not in s:  # one order asked for: both of laps' pools
        s["long_order"] = None
    if "window_mode" in s:
        s["window"] = dataclasses.replace(cfg.window, mode=s.pop("window_mode"))
    return dataclasses.replace(cfg, **s)

