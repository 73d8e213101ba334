"""Building engines: the one place a model is loaded and its engines made and warmed up.

serve.py, prefill_batch.py, profile_latency.py, compare_modes.py (bench/compare.py) and the
engine benchmarks all build through `build`, so each gets the same persistent compilation
cache, dtype default, start-up log and warm-up (every bucket compiled, then run once), and
laps-spatial's second engine is made one way. Settings that cannot work are refused before a
weight is read. The --model, --dtype and --compile-cache flags are declared here, beside
`EngineBuild`; the engine settings' own flags beside their config (engine/settings.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable

from laps_jax.config import EngineConfig, ModelConfig, resolve_model
from laps_jax.engine import settings

Log = Callable[[str], None]


def log_to_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class EngineBuild:
    """What to build."""

    model: str                            # a preset, a model directory or 'builtin'
    ecfg: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    dtype: str | None = None              # None: bfloat16 on a GPU, float32 on the CPU
    seed: int = 0                         # a preset's random weights
    engines: int = 1                      # over the same weights (laps-spatial: 2)
    spread: bool = False                  # engine i's weights on device i, where there is one
    tokenizer: bool = True                # read the checkpoint's (its EOS ids end generation)
    compile_cache: str | None = None      # None: $LAPS_JAX_CACHE_DIR or ~/.cache/laps_jax/xla
    executables: str | None = None        # saved executables to load before compiling


@dataclasses.dataclass
class BuiltEngine:
    engines: list
    tokenizer: object | None
    model_name: str
    load_seconds: float
    compile_seconds: float

    @property
    def engine(self):
        return self.engines[0]

    @property
    def long_engine(self):
        """The second engine (laps-spatial's long pool), or None."""
        return self.engines[1] if len(self.engines) > 1 else None


def add_args(g, default_model: str | None) -> None:
    """--model, --dtype and --compile-cache (None `default_model`: --model is required)."""
    g.add_argument("--model", required=default_model is None, default=default_model,
                   help="Hugging Face Qwen2 directory, a preset (qwen2.5-0.5b, qwen2.5-7b, "
                        "qwen2.5-32b, tiny, bench-cpu: random weights) or 'builtin' (the small "
                        "checkpoint shipped with laps_jax)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and KV cache dtype (default: float32 on CPU, bfloat16 on GPU)")
    g.add_argument("--compile-cache", default=None,
                   help="persistent XLA compilation cache directory "
                        "(default $LAPS_JAX_CACHE_DIR or ~/.cache/laps_jax/xla)")
    g.add_argument("--executables", default=None, metavar="DIR",
                   help="load the executables `device_check.py --compile-only --save DIR` "
                        "wrote; any that do not match this model, settings, device or JAX "
                        "compile as usual (one line says why)")


def from_args(args, **fields) -> EngineBuild:
    """The build the flags ask for (settings as given); `fields` set the rest."""
    return EngineBuild(args.model, settings.from_args(args), dtype=args.dtype,
                       compile_cache=args.compile_cache,
                       executables=getattr(args, "executables", None), **fields)


def build(spec: EngineBuild, *, warmup: bool = True, prompt_logprobs: bool = False,
          weights: tuple[ModelConfig, dict] | None = None,
          log: Log = log_to_stderr) -> BuiltEngine:
    """Loads the model (or takes `weights`: a config and its parameters), makes the engines
    and (with `warmup`) compiles every bucket of each and runs it once."""
    cfg = weights[0] if weights else resolve_model(spec.model)[0]
    ecfg = settings.resolve(spec.ecfg, cfg)  # refused before anything is loaded
    import jax

    from laps_jax.engine.engine import Engine
    from laps_jax.engine.executables import enable_persistent_cache
    from laps_jax.models.loader import load_model
    from laps_jax.text.tokenizer import Tokenizer

    if ecfg.tensor_parallel > 1:  # too few devices: refused before a weight is read
        from laps_jax.models.sharding import tensor_mesh
        tensor_mesh(ecfg.tensor_parallel)
    cache_dir = enable_persistent_cache(spec.compile_cache)
    dtype = spec.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    t0 = time.perf_counter()
    model_dir = None
    if weights is None:
        loaded = load_model(spec.model, dtype, spec.seed)
        cfg, params, model_dir = loaded.cfg, loaded.params, loaded.model_dir
    else:
        params = weights[1]
        dtype = jax.tree.leaves(params)[0].dtype.name  # as given
    tokenizer = Tokenizer(model_dir) if spec.tokenizer and model_dir else None
    eos = tokenizer.eos_token_ids if tokenizer else ()
    engines = [Engine(cfg, params, ecfg, eos)]
    t1 = time.perf_counter()
    log(f"loaded {spec.model} ({cfg.num_params() / 1e6:.1f}M params, {dtype}) in "
        f"{t1 - t0:.1f} s")
    log(describe_engine(engines[0]))
    for i in range(spec.engines):
        if i:  # the first engine's weights as its runner holds them (unstacked once)
            shared = here = engines[0].runner.params
            # (tensor parallel: both engines share the mesh the first one's weights are on)
            if spec.spread and len(jax.devices()) > i and ecfg.tensor_parallel == 1:
                here = jax.device_put(shared, jax.devices()[i])
            log(f"engine {i + 1} of {spec.engines}: the same weights"
                f"{f' on {jax.devices()[i]}' if here is not shared else ''}")
            engines.append(Engine(cfg, here, ecfg, eos))
        if spec.executables:
            from laps_jax.engine import executable_store
            n = executable_store.load(engines[i], spec.executables, prompt_logprobs, say=log)
            log(f"loaded {n} saved executables from {spec.executables}")
        if warmup:
            warm_up(engines[i], prompt_logprobs, log, cache_dir)
    spec_dir = model_dir or spec.model
    return BuiltEngine(engines, tokenizer, os.path.basename(os.path.normpath(spec_dir)),
                       t1 - t0, time.perf_counter() - t1)


def describe_engine(engine) -> str:
    """One line: the context, the KV pool and the bucket grid an engine compiled."""
    return describe_settings(engine.ecfg, engine.grid)


def describe_settings(e: EngineConfig, g) -> str:
    """One line: the context, the KV pool and the bucket grid of resolved settings `e` and
    their grid `g` (the engine's, or the dry run's before anything is built)."""
    span = lambda xs: f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else f"{xs[0]}"
    tp = f"; tensor parallel over {e.tensor_parallel} devices" if e.tensor_parallel > 1 else ""
    return (f"context {e.max_model_len} tokens, KV pool {(e.num_pages - 1) * e.page_size} "
            f"tokens ({e.num_pages - 1} pages of {e.page_size}); buckets: prefill "
            f"{span(g.prefill_batches)} x {span(g.prefill_tokens)} tokens (budget "
            f"{g.max_batch_tokens}), decode {span(g.decode_batches)}{tp}")


def _bar(desc: str):
    """A tqdm callback `progress(done, total)` and the bar to close."""
    from tqdm import tqdm
    bar = tqdm(desc=desc, unit="bucket", file=sys.stderr, leave=False)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
    return bar, progress


def warm_up(engine, prompt_logprobs: bool, log: Log, cache_dir: str | None = None,
            buckets=None) -> None:
    """Compiles (a progress bar) and runs once (another) every bucket, or just `buckets`."""
    from laps_jax.engine import compile_cache
    t0, cached_before = time.perf_counter(), compile_cache.stats()
    owner = engine.executables
    buckets = owner.all_buckets(prompt_logprobs) if buckets is None else buckets
    bar, progress = _bar("compiling buckets")
    have = len(owner.steps)
    with bar:
        owner.compile(buckets, progress)
    t1 = time.perf_counter()
    if have:  # loaded (--executables): say how many were compiled here
        log(f"{len(owner.steps) - have} of {len(set(buckets))} buckets needed compiling")
    where = (f" (persistent compilation cache {cache_dir}: "
             f"{(compile_cache.stats() - cached_before).describe()})") if cache_dir else ""
    log(f"compiled {len(buckets)} bucket executables in {t1 - t0:.1f} s{where}")
    bar, progress = _bar("running each once")
    with bar:
        owner.prime(buckets, progress)
    log(f"ran each bucket once in {time.perf_counter() - t1:.1f} s")
