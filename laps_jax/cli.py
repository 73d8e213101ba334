"""Command-line pieces the scripts share: engine options and building an engine from them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from laps_jax.config import EngineConfig

DEFAULT_MODEL = "builtin"


def builtin_model_dir() -> str:
    return os.path.join(os.path.dirname(__file__), "builtin_model")


def add_engine_args(ap: argparse.ArgumentParser, default_model: str | None = DEFAULT_MODEL):
    e = EngineConfig()
    g = ap.add_argument_group("model and engine")
    g.add_argument("--model", required=default_model is None, default=default_model,
                   help="Hugging Face Qwen2 directory, a preset (qwen2.5-0.5b, qwen2.5-7b, "
                        "qwen2.5-32b, tiny, bench-cpu: random weights) or 'builtin' (the small "
                        "checkpoint shipped with laps_jax)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and KV cache dtype (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--attention-backend", choices=("xla", "pallas"), default=None,
                   help="attention path (default: pallas on GPU, xla on CPU)")
    g.add_argument("--layer-loop", choices=("scan", "unroll"), default=None,
                   help="scan: stacked layers under one lax.scan (compile time independent of "
                        "depth); unroll: one weight set per layer, faster on the CPU where the "
                        "scan copies each layer's weights (default: unroll on CPU, scan on GPU)")
    g.add_argument("--max-model-len", type=int, default=e.max_model_len,
                   help=f"longest prompt + output in tokens (default {e.max_model_len}; capped at "
                        "the model's context, a RoPE extension such as YaRN included)")
    g.add_argument("--kv-cache-tokens", type=int, default=e.kv_cache_tokens,
                   help=f"KV page pool capacity in tokens (default {e.kv_cache_tokens})")
    g.add_argument("--page-size", type=int, default=e.page_size,
                   help=f"tokens per KV page (default {e.page_size})")
    g.add_argument("--max-chunk", type=int, default=e.max_chunk,
                   help=f"largest prefill bucket in new tokens per sequence (default {e.max_chunk})")
    g.add_argument("--max-prefill-batch", type=int, default=e.max_prefill_batch,
                   help=f"sequences per prefill bucket (default {e.max_prefill_batch})")
    g.add_argument("--max-decode-batch", type=int, default=e.max_decode_batch,
                   help=f"sequences per decode bucket (default {e.max_decode_batch})")
    g.add_argument("--dot-tuning-tokens", type=int, default=e.dot_tuning_tokens,
                   help="CPU only: prefill buckets of at least this many tokens per row are also "
                        "compiled with oneDNN matmuls at start-up, both are timed on a warm-up "
                        "batch and the faster is kept (up to 1.15x on long prefills of small "
                        "models, slower on others); 0 skips it and starts faster "
                        f"(default {e.dot_tuning_tokens})")
    g.add_argument("--compile-cache", default=None,
                   help="persistent XLA compilation cache directory "
                        "(default $LAPS_JAX_CACHE_DIR or ~/.cache/laps_jax/xla)")
    return g


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
                        max_model_len=args.max_model_len, max_chunk=args.max_chunk,
                        max_prefill_batch=args.max_prefill_batch,
                        max_decode_batch=args.max_decode_batch,
                        attention_backend=args.attention_backend,
                        layer_loop=args.layer_loop, dot_tuning_tokens=args.dot_tuning_tokens)


@dataclasses.dataclass
class BuiltEngine:
    engine: object
    tokenizer: object | None
    model_name: str
    load_seconds: float
    compile_seconds: float


def build_engine(args, prompt_logprobs: bool = False, warmup: bool = True,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> BuiltEngine:
    """Loads the model and tokenizer, builds the engine and compiles every bucket."""
    import jax

    from laps_jax.engine.engine import Engine
    from laps_jax.engine.executables import enable_persistent_cache
    from laps_jax.models.loader import load_model
    from laps_jax.server.tokenizer import Tokenizer

    cache_dir = enable_persistent_cache(args.compile_cache)
    spec = builtin_model_dir() if args.model == "builtin" else args.model
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    t0 = time.perf_counter()
    loaded = load_model(spec, dtype)
    tokenizer = Tokenizer(loaded.model_dir) if loaded.model_dir else None
    eos = tokenizer.eos_token_ids if tokenizer else ()
    engine = Engine(loaded.cfg, loaded.params, engine_config_from_args(args), eos)
    t1 = time.perf_counter()
    log(f"loaded {args.model} ({loaded.cfg.num_params() / 1e6:.1f}M params, {dtype}) "
        f"in {t1 - t0:.1f} s")
    if warmup:
        from tqdm import tqdm
        with tqdm(desc="compiling buckets", unit="bucket", file=sys.stderr, leave=False) as bar:
            def progress(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)
            engine.warmup(prompt_logprobs, progress)
    t2 = time.perf_counter()
    log(f"compiled and ran once {len(engine.runner.executables)} bucket executables in "
        f"{t2 - t1:.1f} s (persistent compilation cache: {cache_dir}; later starts reuse it)")
    for choice in engine.runner.dot_choices:
        log(f"matmul library for {choice.describe()}")
    return BuiltEngine(engine, tokenizer, os.path.basename(os.path.normpath(spec)),
                       t1 - t0, t2 - t1)
