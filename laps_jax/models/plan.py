"""Memory plan: weight bytes, KV bytes per token, and how many KV tokens fit on a device."""

from __future__ import annotations

import dataclasses

import numpy as np

from laps_jax.config import ModelConfig

GB = 1e9
DEVICES_GB = {"h200": 141.0, "h100": 80.0, "a100-80g": 80.0, "a100-40g": 40.0}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str
    dtype: str
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    device_bytes: int
    reserved_bytes: int
    kv_tokens: int

    def format(self) -> str:
        return "\n".join([
            f"model            {self.model} ({self.num_params / 1e9:.3f} B parameters)",
            f"dtype            {self.dtype}",
            f"weights          {self.weight_bytes / GB:.2f} GB",
            f"KV per token     {self.kv_bytes_per_token / 1024:.1f} KiB",
            f"device memory    {self.device_bytes / GB:.1f} GB "
            f"({self.reserved_bytes / GB:.1f} GB kept for activations and runtime)",
            f"KV tokens fit    {self.kv_tokens:,}",
        ])


def memory_plan(cfg: ModelConfig, dtype: str = "bfloat16", device_gb: float = 141.0,
                reserve_fraction: float = 0.1) -> MemoryPlan:
    """Everything here comes from shapes: nothing is allocated."""
    itemsize = np.dtype({"bfloat16": np.float16, "float32": np.float32}[dtype]).itemsize
    n = cfg.num_params()
    weight = n * itemsize
    per_tok = cfg.kv_bytes_per_token(itemsize)
    device = int(device_gb * GB)
    reserved = int(device * reserve_fraction)
    free = max(device - reserved - weight, 0)
    return MemoryPlan(cfg.name, dtype, n, weight, per_tok, device, reserved, free // per_tok)
