"""Command-line pieces the scripts share: engine options and building an engine from them."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

from laps_jax.config import EngineConfig, builtin_model_dir  # noqa: F401 (scripts use it)
from laps_jax.engine.settings import DEFAULT_MAX_CHUNK

DEFAULT_MODEL = "builtin"


def setup_logging() -> None:
    """Library warnings print as `WARNING name: message`, not as bare lines."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every flag's default once. A help text that ends in "(default: ...)" explains a
    `None` default; where a script sets a real default instead, that value replaces it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS \
                or isinstance(action.default, bool) or "%(default)" in text:
            return text
        if text.endswith(")") and "(default: " in text:
            text = text[:text.rindex("(default: ")].rstrip()
        return text + " (default: %(default)s)"


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
    g.add_argument("--dot-tuning-tokens", type=int, default=0, help=argparse.SUPPRESS)
    g.add_argument("--compile-cache", default=None,
                   help="persistent XLA compilation cache directory "
                        "(default $LAPS_JAX_CACHE_DIR or ~/.cache/laps_jax/xla)")
    return g


def engine_config_from_args(args) -> EngineConfig:
    """The engine settings the flags ask for, made concrete for --model's config (read from
    config.json alone: no weights are loaded). Raises SettingsError (one line) for settings
    that cannot work together."""
    from laps_jax.config import resolve_model
    from laps_jax.engine.settings import SettingsError, resolve
    if getattr(args, "dot_tuning_tokens", 0):  # an experiment that could crash the process
        raise SettingsError("--dot-tuning-tokens was removed: XLA's experimental oneDNN dots "
                            "could crash the process at start-up; every bucket uses XLA's own")
    ecfg = EngineConfig(page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
                        max_model_len=args.max_model_len, max_chunk=args.max_chunk,
                        max_prefill_batch=args.max_prefill_batch,
                        max_decode_batch=args.max_decode_batch,
                        attention_backend=args.attention_backend, layer_loop=args.layer_loop)
    return resolve(ecfg, resolve_model(args.model)[0])


def describe_engine(engine) -> str:
    """One line: the context, the KV pool and the bucket grid an engine compiled."""
    e, g = engine.ecfg, engine.grid
    span = lambda xs: f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else f"{xs[0]}"
    return (f"context {e.max_model_len} tokens, KV pool {(e.num_pages - 1) * e.page_size} "
            f"tokens ({e.num_pages - 1} pages of {e.page_size}); buckets: prefill "
            f"{span(g.prefill_batches)} x {span(g.prefill_tokens)} tokens (budget "
            f"{g.max_batch_tokens}), decode {span(g.decode_batches)}")


@dataclasses.dataclass
class BuiltEngine:
    engine: object
    tokenizer: object | None
    model_name: str
    load_seconds: float
    compile_seconds: float


def _bar(desc: str):
    """A tqdm callback `progress(done, total)` and the bar to close."""
    from tqdm import tqdm
    bar = tqdm(desc=desc, unit="bucket", file=sys.stderr, leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
    return bar, progress


def build_engine(args, prompt_logprobs: bool = False, warmup: bool = True,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> BuiltEngine:
    """Checks the settings, loads the model and tokenizer, builds the engine and (with
    `warmup`) compiles every bucket and runs each once."""
    ecfg = engine_config_from_args(args)  # refuses bad settings before loading anything
    import jax

    from laps_jax.engine.engine import Engine
    from laps_jax.engine.executables import enable_persistent_cache
    from laps_jax.models.loader import load_model
    from laps_jax.text.tokenizer import Tokenizer

    cache_dir = enable_persistent_cache(args.compile_cache)
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype)
    tokenizer = Tokenizer(loaded.model_dir) if loaded.model_dir else None
    eos = tokenizer.eos_token_ids if tokenizer else ()
    engine = Engine(loaded.cfg, loaded.params, ecfg, eos)
    t1 = time.perf_counter()
    log(f"loaded {args.model} ({loaded.cfg.num_params() / 1e6:.1f}M params, {dtype}) "
        f"in {t1 - t0:.1f} s")
    log(describe_engine(engine))
    if warmup:
        warm_up(engine, prompt_logprobs, log, cache_dir)
    spec = loaded.model_dir or args.model
    return BuiltEngine(engine, tokenizer, os.path.basename(os.path.normpath(spec)),
                       t1 - t0, time.perf_counter() - t1)


def warm_up(engine, prompt_logprobs: bool, log, cache_dir: str | None = None,
            buckets=None) -> None:
    """Compiles (a progress bar) and runs once (another) every bucket, or just `buckets`."""
    from laps_jax.engine import compile_cache
    t0, cached_before = time.perf_counter(), compile_cache.stats()
    buckets = engine.runner.all_buckets(prompt_logprobs) if buckets is None else buckets
    bar, progress = _bar("compiling buckets")
    with bar:
        engine.runner.compile(buckets, progress)
    t1 = time.perf_counter()
    where = (f" (persistent compilation cache {cache_dir}: "
             f"{(compile_cache.stats() - cached_before).describe()})") if cache_dir else ""
    log(f"compiled {len(buckets)} bucket executables in {t1 - t0:.1f} s{where}")
    bar, progress = _bar("running each once")
    with bar:
        engine.runner.prime(buckets, progress)
    log(f"ran each bucket once in {time.perf_counter() - t1:.1f} s")
