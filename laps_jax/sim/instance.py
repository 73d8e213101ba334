"""One simulated serving instance: the real `Dispatcher` over simulated executors.

An instance is what `scripts/serve.py` runs on one device: a dispatcher in mode mixed, laps or
laps-spatial, its bucket grid, its KV page pool with the prefix cache. Here the executors are
`SimStepExecutor`s, so every decision (admission, classification, pools, waiting window, bucket
choice, decode interleaving) is made by the scheduler's own code; only the step durations come
from the latency model. laps-spatial on one instance runs both lanes on one shared device
(`spatial_devices=1`) unless told it owns two.
"""

from __future__ import annotations

import dataclasses

from laps_jax.config import ModelConfig
from laps_jax.engine.buckets import BucketGrid
from laps_jax.scheduler.clock import Clock
from laps_jax.scheduler.dispatcher import Dispatcher
from laps_jax.scheduler.latency_model import LatencyModel
from laps_jax.scheduler.policy import MODES, SchedulerConfig
from laps_jax.sim.engine import SimEngine
from laps_jax.sim.executor import Calibration, FastGrid, SharedDevice, SimStepExecutor


@dataclasses.dataclass
class GridSpec:
    """The compiled shapes. `tokens=None`: powers of two from min_chunk to max_chunk, like
    `BucketGrid.default`; a list gives the prefill widths explicitly."""

    max_chunk: int = 2048
    min_chunk: int = 16
    max_prefill_batch: int = 8
    max_decode_batch: int = 64
    max_batch_tokens: int | None = None
    tokens: tuple[int, ...] | None = None

    def build(self) -> FastGrid:
        return FastGrid.of(BucketGrid.default(self.max_chunk, self.max_prefill_batch,
                                              self.max_decode_batch, self.min_chunk,
                                              self.max_batch_tokens, self.tokens))


# Prefill widths for a GPU instance: powers of two to 256 (the LAPS graph grid), then steps of
# 256 and 512, so a long chunk pads by at most a few percent instead of up to 2x.
GPU_WIDTHS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)


@dataclasses.dataclass
class InstanceSpec:
    mode: str = "laps"
    grid: GridSpec = dataclasses.field(default_factory=GridSpec)
    kv_cache_tokens: int = 65536
    page_size: int = 16
    max_model_len: int = 32768
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    spatial_devices: int = 1      # laps-spatial: 1 = both lanes share one device, 2 = one each
    spatial_overlap: float = 0.0  # shared device: extra throughput when both lanes run (0..1)
    host_overhead_s: float = 0.0  # per step, outside the latency model
    calibration: Calibration | None = None  # per step kind: speed factor and jitter
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.spatial_devices not in (1, 2):
            raise ValueError("spatial_devices must be 1 or 2")

    @property
    def devices(self) -> int:
        """Devices this instance occupies (what per-device figures divide by)."""
        return self.spatial_devices if self.mode == "laps-spatial" else 1


def build_dispatcher(spec: InstanceSpec, cfg: ModelConfig, model: LatencyModel, clock: Clock,
                     name: str = "i0", grid: BucketGrid | None = None,
                     plan_model: LatencyModel | None = None) -> Dispatcher:
    """A dispatcher (not started) over simulated executors that follow `spec`; steps last what
    `model` predicts, the scheduler plans with `plan_model` (default: the same model; validation
    gives it the one the real run planned with)."""
    grid = grid or spec.grid.build()
    pages = spec.kv_cache_tokens // spec.page_size + 1
    shared = (SharedDevice(spec.spatial_overlap)
              if spec.mode == "laps-spatial" and spec.spatial_devices == 1 else None)

    def executor(lane: str) -> SimStepExecutor:
        engine = SimEngine(grid, pages, spec.page_size, spec.max_model_len, cfg.vocab_size,
                           spec.prefix_cache)
        return SimStepExecutor(engine, model, clock, f"{name}/{lane}", shared,
                               spec.host_overhead_s, spec.calibration)

    long = executor("long") if spec.mode == "laps-spatial" else None
    return Dispatcher(executor("short" if long else spec.mode), spec.mode, spec.scheduler,
                      long_engine=long, clock=clock, latency_model=plan_model or model)


def executors(d: Dispatcher) -> list[SimStepExecutor]:
    return [lane.executor for lane in d.lanes]
