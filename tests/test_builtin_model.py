"""The built-in checkpoint shipped in the package: small, loaded through the same path as any
user checkpoint, and it writes English-looking text (not noise)."""

from __future__ import annotations

import os
import re

from laps_jax.cli import builtin_model_dir
from laps_jax.config import ModelConfig
from laps_jax.engine.engine import Engine
from laps_jax.engine.sequence import SamplingParams
from laps_jax.models.loader import load_model
from laps_jax.text.tokenizer import Tokenizer

from conftest import small_engine_config


def english_like(text: str) -> float:
    """Share of words made of letters (with trailing punctuation) and of plausible length."""
    words = text.split()
    ok = [w for w in words if re.fullmatch(r"[\"'(]?[A-Za-z][a-z]{0,14}[.,;:!?)\"']*", w)]
    return len(ok) / max(len(words), 1)


def test_builtin_checkpoint_is_small_and_hf_shaped():
    d = builtin_model_dir()
    files = set(os.listdir(d))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(os.path.getsize(os.path.join(d, f)) for f in files) <= 8 * 1024 * 1024
    cfg = ModelConfig.from_model_dir(d)
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention, like Qwen2.5
    assert Tokenizer(d).has_chat_template


def test_builtin_model_writes_english():
    d = builtin_model_dir()
    m, tok = load_model(d), Tokenizer(d)
    eng = Engine(m.cfg, m.params, small_engine_config(max_chunk=128), tok.eos_token_ids)
    prompts = [tok.encode("The list type"),
               tok.encode_chat([{"role": "user", "content": "What is a dictionary?"}])]
    outs = eng.generate(prompts, SamplingParams(max_tokens=32))
    texts = [tok.decode(s.output) for s in outs]
    assert all(len(t.split()) >= 2 for t in texts), texts
    assert all(english_like(t) >= 0.7 for t in texts), texts
