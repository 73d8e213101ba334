"""Loading Hugging Face checkpoints: errors that name the culprit, orbax round trip, and
tensor-parallel logits on 8 virtual CPU devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from laps_jax.engine.buckets import BucketGrid
from laps_jax.engine.runner import ModelRunner, SeqInput
from laps_jax.models.loader import load_model, restore_params, save_params
from laps_jax.models.safetensors_io import CheckpointError, SafetensorsCheckpoint, save_safetensors

GRID = BucketGrid.default(max_chunk=32, max_prefill_batch=1, max_decode_batch=1)


def prompt_logprobs(cfg, params, ids, mesh=None, layer_loop="scan"):
    runner = ModelRunner(cfg, params, num_pages=16, page_size=8, max_model_len=128, grid=GRID,
                         mesh=mesh, layer_loop=layer_loop)
    return runner.run([SeqInput(ids, 0, [1, 2, 3, 4])], prompt_logprobs=True)[0].target_logprobs


def copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    d = copy(checkpoint("gqa2_untied"), tmp_path / "ck")
    ck = SafetensorsCheckpoint(d)
    tensors = {n: np.array(ck.get(n)) for n in ck.names() if n != "model.layers.1.mlp.up_proj.weight"}
    ck.close()
    save_safetensors(os.path.join(d, "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(d)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    d = copy(checkpoint("gqa2_untied"), tmp_path / "ck")
    ck = SafetensorsCheckpoint(d)
    tensors = {n: np.array(ck.get(n)) for n in ck.names()}
    ck.close()
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:, :-1]
    save_safetensors(os.path.join(d, "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight.*shape"):
        load_model(d)


def test_missing_weights_file_and_model_type(checkpoint, tmp_path):
    d = copy(checkpoint("gqa2_untied"), tmp_path / "ck")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_model(d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "mistral"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        load_model(d)


def test_corrupt_file_is_named(checkpoint, tmp_path):
    d = copy(checkpoint("gqa2_untied"), tmp_path / "ck")
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(d)


def test_sharded_bf16_checkpoint_loads_every_tensor(checkpoint):
    d = checkpoint("sharded_bf16")
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    m = load_model(d, "bfloat16")
    assert jax.tree.leaves(m.params)[0].dtype == jax.numpy.bfloat16
    ck = SafetensorsCheckpoint(d)
    emb = np.asarray(ck.get("model.embed_tokens.weight")).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(m.params["embed"], np.float32), emb)


def test_orbax_round_trip_gives_identical_logits(checkpoint, tmp_path):
    m = load_model(checkpoint("mha_tied"))
    save_params(m.params, m.cfg, str(tmp_path / "orbax"))
    restored = restore_params(str(tmp_path / "orbax"), m.cfg)
    ids = np.random.default_rng(0).integers(0, m.cfg.vocab_size, 30)
    a = prompt_logprobs(m.cfg, m.params, ids)
    b = prompt_logprobs(m.cfg, restored, ids)
    np.testing.assert_array_equal(a, b)


TP_SCRIPT = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
sys.path.insert(0, sys.argv[2])
from test_weights import prompt_logprobs
from laps_jax.models.loader import load_model
from laps_jax.models.sharding import make_mesh
assert len(jax.devices()) == 8
m = load_model(sys.argv[1])
ids = np.random.default_rng(1).integers(0, m.cfg.vocab_size, 30)
a = prompt_logprobs(m.cfg, m.params, ids)
b = prompt_logprobs(m.cfg, m.params, ids, mesh=make_mesh(8))
c = prompt_logprobs(m.cfg, m.params, ids, mesh=make_mesh(8), layer_loop="unroll")
diff = max(float(np.abs(a - b).max()), float(np.abs(a - c).max()))
print(json.dumps({"max_diff": diff, "finite": bool(np.isfinite(a).all())}))
"""


def test_tensor_parallel_logits_equal_unsharded(checkpoint):
    """Sharded over 8 devices, with the stacked (scan) and per-layer (unroll) weights."""
    d = checkpoint("gqa4_hd32")  # 8 query heads, 2 kv heads: kv projections split mid-head
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", TP_SCRIPT, d, os.path.dirname(__file__)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["finite"] and res["max_diff"] < 1e-4


def test_bfloat16_weights_and_kv_track_float32(checkpoint):
    """bf16 weights and bf16 KV pages: same top token, log-probs within bf16 precision."""
    d = checkpoint("gqa2_untied")
    f32, bf16 = load_model(d, "float32"), load_model(d, "bfloat16")
    ids = np.random.default_rng(2).integers(0, f32.cfg.vocab_size, 30)
    a = prompt_logprobs(f32.cfg, f32.params, ids)
    runner = ModelRunner(bf16.cfg, bf16.params, num_pages=16, page_size=8, max_model_len=128,
                         grid=GRID)
    assert runner.kv_dtype == jax.numpy.bfloat16
    b = runner.run([SeqInput(ids, 0, [1, 2, 3, 4])], prompt_logprobs=True)[0].target_logprobs
    assert np.isfinite(b).all()
    assert np.abs(a - b).max() < 0.15 and np.abs(a - b).mean() < 0.05
