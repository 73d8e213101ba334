"""Engine settings: the flags that set them (`add_args`, `from_args`), made concrete for one
model, or refused before anything is compiled.

The bucket grid follows from the context: the context defaults to the model's own (a RoPE
extension included) or what the KV pool holds if that is less; the largest prefill bucket
defaults to 2,048 tokens or the context if that is shorter. Settings that cannot work together
(a context longer than the KV pool, a bucket longer than the context, more sequences per batch
than the pool has pages) raise `SettingsError`, one line naming the flags and the limit: at
start-up, not minutes later when a warm-up batch does not fit its pages.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from laps_jax.config import ConfigError, EngineConfig, ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_CHUNK = 2048

# EngineConfig field -> the command-line flag users set it with (messages name the flag)
FLAGS = {"page_size": "--page-size", "kv_cache_tokens": "--kv-cache-tokens",
         "max_model_len": "--max-model-len", "max_chunk": "--max-chunk",
         "max_prefill_batch": "--max-prefill-batch", "max_decode_batch": "--max-decode-batch",
         "min_chunk": "min_chunk", "max_batch_tokens": "max_batch_tokens",
         "tensor_parallel": "--tensor-parallel"}


class SettingsError(ConfigError):
    """Engine settings that cannot work together (one line, the flags and the limit named)."""


def _positive(ecfg: EngineConfig) -> None:
    for field, flag in FLAGS.items():
        v = getattr(ecfg, field)
        if v is None and field in ("max_model_len", "max_chunk", "max_batch_tokens"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SettingsError(f"{flag} must be a positive integer, got {v!r}")


def _check_tensor_parallel(n: int, model: ModelConfig) -> None:
    """Every device gets whole query and KV heads (attention then runs per device on its own
    heads); a split mid-head would still compute but move K/V between devices every layer."""
    for what, heads in (("KV heads", model.num_kv_heads), ("query heads", model.num_heads)):
        if heads % n:
            raise SettingsError(f"--tensor-parallel {n} does not divide the model's {heads} "
                                f"{what}; choose a divisor of {model.num_kv_heads}")


def resolve(ecfg: EngineConfig, model: ModelConfig) -> EngineConfig:
    """A copy of `ecfg` with every size concrete and consistent with `model`; idempotent."""
    _positive(ecfg)
    _check_tensor_parallel(ecfg.tensor_parallel, model)
    ps = ecfg.page_size
    pool = (ecfg.kv_cache_tokens // ps) * ps  # tokens the usable pages hold (page 0 is trash)
    pages = pool // ps
    if pages == 0:
        raise SettingsError(f"--kv-cache-tokens {ecfg.kv_cache_tokens} holds no KV page of "
                            f"--page-size {ps} tokens")
    pool_desc = f"--kv-cache-tokens {ecfg.kv_cache_tokens} (page size {ps}) holds {pool} tokens"
    context = model.max_context
    max_len = ecfg.max_model_len
    if max_len is None:
        max_len = min(context, pool)
        if max_len < context:
            log.info("context %d tokens: what the KV pool holds (the model's is %d)",
                     max_len, context)
    elif max_len > context:
        log.warning("--max-model-len %d is over the model's context; using %d", max_len, context)
        max_len = context
    if max_len > pool:
        raise SettingsError(f"--max-model-len {max_len} does not fit the KV pool: {pool_desc}; "
                            f"raise --kv-cache-tokens or lower --max-model-len")
    chunk = ecfg.max_chunk
    if chunk is None:
        chunk = min(DEFAULT_MAX_CHUNK, max_len)
    elif chunk > max_len:
        why = "--max-model-len" if ecfg.max_model_len is not None else "the context"
        raise SettingsError(f"--max-chunk {chunk} is longer than {why}, {max_len} tokens: "
                            "no prompt could fill it; lower --max-chunk")
    for flag, batch in (("--max-prefill-batch", ecfg.max_prefill_batch),
                        ("--max-decode-batch", ecfg.max_decode_batch)):
        if batch > pages:
            raise SettingsError(f"{flag} {batch} needs at least {batch} KV pages (one a "
                                f"sequence): {pool_desc}, {pages} pages")
    return dataclasses.replace(ecfg, max_model_len=max_len, max_chunk=chunk,
                               min_chunk=min(ecfg.min_chunk, chunk))


def add_args(g) -> None:
    """The `EngineConfig` flags, on a parser or argument group (scripts set their own defaults
    with `set_defaults`)."""
    e = EngineConfig()
    g.add_argument("--attention-backend", choices=("xla", "pallas"), default=None,
                   help="attention path (default: pallas on GPU, xla on CPU)")
    g.add_argument("--layer-loop", choices=("scan", "unroll"), default=None,
                   help="scan: stacked layers under one lax.scan (compile time independent of "
                        "depth); unroll: one weight set per layer, faster on the CPU where the "
                        "scan copies each layer's weights (default: unroll on CPU, scan on GPU)")
    g.add_argument("--max-model-len", type=int, default=e.max_model_len,
                   help="longest prompt + output in tokens; more than the model's context is "
                        "capped at it (default: the model's context, a RoPE extension such as "
                        "YaRN included, or what the KV pool holds if that is less)")
    g.add_argument("--kv-cache-tokens", type=int, default=e.kv_cache_tokens,
                   help="KV page pool capacity in tokens; must hold --max-model-len "
                        "(default %(default)s)")
    g.add_argument("--page-size", type=int, default=e.page_size,
                   help="tokens per KV page (default %(default)s)")
    g.add_argument("--max-chunk", type=int, default=e.max_chunk,
                   help="largest prefill bucket in new tokens per sequence; longer prompts run "
                        f"in chunks; at most --max-model-len (default: {DEFAULT_MAX_CHUNK}, or "
                        "the context if shorter)")
    g.add_argument("--max-prefill-batch", type=int, default=e.max_prefill_batch,
                   help="sequences per prefill bucket (default %(default)s)")
    g.add_argument("--max-decode-batch", type=int, default=e.max_decode_batch,
                   help="sequences per decode bucket (default %(default)s)")
    g.add_argument("--tensor-parallel", type=int, default=e.tensor_parallel, metavar="N",
                   help="split the weights and the KV cache's heads over N devices (Megatron "
                        "tensor parallelism; N must divide the KV heads; on the CPU set "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N) "
                        "(default %(default)s: one device)")
    g.add_argument("--dot-tuning-tokens", type=int, default=0, help=argparse.SUPPRESS)


def from_args(args) -> EngineConfig:
    """The settings the flags ask for, as given (`resolve` makes them concrete for a model).
    Raises SettingsError for the removed --dot-tuning-tokens."""
    if getattr(args, "dot_tuning_tokens", 0):  # an experiment that could crash the process
        raise SettingsError("--dot-tuning-tokens was removed: XLA's experimental oneDNN dots "
                            "could crash the process at start-up; every bucket uses XLA's own")
    return EngineConfig(page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
                        max_model_len=args.max_model_len, max_chunk=args.max_chunk,
                        max_prefill_batch=args.max_prefill_batch,
                        max_decode_batch=args.max_decode_batch,
                        attention_backend=args.attention_backend, layer_loop=args.layer_loop,
                        tensor_parallel=getattr(args, "tensor_parallel", 1))
