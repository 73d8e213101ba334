"""Tensor-parallel partition rules over a mesh axis named `tensor` (Megatron-style).

Column-parallel q/k/v/gate/up (output features split), row-parallel o/down (input features
split; XLA inserts the all-reduce), vocab-parallel embedding and lm_head. A dimension that the
axis size does not divide stays replicated, so any head layout still runs.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "tensor"

# parameter path (joined by '/') -> which axis of the array is split
_RULES: dict[str, int | None] = {
    "embed": 0, "lm_head": 1, "final_norm": None,
    "layers/input_norm": None, "layers/post_attn_norm": None,
    "layers/attn/q_w": 2, "layers/attn/q_b": 1, "layers/attn/k_w": 2, "layers/attn/k_b": 1,
    "layers/attn/v_w": 2, "layers/attn/v_b": 1, "layers/attn/o_w": 1,
    "layers/mlp/gate_w": 2, "layers/mlp/up_w": 2, "layers/mlp/down_w": 1,
}


def make_mesh(num_devices: int | None = None, devices=None) -> Mesh:
    devices = devices if devices is not None else jax.devices()[:num_devices or len(jax.devices())]
    return Mesh(np.array(devices), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _spec(shape: tuple[int, ...], axis: int | None, size: int) -> P:
    if axis is None or shape[axis] % size:
        return P()
    parts = [None] * len(shape)
    parts[axis] = AXIS
    return P(*parts)


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """A NamedSharding for every parameter, by its path."""
    size = mesh.shape[AXIS]

    def rule(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        unstacked = len(names) > 1 and names[0] == "layers" and names[1].isdigit()
        key = "/".join(names[:1] + names[2:] if unstacked else names)  # layers/<i>/... per layer
        if key not in _RULES:
            raise KeyError(f"no partition rule for parameter {key!r}")
        axis = _RULES[key]
        if unstacked and axis is not None:
            axis -= 1  # no leading layer axis
        return NamedSharding(mesh, _spec(leaf.shape, axis, size))

    return jax.tree_util.tree_map_with_path(rule, params)


def kv_sharding(kv_shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """KV pages [(L,) pages, page_size, kv_heads, head_dim] split over kv heads when they divide."""
    return NamedSharding(mesh, _spec(kv_shape, len(kv_shape) - 2, mesh.shape[AXIS]))


def shard_params(params: dict, mesh: Mesh) -> dict:
    return jax.device_put(params, param_shardings(params, mesh))
