"""config.json is user input: every bad field is refused with one line that names the field and
the file, as a ConfigError (a ValueError, so serve.py prints `error: ...` and exits 2), including
fields that disagree with the checkpoint's tensors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from laps_jax.config import ConfigError
from laps_jax.models.loader import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _set(**fields):
    return lambda cfg: {**cfg, **fields}


def _drop_layer_types(**fields):
    """Older transformers write no layer_types; without it the layer count meets the tensors."""
    return lambda cfg: {**{k: v for k, v in cfg.items() if k != "layer_types"}, **fields}


def _rope(params):
    return lambda cfg: {**cfg, "rope_parameters": {**cfg.get("rope_parameters", {}), **params}}


# (id, edit of the fixture's config.json (giving an object, or the file's text) or the file's
# bytes, field the error starts with; "" for a file that is no JSON object at all)
CASES = [
    ("null", _set(hidden_size=None), "hidden_size"),
    ("missing", lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "vocab_size"),
    ("list", _set(vocab_size=[4096]), "vocab_size"),
    ("string", _set(num_attention_heads="four"), "num_attention_heads"),
    ("float", _set(num_attention_heads=4.0), "num_attention_heads"),
    ("bool", _set(intermediate_size=True), "intermediate_size"),
    ("negative", _set(max_position_embeddings=-5), "max_position_embeddings"),
    ("zero", _set(num_key_value_heads=0), "num_key_value_heads"),
    ("over_int32", _set(max_position_embeddings=2**31), "max_position_embeddings"),
    ("huge_digits", lambda c: json.dumps({**c, "vocab_size": 1}).replace(
        '"vocab_size": 1', '"vocab_size": ' + "9" * 5000), "vocab_size"),
    ("gqa", _set(num_key_value_heads=3), "num_key_value_heads"),
    ("odd_head_dim", _set(head_dim=15), "head_dim"),
    ("heads_split", _set(num_attention_heads=3, num_key_value_heads=1), "hidden_size"),
    ("theta_zero", _rope({"rope_theta": 0}), "rope_parameters.rope_theta"),
    ("theta_inf", _set(rope_theta=float("inf")), "rope_theta"),
    ("eps", _set(rms_norm_eps=-1e-6), "rms_norm_eps"),
    ("tie_string", _set(tie_word_embeddings="false"), "tie_word_embeddings"),
    ("yarn_factor", _rope({"rope_type": "yarn", "factor": "4"}), "rope_parameters.factor"),
    ("yarn_beta", _rope({"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}),
     "rope_parameters.beta_fast"),
    ("window", _set(sliding_window="big"), "sliding_window"),
    ("layer_types", _set(num_hidden_layers=3), "layer_types"),
    ("layers_past_config", _drop_layer_types(num_hidden_layers=1), "num_hidden_layers"),
    ("layers_missing", _drop_layer_types(num_hidden_layers=3), "num_hidden_layers"),
    ("hidden_vs_tensors", _set(hidden_size=96), "hidden_size"),
    ("vocab_vs_tensors", _set(vocab_size=4096), "vocab_size"),
    ("mlp_vs_tensors", _set(intermediate_size=100), "intermediate_size"),
    ("kv_vs_tensors", _set(num_key_value_heads=4), "num_key_value_heads*head_dim"),
    ("array_file", lambda c: [c], ""),
    ("bad_utf8", b'{"model_type": "qwen2\xff"}', ""),
    ("deep", b"[" * 100_000, ""),
]


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("gqa2_untied")


def _model_dir(base: str, tmp_path, edit) -> tuple[str, str]:
    d = str(tmp_path / "model")
    shutil.copytree(base, d)
    path = os.path.join(d, "config.json")
    if isinstance(edit, bytes):
        raw = edit
    else:
        with open(path) as f:
            edited = edit(json.load(f))
        raw = (edited if isinstance(edited, str) else json.dumps(edited)).encode()
    with open(path, "wb") as f:
        f.write(raw)
    return d, path


@pytest.mark.parametrize("edit,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_field_is_named(base, tmp_path, edit, field):
    d, path = _model_dir(base, tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load_model(d)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg, msg
    assert len(msg.replace(d, "")) < 240, msg  # short, apart from the paths
    assert msg.startswith(f"{path}: {field}"), msg
    if field == "":
        assert "JSON" in msg, msg


def test_more_layers_in_the_checkpoint_names_the_file(base, tmp_path):
    """The issue's case: layers the config does not count are refused, not ignored."""
    d, path = _model_dir(base, tmp_path, _drop_layer_types(num_hidden_layers=1))
    with pytest.raises(ConfigError, match=r"num_hidden_layers is 1 but the checkpoint has 2 "
                                          r"layers \(model\.layers\.1\..* is in .*safetensors"):
        load_model(d)


def test_serve_prints_one_line_and_exits_2(base, tmp_path):
    d, path = _model_dir(base, tmp_path, _set(hidden_size=None))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--model", d,
                        "--port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {path}: hidden_size is required (got null)"], r.stderr
