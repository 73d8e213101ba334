"""What a real compare_modes run's lane counters say about the machine it ran on: seconds per
step (per kind and per compiled shape), their spread, the host's time between steps and how
late the replay's timers fired. The validation scales and jitters simulated steps by these.
"""

from __future__ import annotations

import math

import numpy as np


def step_seconds(lanes: list[dict]) -> float:
    return sum(l["counters"]["prefill_seconds"] + l["counters"]["decode_seconds"] for l in lanes)


def num_steps(lanes: list[dict]) -> int:
    return sum(l["counters"]["prefill_steps"] + l["counters"]["decode_steps"] for l in lanes)


KINDS = ("prefill", "decode")


def kind_seconds_per_step(lanes: list[dict], kind: str) -> float | None:
    steps = sum(l["counters"][f"{kind}_steps"] for l in lanes)
    return sum(l["counters"][f"{kind}_seconds"] for l in lanes) / steps if steps else None


def submit_lateness(rows: list[dict]) -> float | None:
    """Mean seconds from a request's stamped arrival to its submit in a real run (None for runs
    recorded before requests carried `submitted`)."""
    late = [r["submitted"] - r["arrival"] for r in rows if r.get("submitted") is not None]
    return float(np.mean(late)) if late else None


def _bucket_sums(lanes: list[dict]) -> dict[str, list[float]]:
    """Per compiled shape ("decode 8x1"), over the lanes: [steps, seconds, seconds^2] (empty for
    runs recorded before lanes kept them)."""
    acc: dict[str, list[float]] = {}
    for l in lanes:
        for key, sums in l["counters"].get("bucket_seconds", {}).items():
            a = acc.setdefault(key, [0, 0.0, 0.0])
            for i in range(3):
                a[i] += sums[i]
    return acc


def bucket_seconds_per_step(lanes: list[dict], min_steps: int = 5) -> dict[str, float]:
    """Mean seconds per step of each compiled shape run at least min_steps times."""
    return {k: s1 / n for k, (n, s1, _) in _bucket_sums(lanes).items() if n >= min_steps}


def _bucket_cv2(lanes: list[dict], kind: str) -> dict[str, tuple[int, float]]:
    """Per compiled shape of one kind: (steps, squared coefficient of variation of its time)."""
    out = {}
    for key, (n, s1, s2) in _bucket_sums(lanes).items():
        if key.startswith(kind + " "):
            mean = s1 / n
            out[key] = (int(n), max(0.0, s2 / n - mean * mean) / (mean * mean) if mean > 0
                        else 0.0)
    return out


def step_jitter(real_lanes: list[dict], sim_lanes: list[dict], kind: str,
                min_steps: int = 5) -> float:
    """The real run's step-to-step spread that the simulation does not already have: per
    shape, the real squared coefficient of variation of step time less the simulated one (which
    comes from contexts differing within a shape), averaged over steps; 0 for runs recorded
    before lanes kept per-shape times."""
    real, sim = _bucket_cv2(real_lanes, kind), _bucket_cv2(sim_lanes, kind)
    pairs = [(n, max(0.0, cv2 - sim.get(key, (0, 0.0))[1]))
             for key, (n, cv2) in real.items() if n >= min_steps]
    steps = sum(n for n, _ in pairs)
    return math.sqrt(sum(n * x for n, x in pairs) / steps) if steps else 0.0


def host_seconds_per_step(lanes: list[dict]) -> float | None:
    """The real lanes' loop time around steps (admission, planning, thread hops) per step;
    None for runs recorded before lanes counted it."""
    if not all("host_seconds" in l["counters"] for l in lanes):
        return None
    steps = num_steps(lanes)
    return sum(l["counters"]["host_seconds"] for l in lanes) / steps if steps else 0.0
