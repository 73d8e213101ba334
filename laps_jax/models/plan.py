"""Memory plan: weight bytes, KV bytes per token, and how many KV tokens fit on a device, from
shapes alone (nothing allocated); with tensor parallelism, per device, by the partition rules
that shard the weights (models/sharding.py).

Without a compiler's figure a flat 10% of the device is kept for activations and the runtime.
With one (`serve.py --dry-run --compile`: the largest temp buffer of any executable, from XLA's
GPU compiler) the activations are that figure, and the reserve keeps only what no compiler
reports: the memory outside JAX's allocator (it takes XLA_PYTHON_CLIENT_MEM_FRACTION of the
device, 0.75 by default per JAX's "GPU memory allocation" page; the CUDA context, cuBLAS and
NCCL handles live in the rest) and a 2% margin of the allocator's share for fragmentation (an
estimate: the allocator holds a few large fixed buffers, weights and the KV pool, and one
step's temps at a time).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from laps_jax.config import ModelConfig

GB = 1e9
DEVICES_GB = {"h200": 141.0, "h100": 80.0, "a100-80g": 80.0, "a100-40g": 40.0}
JAX_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default
FRAGMENTATION = 0.02


def allocator_fraction() -> float:
    """The share of a GPU JAX's allocator may use: XLA_PYTHON_CLIENT_MEM_FRACTION or 0.75."""
    try:
        f = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION))
    except ValueError:
        return JAX_MEM_FRACTION
    return f if 0 < f <= 1 else JAX_MEM_FRACTION


def device_gb(device: str) -> float:
    """A device's memory in GB: a name of DEVICES_GB or a number; ValueError otherwise."""
    if device in DEVICES_GB:
        return DEVICES_GB[device]
    try:
        gb = float(device)
    except ValueError:
        raise ValueError(f"--device: unknown device {device!r} (known: "
                         f"{', '.join(DEVICES_GB)}; or its memory in GB)") from None
    if not gb > 0:
        raise ValueError(f"--device: memory must be positive, got {device!r}")
    return gb


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    model: str
    dtype: str
    num_params: int
    weight_bytes: int          # on each device
    kv_bytes_per_token: int    # on each device
    device_bytes: int
    reserved_bytes: int
    kv_tokens: int             # KV tokens that fit beside the weights (0: the weights do not)
    tensor_parallel: int = 1
    temp_bytes: int = 0        # the compiler's largest temp buffer (compiled plans only)
    temp_source: str = ""      # which executable, and for what; "" when not compiled

    @property
    def free_bytes(self) -> int:
        """What each device has for KV pages after the weights, the compiled temps and the
        reserve (< 0: short)."""
        return self.device_bytes - self.reserved_bytes - self.weight_bytes - self.temp_bytes

    def format(self) -> str:
        each = " per device" if self.tensor_parallel > 1 else ""
        if self.temp_source:
            return "\n".join([
                f"model            {self.model} ({self.num_params / 1e9:.3f} B parameters)",
                f"dtype            {self.dtype}",
                f"tensor parallel  {self.tensor_parallel} device(s)",
                f"weights          {self.weight_bytes / GB:.2f} GB{each}  [arithmetic: shapes]",
                f"KV per token     {self.kv_bytes_per_token / 1024:.1f} KiB{each}  "
                "[arithmetic: shapes]",
                f"temp buffers     {self.temp_bytes / GB:.2f} GB{each}  [compiler: "
                f"{self.temp_source}]",
                f"device memory    {self.device_bytes / GB:.1f} GB ({self.reserved_bytes / GB:.1f}"
                f" GB kept for the runtime  [arithmetic: {1 - allocator_fraction():.0%} outside "
                f"JAX's allocator, {FRAGMENTATION:.0%} of the rest for fragmentation])",
                f"KV tokens fit    {self.kv_tokens:,}",
            ])
        return "\n".join([
            f"model            {self.model} ({self.num_params / 1e9:.3f} B parameters)",
            f"dtype            {self.dtype}",
            f"tensor parallel  {self.tensor_parallel} device(s)",
            f"weights          {self.weight_bytes / GB:.2f} GB{each}",
            f"KV per token     {self.kv_bytes_per_token / 1024:.1f} KiB{each}",
            f"device memory    {self.device_bytes / GB:.1f} GB "
            f"({self.reserved_bytes / GB:.1f} GB kept for activations and runtime)",
            f"KV tokens fit    {self.kv_tokens:,}",
        ])


def weight_bytes_per_device(cfg: ModelConfig, itemsize: int, tensor_parallel: int) -> int:
    """Bytes of one device's share of the weights, split as sharding.param_specs splits them
    (a dimension the devices do not divide stays whole on each)."""
    if tensor_parallel == 1:
        return cfg.num_params() * itemsize
    import jax
    from flax import nnx

    from laps_jax.models.qwen2 import abstract_state
    from laps_jax.models.sharding import local_size, param_specs
    from jax.sharding import PartitionSpec
    shapes = nnx.to_pure_dict(abstract_state(cfg))
    specs = param_specs(shapes, tensor_parallel)
    sizes = jax.tree.map(lambda x, s: local_size(x.shape, s, tensor_parallel), shapes, specs,
                         is_leaf=lambda x: isinstance(x, PartitionSpec))
    return sum(jax.tree.leaves(sizes)) * itemsize


def memory_plan(cfg: ModelConfig, dtype: str = "bfloat16", device_gb: float = 141.0,
                reserve_fraction: float = 0.1, tensor_parallel: int = 1,
                temp_bytes: int = 0, temp_source: str = "") -> MemoryPlan:
    """Everything here comes from shapes: nothing is allocated. With `tensor_parallel` N the
    KV pages split over the kv heads (N must divide them: engine/settings.py refuses others).
    With `temp_source` (a compiled plan) `temp_bytes` replaces `reserve_fraction`'s share for
    activations; the reserve is then what lies outside JAX's allocator, and fragmentation."""
    itemsize = np.dtype({"bfloat16": np.float16, "float32": np.float32}[dtype]).itemsize
    weight = weight_bytes_per_device(cfg, itemsize, tensor_parallel)
    per_tok = cfg.kv_bytes_per_token(itemsize) // tensor_parallel
    device = int(device_gb * GB)
    if temp_source:
        f = allocator_fraction()
        reserved = int(device * (1 - f) + device * f * FRAGMENTATION)
    else:
        reserved, temp_bytes = int(device * reserve_fraction), 0
    free = max(device - reserved - weight - temp_bytes, 0)
    return MemoryPlan(cfg.name, dtype, cfg.num_params(), weight, per_tok, device, reserved,
                      free // per_tok, tensor_parallel, temp_bytes, temp_source)
