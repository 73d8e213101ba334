"""Tensor-parallel serving (--tensor-parallel N) on 8 virtual CPU devices, in one subprocess
(XLA_FLAGS must be set before jax is imported): the engine's logits equal the unsharded
engine's, with the XLA and the (interpreted) Pallas attention, and the HTTP server at TP 2
writes the same greedy text as at TP 1. Impossible N is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.settings import SettingsError, resolve

SCRIPT = r"""
import dataclasses, json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
sys.path.insert(0, sys.argv[1])
from conftest import small_engine_config
from inproc_server import InProcessServer
from laps_jax.builder import EngineBuild, build
from laps_jax.engine.runner import SeqInput
from laps_jax.models.loader import load_model
from laps_jax.models.sharding import tensor_mesh
from laps_jax.text.tokenizer import Tokenizer

assert len(jax.devices()) == 8
out = {}
loaded = load_model("builtin", "float32")
weights = (loaded.cfg, loaded.params)
ids = np.random.default_rng(1).integers(0, loaded.cfg.vocab_size, 40).tolist()

def engine(tp, **kw):
    spec = EngineBuild("builtin", small_engine_config(tensor_parallel=tp, **kw))
    return build(spec, warmup=False, weights=weights, log=lambda m: None).engine

def logprobs(eng):
    pages = eng.kv.allocate(ids)
    try:
        row = SeqInput(ids, 0, pages.pages)
        return eng.runner.run([row], prompt_logprobs=True)[0].target_logprobs
    finally:
        eng.kv.release(pages)

engines = {1: engine(1), 2: engine(2)}  # the CPU's default layer loop: unroll
ref = logprobs(engines[1])
for name, tp, kw in (("tp2_unroll", 2, None), ("tp2_scan", 2, dict(layer_loop="scan")),
                     ("tp2_pallas", 2, dict(layer_loop="scan", attention_backend="pallas"))):
    eng = engines[tp] if kw is None else engine(tp, **kw)
    leaf = eng.runner.k_cache[0] if isinstance(eng.runner.k_cache, list) else eng.runner.k_cache
    out[name] = dict(diff=float(np.abs(logprobs(eng) - ref).max()),
                     kv_shards=len(leaf.sharding.device_set))

texts = {}
tok = Tokenizer(loaded.model_dir)
for tp in (1, 2):
    srv = InProcessServer(engines[tp], tok)
    try:
        texts[tp] = [srv.post("/v1/completions", dict(model="ckpt", prompt=p, max_tokens=12,
                                                      temperature=0))[1]["choices"][0]["text"]
                     for p in ("Once upon a time", "The cat sat on the mat and then")]
    finally:
        srv.stop()
out["texts"] = texts
try:
    tensor_mesh(16)
except ValueError as e:
    out["too_many"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tp_run():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT, os.path.dirname(__file__)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sharded_engine_logits_equal_unsharded(tp_run):
    for name in ("tp2_unroll", "tp2_scan", "tp2_pallas"):
        assert tp_run[name]["kv_shards"] == 2, name  # the KV pages really are split
        assert tp_run[name]["diff"] < 1e-4, (name, tp_run[name])


@pytest.mark.slow
def test_server_at_tp2_writes_the_same_greedy_text(tp_run):
    texts = tp_run["texts"]
    assert texts["1"] == texts["2"] and all(texts["1"])


@pytest.mark.slow
def test_more_devices_than_exist_is_refused(tp_run):
    assert tp_run["too_many"].startswith("--tensor-parallel 16 needs 16 devices, JAX sees 8")


def test_heads_not_divisible_is_refused():
    cfg = PRESETS["qwen2.5-32b"]  # 8 KV heads, 40 query heads
    with pytest.raises(SettingsError, match="--tensor-parallel 3 does not divide the model's "
                                            "8 KV heads; choose a divisor of 8"):
        resolve(EngineConfig(tensor_parallel=3), cfg)
    with pytest.raises(SettingsError, match="--tensor-parallel must be a positive integer"):
        resolve(EngineConfig(tensor_parallel=0), cfg)
    assert resolve(EngineConfig(tensor_parallel=8), cfg).tensor_parallel == 8
