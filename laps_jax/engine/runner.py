"""The model runner: pads a list of sequences into a bucket and runs its executable.

It owns the weights, the K/V page pools (donated to every call, so updated in place) and the
executable cache. It knows nothing of requests or queues: callers hand it sequences with their
new tokens, cached length and pages, and get back sampled tokens and log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from laps_jax.config import ModelConfig
from laps_jax.engine.buckets import padding_fraction
from laps_jax.engine.executables import Bucket, BucketGrid, ExecutableCache
from laps_jax.engine.sampling import SampleOut, SamplingArrays, sample
from laps_jax.pallas_kernels import attention_blocks
from laps_jax.models.qwen2 import (LAYER_LOOPS, Batch, forward_hidden, last_hidden, lm_logits,
                                   unstack_layers)

NUM_TOP = 20  # log-probs of this many best tokens come back with every sampled token


@dataclasses.dataclass
class SeqInput:
    """One sequence's share of a step."""

    new_tokens: Sequence[int]
    cached_len: int
    pages: Sequence[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    uniform: float = 0.0  # the request's next draw in [0, 1) (used when temperature > 0)
    # With prompt log-probs: the token after each new token (the next chunk's first, or -1).
    next_token: int = -1


@dataclasses.dataclass
class RunnerStats:
    """What the runner has done: steps per bucket and how much of each bucket was padding."""

    steps: dict = dataclasses.field(default_factory=dict)  # Bucket -> count
    real_tokens: int = 0
    bucket_tokens: int = 0

    @property
    def padding_fraction(self) -> float:
        return padding_fraction(self.real_tokens, self.bucket_tokens)


@dataclasses.dataclass
class SeqOutput:
    token_id: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    target_logprobs: np.ndarray | None = None  # [len(new_tokens)] log p(token[t+1] | ..t)


def _step(params, k_cache, v_cache, batch: Batch, sampling: SamplingArrays, targets, *,
          cfg: ModelConfig, backend: str, prompt_logprobs: bool, mesh=None):
    hidden, k_cache, v_cache = forward_hidden(params, cfg, k_cache, v_cache, batch, backend,
                                              mesh)
    logits = lm_logits(params, cfg, last_hidden(hidden, batch.q_lens))
    out = sample(logits, sampling, NUM_TOP)
    target_lp = None
    if prompt_logprobs:
        def chunk_lp(args):
            h, t = args  # [B, H], [B]
            lp = jax.nn.log_softmax(lm_logits(params, cfg, h), axis=-1)
            return jnp.take_along_axis(lp, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        target_lp = jax.lax.map(chunk_lp, (jnp.swapaxes(hidden, 0, 1), targets.T)).T
    return out, target_lp, k_cache, v_cache


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params: dict, *, num_pages: int, page_size: int = 16,
                 max_model_len: int = 4096, grid: BucketGrid | None = None,
                 attention_backend: str = "xla", kv_dtype=None, mesh=None,
                 layer_loop: str = "scan"):
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"unknown layer loop {layer_loop!r}; choose one of {LAYER_LOOPS}")
        if isinstance(params["layers"], list) and layer_loop == "scan":
            raise ValueError("layer_loop='scan' needs stacked layer weights")
        self.cfg = cfg
        self.page_size, self.num_pages = page_size, num_pages
        self.max_model_len = max_model_len
        self.pages_per_seq = -(-max_model_len // page_size)
        self.grid = grid or BucketGrid.default()
        self.attention_backend, self.layer_loop = attention_backend, layer_loop
        self.attention_blocks = attention_blocks(attention_backend)  # for the latency model
        self.kv_dtype = jnp.dtype(kv_dtype or jax.tree.leaves(params)[0].dtype)
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.mesh = mesh
        if mesh is not None:  # tensor parallel: weights and KV heads split over the mesh
            from laps_jax.models.sharding import kv_sharding, shard_params
            params = shard_params(params, mesh)
            sharding = kv_sharding(shape, mesh)
        else:  # pages live where the weights are
            sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
        # Weights given as shapes (jax.ShapeDtypeStruct): pages as shapes too, nothing is
        # allocated; such a runner can only compile its executables (engine/aot.py).
        self.abstract = isinstance(jax.tree.leaves(params)[0], jax.ShapeDtypeStruct)
        if self.abstract:
            zeros = lambda s: jax.ShapeDtypeStruct(s, self.kv_dtype, sharding=sharding)
        else:
            zeros = lambda s: jax.device_put(jnp.zeros(s, self.kv_dtype), sharding)
        if layer_loop == "unroll":  # one page pool per layer (see qwen2.LAYER_LOOPS)
            self.params = unstack_layers(params)
            self.k_cache = [zeros(shape) for _ in range(cfg.num_layers)]
            self.v_cache = [zeros(shape) for _ in range(cfg.num_layers)]
        else:
            self.params = params
            self.k_cache = zeros((cfg.num_layers, *shape))
            self.v_cache = zeros((cfg.num_layers, *shape))
        self.executables = ExecutableCache(self._build)
        self.stats = RunnerStats()

    # -- compilation --------------------------------------------------------------------
    def _build(self, bucket: Bucket):
        fn = jax.jit(functools.partial(_step, cfg=self.cfg, backend=self.attention_backend,
                                       prompt_logprobs=bucket.prompt_logprobs, mesh=self.mesh),
                     donate_argnums=(1, 2))
        B, T = bucket.batch, bucket.tokens
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        batch = Batch(i32(B, T), i32(B), i32(B), i32(B, self.pages_per_seq))
        f32 = jax.ShapeDtypeStruct((B,), jnp.float32)
        sampling = SamplingArrays(f32, i32(B), f32, f32)
        abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        args = (jax.tree.map(abstract, self.params), jax.tree.map(abstract, self.k_cache),
                jax.tree.map(abstract, self.v_cache), batch, sampling, i32(B, T))
        return fn, args

    def run_trash(self, bucket: Bucket, exe) -> None:
        """One step of `exe` on full rows whose K/V all goes to the trash page 0; waits."""
        T = bucket.tokens
        row = SeqInput([0] * T, 0, [0] * -(-T // self.page_size))
        batch, sampling, targets = self.pack([row] * bucket.batch, bucket)
        out, _, self.k_cache, self.v_cache = exe(self.params, self.k_cache, self.v_cache, batch,
                                                 sampling, targets)
        jax.block_until_ready(out)

    # -- running ------------------------------------------------------------------------
    def bucket_for(self, seqs: Sequence[SeqInput], prompt_logprobs: bool = False) -> Bucket:
        max_new = max(len(s.new_tokens) for s in seqs)
        b = self.grid.fit(len(seqs), max_new, prompt_logprobs)
        if b is None:
            raise ValueError(f"no bucket holds {len(seqs)} sequences of {max_new} new tokens "
                             f"(largest chunk {self.grid.max_chunk}, batch "
                             f"{self.grid.prefill_batches[-1]})")
        return b

    def reset_stats(self) -> None:
        self.stats = RunnerStats()

    def pack(self, seqs: Sequence[SeqInput], bucket: Bucket):
        B, T, P = bucket.batch, bucket.tokens, self.pages_per_seq
        tokens = np.zeros((B, T), np.int32)
        targets = np.full((B, T), -1, np.int32)
        q_lens = np.zeros(B, np.int32)
        cached = np.zeros(B, np.int32)
        table = np.zeros((B, P), np.int32)
        temp = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        uniform = np.zeros(B, np.float32)
        for i, s in enumerate(seqs):
            n = len(s.new_tokens)
            if s.cached_len + n > P * self.page_size or len(s.pages) * self.page_size < s.cached_len + n:
                raise ValueError(f"sequence {i}: {s.cached_len + n} tokens do not fit its pages")
            tokens[i, :n] = s.new_tokens
            targets[i, :n - 1] = s.new_tokens[1:]
            targets[i, n - 1] = s.next_token
            q_lens[i], cached[i] = n, s.cached_len
            table[i, :len(s.pages)] = s.pages
            temp[i], top_k[i], top_p[i] = s.temperature, s.top_k, s.top_p
            uniform[i] = s.uniform
        batch = Batch(tokens, q_lens, cached, table)
        return batch, SamplingArrays(temp, top_k, top_p, uniform), targets

    def launch(self, seqs: Sequence[SeqInput], prompt_logprobs: bool = False,
               bucket: Bucket | None = None):
        """Dispatches one step in `bucket` (the scheduler's plan, checked to hold the rows) or,
        for callers with no plan, the smallest bucket that holds them; returns device outputs
        without waiting for them."""
        if bucket is None:
            bucket = self.bucket_for(seqs, prompt_logprobs)
        else:
            self.grid.check_holds(bucket, [len(s.new_tokens) for s in seqs], prompt_logprobs)
        exe = self.executables.get(bucket)
        batch, sampling, targets = self.pack(seqs, bucket)
        self.stats.steps[bucket] = self.stats.steps.get(bucket, 0) + 1
        self.stats.real_tokens += int(batch.q_lens.sum())
        self.stats.bucket_tokens += bucket.batch * bucket.tokens
        out, target_lp, self.k_cache, self.v_cache = exe(
            self.params, self.k_cache, self.v_cache, batch, sampling, targets)
        return bucket, len(seqs), [len(s.new_tokens) for s in seqs], out, target_lp

    @staticmethod
    def fetch(handle) -> list[SeqOutput]:
        """Waits for a launched step and brings back only what the host needs."""
        _, n, lens, out, target_lp = handle
        out: SampleOut = jax.device_get(out)
        tl = None if target_lp is None else np.asarray(target_lp)
        return [SeqOutput(int(out.token_ids[i]), float(out.logprobs[i]), out.top_ids[i],
                          out.top_logprobs[i], None if tl is None else tl[i, :lens[i]])
                for i in range(n)]

    def run(self, seqs: Sequence[SeqInput], prompt_logprobs: bool = False,
            bucket: Bucket | None = None) -> list[SeqOutput]:
        return self.fetch(self.launch(seqs, prompt_logprobs, bucket))
