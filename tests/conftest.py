"""Shared fixtures: tiny Hugging Face checkpoints (built with transformers) and engines over them.

Engines are session-scoped and use a small bucket grid, so each test file compiles only a few
executables; the persistent compilation cache makes subprocess tests and re-runs cheap.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("LAPS_JAX_CACHE_DIR", os.path.join(ROOT, ".jax_cache"))
sys.path.insert(0, os.path.dirname(__file__))

from laps_jax.engine.executables import enable_persistent_cache  # noqa: E402

enable_persistent_cache()


def load_script(name: str):
    """`scripts/<name>.py` as a module (the scripts are not a package), to call its parser or
    main in-process."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}",
                                                  os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    spec.loader.exec_module(module)
    return module

# name -> keyword arguments of hf_fixtures.make_tiny_qwen2_checkpoint
CHECKPOINTS = {
    "gqa2_untied": dict(num_heads=4, num_kv_heads=2, rope_theta=10000.0, seed=1),
    "mha_tied": dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True, rope_theta=500.0,
                     rms_norm_eps=1e-5, seed=2),
    "gqa4_hd32": dict(hidden_size=96, num_heads=8, num_kv_heads=2, head_dim=32,
                      intermediate_size=160, num_layers=3, rope_theta=1e6, seed=3),
    "sharded_bf16": dict(num_heads=6, num_kv_heads=2, hidden_size=96, dtype="bfloat16",
                         shard=True, seed=4),
    # 7 query heads on one kv head (Qwen2.5-0.5B and -7B group 7 query heads per kv head)
    "gqa7_one_kv": dict(hidden_size=112, num_heads=7, num_kv_heads=1, intermediate_size=160,
                        rope_theta=1e6, seed=5),
    # head_dim 64 with as many kv heads as query heads (MHA), tied embeddings
    "mha_hd64_tied": dict(hidden_size=128, num_heads=2, num_kv_heads=2, tie_word_embeddings=True,
                          intermediate_size=160, rope_theta=1e6, seed=7),
    # head_dim 128 (every Qwen2.5 from 7B up) with 8 query heads on one kv head
    "gqa8_hd128": dict(hidden_size=128, num_heads=8, num_kv_heads=1, head_dim=128,
                       intermediate_size=160, rope_theta=1e6, seed=8),
    # YaRN as the Qwen2.5 model cards enable it, scaled down: prompts run past the "original"
    # 64-token context, and the attention factor (1.14) scales every score
    "yarn_gqa2": dict(num_heads=4, num_kv_heads=2, rope_theta=10000.0, seed=6,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> path of a tiny random Qwen2 checkpoint (built once per session)."""
    from hf_fixtures import make_tiny_qwen2_checkpoint
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            made[name] = str(make_tiny_qwen2_checkpoint(path, **CHECKPOINTS[name]))
        return made[name]

    return get


def small_engine_config(**kw):
    from laps_jax.config import EngineConfig
    base = dict(page_size=8, kv_cache_tokens=4096, max_model_len=512, max_chunk=64,
                min_chunk=16, max_prefill_batch=4, max_decode_batch=4, max_batch_tokens=128)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="session")
def engine_for(checkpoint):
    """engine_for(name[, layer_loop]) -> (Engine, hf_dir) with float32 weights, built once per
    session (layer_loop None: the platform default, `unroll` on the CPU)."""
    from laps_jax.engine.engine import Engine
    from laps_jax.models.loader import load_model
    from laps_jax.text.tokenizer import Tokenizer
    made: dict[str, tuple] = {}

    def get(name: str, layer_loop: str | None = None):
        if (name, layer_loop) not in made:
            path = checkpoint(name)
            loaded = load_model(path, "float32")
            eng = Engine(loaded.cfg, loaded.params, small_engine_config(layer_loop=layer_loop),
                         Tokenizer(path).eos_token_ids)
            made[name, layer_loop] = (eng, path)
        return made[name, layer_loop]

    return get


SERVED_MODEL = "ckpt"  # --served-model-name of the `cluster` instances


@pytest.fixture(scope="session")
def cluster(checkpoint):
    """Two serve.py instances (started together) and the checkpoint they serve, shared by the
    router and gateway tests (a test that restarts one puts the new process in the list)."""
    import threading

    from server_utils import ServerProcess
    path = checkpoint("gqa2_untied")
    procs, errors = [None, None], []

    def start(k):
        try:
            procs[k] = ServerProcess(path, "--served-model-name", SERVED_MODEL)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=start, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in procs:
            if p is not None:
                p.stop()
        raise errors[0]
    yield path, procs
    for p in procs:
        p.stop()
