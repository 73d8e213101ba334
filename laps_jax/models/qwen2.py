"""Qwen2 / Qwen2.5 decoder in Flax NNX, with layer weights stacked for `lax.scan`.

The module holds parameters only; the forward pass is a pure function over its state
(`nnx.split` once, then plain `jax.jit`), so per-call dispatch stays cheap and every
executable can be compiled ahead of time. Layer weights carry a leading [num_layers] axis
and run under one `lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx

from laps_jax.config import ModelConfig
from laps_jax.models.rope import rope
from laps_jax.models.sharding import head_parallel, heads_divide
from laps_jax.pallas_kernels import paged_attention


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class StackedAttention(nnx.Module):
    """q/k/v projections with bias, o projection without; weights are [L, in, out]."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        L, h = cfg.num_layers, cfg.hidden_size
        self.q_w = _param(rngs, (L, h, cfg.q_size), dtype)
        self.q_b = _param(rngs, (L, cfg.q_size), dtype)
        self.k_w = _param(rngs, (L, h, cfg.kv_size), dtype)
        self.k_b = _param(rngs, (L, cfg.kv_size), dtype)
        self.v_w = _param(rngs, (L, h, cfg.kv_size), dtype)
        self.v_b = _param(rngs, (L, cfg.kv_size), dtype)
        self.o_w = _param(rngs, (L, cfg.q_size, h), dtype)


class StackedMLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); weights are [L, in, out]."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        L, h, i = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.gate_w = _param(rngs, (L, h, i), dtype)
        self.up_w = _param(rngs, (L, h, i), dtype)
        self.down_w = _param(rngs, (L, i, h), dtype)


class StackedLayers(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        L, h = cfg.num_layers, cfg.hidden_size
        self.input_norm = nnx.Param(jnp.ones((L, h), dtype))
        self.post_attn_norm = nnx.Param(jnp.ones((L, h), dtype))
        self.attn = StackedAttention(cfg, dtype, rngs)
        self.mlp = StackedMLP(cfg, dtype, rngs)


class Qwen2(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = StackedLayers(cfg, dtype, rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)


def abstract_state(cfg: ModelConfig, dtype=jnp.bfloat16) -> nnx.State:
    """Shapes and dtypes of every parameter, with nothing allocated."""
    return nnx.state(nnx.eval_shape(lambda: Qwen2(cfg, dtype, nnx.Rngs(0))), nnx.Param)


def init_params(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0) -> dict:
    """Random weights as the nested dict of arrays that every executable takes."""
    return nnx.to_pure_dict(nnx.state(Qwen2(cfg, dtype, nnx.Rngs(seed)), nnx.Param))


# How forward_hidden walks the layers. `scan`: stacked weights [L, ...] and KV pages
# [L, pages, ...] under one lax.scan, so compile time does not grow with depth (the default on
# GPU, where a 64-layer model would otherwise compile 64 copies of the layer). `unroll`: one
# weight dict and one page pool per layer in a Python loop. On the CPU the scan copies every
# layer's weights out of the stack before its matmuls (XLA CPU cannot hand a dynamic slice to a
# dot), 5.5 ms of a 33 ms 128-token prefill of bench-cpu; unrolled, prefill at 128 tokens and
# decode run 18-24% faster for ~40% more compile time.
LAYER_LOOPS = ("scan", "unroll")


@dataclasses.dataclass(frozen=True)
class Batch:
    """A bucket-shaped batch: B sequences, each with up to T new tokens over a cached prefix."""

    tokens: jax.Array       # [B, T] int32, right-padded
    q_lens: jax.Array       # [B] int32 valid new tokens (0 = unused slot)
    cached_lens: jax.Array  # [B] int32 tokens already in the KV cache
    page_table: jax.Array   # [B, P] int32 pages of each sequence


jax.tree_util.register_dataclass(
    Batch, data_fields=["tokens", "q_lens", "cached_lens", "page_table"], meta_fields=[])


def rms_norm(x, w, eps: float):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def kv_slots(batch: Batch, page_size: int):
    """(page, offset) where each new token's K/V goes; padding tokens go to trash page 0."""
    B, T = batch.tokens.shape
    pos = batch.cached_lens[:, None] + jnp.arange(T)[None, :]
    valid = jnp.arange(T)[None, :] < batch.q_lens[:, None]
    page_idx = jnp.clip(pos // page_size, 0, batch.page_table.shape[1] - 1)
    pages = jnp.take_along_axis(batch.page_table, page_idx, axis=1)
    return jnp.where(valid, pages, 0), jnp.where(valid, pos % page_size, 0), pos


def write_kv(cache, layer, pages, offs, new):
    """Scatters new K or V [B, T, kvh, hd] into the cache's pages.

    One extra write to the trash page keeps the scatter a scatter when B*T == 1: XLA rewrites a
    single-index scatter into a dynamic-update-slice, fuses it into the attention's page gather
    and then copies the whole cache to keep the old value alive.
    """
    B, T = pages.shape
    pages = jnp.concatenate([pages.reshape(-1), jnp.zeros(1, pages.dtype)])
    offs = jnp.concatenate([offs.reshape(-1), jnp.zeros(1, offs.dtype)])
    new = new.reshape(B * T, *new.shape[2:]).astype(cache.dtype)
    new = jnp.concatenate([new, jnp.zeros_like(new[:1])])
    return cache.at[layer, pages, offs].set(new)


def forward_hidden(params: dict, cfg: ModelConfig, k_cache, v_cache, batch: Batch,
                   attention_backend: str = "xla", mesh=None):
    """Runs every layer over the batch; writes new K/V into the pages; returns final hidden.
    With a tensor-parallel `mesh` whose size divides the heads, attention runs per device on
    its own heads (sharding.head_parallel); the matmuls are split by the SPMD partitioner."""
    p = params
    page_size = k_cache[0].shape[1] if isinstance(k_cache, list) else k_cache.shape[2]
    pages, offs, positions = kv_slots(batch, page_size)
    x = p["embed"][batch.tokens]
    B, T = batch.tokens.shape
    attend = functools.partial(paged_attention, scale=cfg.head_dim ** -0.5,
                               backend=attention_backend)
    if heads_divide(cfg, mesh):
        attend = head_parallel(attend, mesh)

    def layer(carry, lp):
        x, kc, vc, li = carry
        a, m = lp["attn"], lp["mlp"]
        h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
        q = (h @ a["q_w"] + a["q_b"]).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = (h @ a["k_w"] + a["k_b"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ a["v_w"] + a["v_b"]).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg), rope(k, positions, cfg)
        kc = write_kv(kc, li, pages, offs, k)
        vc = write_kv(vc, li, pages, offs, v)
        o = attend(q, kc, vc, li, batch.q_lens, batch.cached_lens, batch.page_table)
        x = x + o.reshape(B, T, cfg.q_size).astype(x.dtype) @ a["o_w"]
        h = rms_norm(x, lp["post_attn_norm"], cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ m["gate_w"]) * (h @ m["up_w"])) @ m["down_w"]
        return (x, kc, vc, li + 1), None

    if isinstance(p["layers"], list):  # unrolled: per-layer weights and pages (see LAYER_LOOPS)
        ks, vs = [], []
        for lp, kc, vc in zip(p["layers"], k_cache, v_cache):
            (x, kc, vc, _), _ = layer((x, kc[None], vc[None], 0), lp)
            ks.append(kc[0])
            vs.append(vc[0])
        k_cache, v_cache = ks, vs
    else:
        (x, k_cache, v_cache, _), _ = jax.lax.scan(
            layer, (x, k_cache, v_cache, jnp.int32(0)), p["layers"])
    return rms_norm(x, p["final_norm"], cfg.rms_norm_eps), k_cache, v_cache


def unstack_layers(params: dict) -> dict:
    """The same weights with one dict per layer, for the unrolled layer loop."""
    if isinstance(params["layers"], list):
        return params
    n = jax.tree.leaves(params["layers"])[0].shape[0]
    layers = [jax.tree.map(lambda w, i=i: w[i], params["layers"]) for i in range(n)]
    return {**params, "layers": layers}


def default_layer_loop(params: dict | None = None) -> str:
    """`unroll` on CPU, `scan` elsewhere (see LAYER_LOOPS). Unstacking holds a second copy of
    the weights for a moment, so a CPU model over a quarter of the machine's memory scans."""
    if jax.default_backend() != "cpu":
        return "scan"
    if params is not None:
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = None
        if memory and 4 * weight_bytes > memory:
            return "scan"
    return "unroll"


def lm_logits(params, cfg: ModelConfig, hidden):
    """Logits in float32 from final hidden states [..., H]."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(hidden, w, preferred_element_type=jnp.float32)


def last_hidden(hidden, q_lens):
    """Hidden state of each sequence's last new token: [B, H]."""
    idx = jnp.maximum(q_lens - 1, 0)
    return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
