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


def tensor_mesh(n: int) -> Mesh:
    """A mesh over the first `n` devices; ValueError (one line) when there are fewer."""
    have = jax.devices()
    if n > len(have):
        hint = (f"; on the CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
                "before starting" if have[0].platform == "cpu" else "")
        raise ValueError(f"--tensor-parallel {n} needs {n} devices, JAX sees {len(have)} "
                         f"{have[0].platform} device(s){hint}")
    return make_mesh(n)


def heads_divide(cfg, mesh: Mesh | None) -> bool:
    """Whether every device of `mesh` can hold whole query and KV heads."""
    n = 1 if mesh is None else mesh.shape[AXIS]
    return n > 1 and cfg.num_heads % n == 0 and cfg.num_kv_heads % n == 0


def head_parallel(attention, mesh: Mesh):
    """`attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table)` run on each
    device over its own heads (shard_map): q [B, T, heads, hd] and the pages
    [L, pages, page_size, kv_heads, hd] split on heads, the rest replicated. A Pallas kernel is a
    custom call the SPMD partitioner cannot split, so without this it would gather every
    device's K/V pages before each layer's attention."""
    q = P(None, None, AXIS, None)
    kv = P(None, None, None, AXIS, None)
    return jax.shard_map(attention, mesh=mesh, in_specs=(q, kv, kv, P(), P(), P(), P()),
                         out_specs=q, check_vma=False)


def _spec(shape: tuple[int, ...], axis: int | None, size: int) -> P:
    if axis is None or shape[axis] % size:
        return P()
    parts = [None] * len(shape)
    parts[axis] = AXIS
    return P(*parts)


def param_specs(params: dict, size: int) -> dict:
    """A PartitionSpec for every parameter (arrays or shapes), by its path, for an axis of
    `size` devices."""
    def rule(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        unstacked = len(names) > 1 and names[0] == "layers" and names[1].isdigit()
        key = "/".join(names[:1] + names[2:] if unstacked else names)  # layers/<i>/... per layer
        if key not in _RULES:
            raise KeyError(f"no partition rule for parameter {key!r}")
        axis = _RULES[key]
        if unstacked and axis is not None:
            axis -= 1  # no leading layer axis
        return _spec(leaf.shape, axis, size)

    return jax.tree_util.tree_map_with_path(rule, params)


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """A NamedSharding for every parameter, by its path."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                        param_specs(params, mesh.shape[AXIS]),
                        is_leaf=lambda x: isinstance(x, P))


def local_size(shape: tuple[int, ...], spec: P, size: int) -> int:
    """Elements of one device's shard of an array of `shape` split by `spec`."""
    n = int(np.prod(shape))
    return n // size if AXIS in tuple(spec) else n


def kv_sharding(kv_shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """KV pages [(L,) pages, page_size, kv_heads, head_dim] split over kv heads when they divide."""
    return NamedSharding(mesh, _spec(kv_shape, len(kv_shape) - 2, mesh.shape[AXIS]))


def shard_params(params: dict, mesh: Mesh) -> dict:
    """Weights placed per the rules; shapes (ShapeDtypeStruct) get the shardings only, so an
    abstract model (the lowering check) is never allocated."""
    shardings = param_shardings(params, mesh)
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            params, shardings)
    return jax.device_put(params, shardings)
