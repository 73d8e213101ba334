"""Devices described by their numbers, and the latency models the simulator runs on.

The simulator never times anything: a step lasts what a `LatencyModel` predicts. That model comes
either from a device's figures (a roofline: compute rate, memory bandwidth, fixed per-step
overhead) or from a profile of this machine written by `scripts/profile_latency.py`. Every figure
carries its source, because a simulated result is only as honest as the numbers under it.

H200 figures used (NVIDIA H200 SXM datasheet, nvidia.com/en-us/data-center/h200):
- 989 TFLOP/s dense BF16 tensor-core peak (the datasheet's 1,979 assumes 2:4 sparsity); we
  use 80% of it, 790 TFLOP/s, as attainable for large GEMMs. This workplace measured 788 TFLOP/s
  on a bf16 GEMM on its own H200 (`H200_MEASURED` in scheduler/latency_model.py), which agrees.
- 4.8 TB/s HBM3e bandwidth (datasheet peak; a device-to-device copy measured 4.3 TB/s here).
- 141 GB HBM3e (datasheet), of which 10% is kept for activations and workspace.
- 2 ms fixed cost per step: an assumption (host-side scheduling, launch, sampling, the token
  id transfer of a Python-driven server), not a measurement; `--step-overhead-ms` changes it.
"""

from __future__ import annotations

import dataclasses
import json

from laps_jax.config import PRESETS, ModelConfig
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: the rates the roofline needs plus its memory, each with a source."""

    name: str
    peak_flops: float          # attainable dense FLOP/s used by the model
    mem_bandwidth: float       # bytes/s
    memory_bytes: float        # device memory
    step_overhead_s: float     # fixed cost of every step
    memory_reserve: float = 0.10  # share of memory kept for activations and workspace
    sources: tuple[str, ...] = ()

    def device_spec(self) -> DeviceSpec:
        return DeviceSpec(self.name, self.peak_flops, self.mem_bandwidth, self.step_overhead_s)

    def with_overrides(self, peak_tflops: float | None = None, mem_tbps: float | None = None,
                       step_overhead_ms: float | None = None) -> Hardware:
        """A copy with some figures replaced (the sources list says so)."""
        h, notes = self, []
        if peak_tflops is not None:
            h = dataclasses.replace(h, peak_flops=peak_tflops * 1e12)
            notes.append(f"peak overridden to {peak_tflops} TFLOP/s")
        if mem_tbps is not None:
            h = dataclasses.replace(h, mem_bandwidth=mem_tbps * 1e12)
            notes.append(f"bandwidth overridden to {mem_tbps} TB/s")
        if step_overhead_ms is not None:
            h = dataclasses.replace(h, step_overhead_s=step_overhead_ms * 1e-3)
            notes.append(f"step overhead overridden to {step_overhead_ms} ms")
        return dataclasses.replace(h, sources=h.sources + tuple(notes))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


H200 = Hardware(
    "h200", 790e12, 4.8e12, 141e9, 2e-3,
    sources=(("peak: 80% of the 989 TFLOP/s dense BF16 of the NVIDIA H200 SXM datasheet "
              "(788 TFLOP/s measured on this workplace's H200 agrees)"),
             "bandwidth: 4.8 TB/s HBM3e, NVIDIA H200 SXM datasheet",
             "memory: 141 GB HBM3e, NVIDIA H200 SXM datasheet; 10% reserved",
             "step overhead: 2 ms, an assumption (host scheduling + launch + sampling)"))
HARDWARE = {"h200": H200}


def flops_per_token(cfg: ModelConfig) -> float:
    """Dense prefill FLOPs per new token, counted as 2 x all parameters (65.5 GFLOP for
    Qwen2.5-32B; the matmuls alone are 64.0, attention adds a context-dependent share)."""
    return 2.0 * cfg.num_params()


def physical_limit_tokens_per_s(cfg: ModelConfig, hw: Hardware) -> float:
    """The most new (computed) prompt tokens one device can prefill per second."""
    return hw.peak_flops / flops_per_token(cfg)


def kv_capacity_tokens(cfg: ModelConfig, hw: Hardware, itemsize: int = 2) -> int:
    """KV tokens that fit beside the weights: (memory x (1 - reserve) - weights) / KV per token."""
    free = hw.memory_bytes * (1.0 - hw.memory_reserve) - cfg.num_params() * itemsize
    if free <= 0:
        raise ValueError(f"{cfg.name} in {itemsize}-byte weights does not fit in {hw.name}")
    return int(free // cfg.kv_bytes_per_token(itemsize))


@dataclasses.dataclass
class ModelSource:
    """Where a simulation's step latencies come from (written into every result)."""

    model: LatencyModel
    cfg: ModelConfig
    kind: str                      # "roofline" or "profile"
    hardware: Hardware | None = None
    profile_path: str | None = None

    @property
    def limit_tokens_per_s(self) -> float | None:
        return physical_limit_tokens_per_s(self.cfg, self.hardware) if self.hardware else None

    def describe(self) -> dict:
        d = {"kind": self.kind, "model": self.cfg.name, "latency_model": self.model.to_dict(),
             "threshold_new_tokens": {str(c): self.model.threshold(c) for c in (0, 2048, 8192)}}
        if self.hardware:
            d.update(hardware=self.hardware.to_dict(),
                     flops_per_token=flops_per_token(self.cfg),
                     physical_limit_tokens_per_s=self.limit_tokens_per_s)
        if self.profile_path:
            d["profile"] = self.profile_path
        return d


def roofline(preset: str, hw: Hardware = H200, itemsize: int = 2) -> ModelSource:
    """The roofline latency model of a preset on a device given by its figures (bf16: 2)."""
    cfg = PRESETS[preset]
    return ModelSource(LatencyModel(cfg, itemsize, hw.device_spec()), cfg, "roofline", hw)


def from_profile(path: str, preset: str | None = None) -> ModelSource:
    """The fitted model in a profile JSON of `scripts/profile_latency.py`."""
    with open(path) as f:
        d = json.load(f)
    cfg = PRESETS[preset or d["model"]]
    return ModelSource(LatencyModel.from_dict(d["latency_model"], cfg), cfg, "profile",
                       profile_path=path)
