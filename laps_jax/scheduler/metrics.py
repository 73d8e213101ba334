"""Counters the dispatcher keeps for /metrics: plain numbers the server exports as it likes."""

from __future__ import annotations

import dataclasses

from laps_jax.scheduler.executor import ExecutorStats, StepInfo


@dataclasses.dataclass
class LaneCounters:
    """Cumulative counters of one lane (device group), updated on the event loop."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_steps_by_pool: dict[str, int] = dataclasses.field(default_factory=dict)
    prefill_batch_sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    decode_batch_sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    host_seconds: float = 0.0  # loop time around steps (admission, planning, thread hops)
    idle_waits: int = 0
    handoffs_in: int = 0       # requests prefilled elsewhere whose K/V moved here to decode
    failed_steps: int = 0
    filled_long_tokens: int = 0  # laps: long-chunk tokens run in short batches' empty rows
    overload_long_steps: int = 0  # laps: widened long steps (long pool behind)
    # "kind BxT" -> [steps, seconds, seconds^2]: how long and how steady each compiled shape ran
    # (the simulator's validation takes the machine's step-time jitter from it)
    bucket_seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def record(self, info: StepInfo, pool: str = "") -> None:
        if info.kind == "prefill":
            self.prefill_steps += 1
            self.prefill_tokens += info.tokens
            self.prefill_seconds += info.seconds
            self.prefill_steps_by_pool[pool] = self.prefill_steps_by_pool.get(pool, 0) + 1
            hist = self.prefill_batch_sizes
        else:
            self.decode_steps += 1
            self.decode_seconds += info.seconds
            hist = self.decode_batch_sizes
        hist[info.seqs] = hist.get(info.seqs, 0) + 1
        acc = self.bucket_seconds.setdefault(f"{info.kind} {info.bucket[0]}x{info.bucket[1]}",
                                             [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += info.seconds
        acc[2] += info.seconds * info.seconds


@dataclasses.dataclass
class LaneMetrics:
    name: str
    queue_lengths: dict[str, int]   # per pool, plus "admission" and "decode"
    pending_prefill_tokens: dict[str, int]  # per pool, plus "admission" (whole prompts)
    counters: LaneCounters
    window_waits: int
    window_wait_seconds: float
    executor: ExecutorStats


@dataclasses.dataclass
class SchedulerMetrics:
    """A snapshot: `dispatcher.metrics()`. `to_dict()` gives flat JSON-able numbers."""

    mode: str
    submitted: int
    finished: int
    aborted: int
    failed: int
    running: int
    lanes: list[LaneMetrics]

    @property
    def compiles_after_warmup(self) -> int:
        return sum(l.executor.compiles_after_warmup for l in self.lanes)

    def queue_length(self, pool: str) -> int:
        return sum(l.queue_lengths.get(pool, 0) for l in self.lanes)

    @property
    def waiting(self) -> int:
        """Requests whose prefill has not finished: in a pool or not yet admitted."""
        return sum(n for l in self.lanes for p, n in l.queue_lengths.items() if p != "decode")

    def pending_tokens(self, pool: str) -> int:
        return sum(l.pending_prefill_tokens.get(pool, 0) for l in self.lanes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compiles_after_warmup"] = self.compiles_after_warmup
        return d
