"""Helpers (not tests) that build tiny Hugging Face Qwen2 checkpoints offline, for cross-checking laps_jax
against transformers. Import from test files as ``from hf_fixtures import ...`` (pytest puts tests/ on
sys.path). torch and transformers are imported lazily, only by the functions that need them.

What transformers 5.24 writes (so the readers in laps_jax know what to expect):

- ``config.json`` has ``"rope_parameters": {"rope_theta": ..., "rope_type": "default"}`` and no top-level
  ``rope_theta``; the weight dtype is under ``"dtype"`` (older releases, which wrote the Qwen2.5 checkpoints
  on the Hub, use a top-level ``"rope_theta"`` and ``"torch_dtype"``: a config reader must accept both).
  ``head_dim`` is written only when passed explicitly (Qwen2 derives it as hidden_size // num_heads).
  ``layer_types`` (all "full_attention"), ``sliding_window: null`` and ``use_sliding_window: false`` appear.
- With ``tie_word_embeddings=True`` the safetensors hold no ``lm_head.weight`` (only
  ``model.embed_tokens.weight``); untied checkpoints have both.
- ``save_pretrained(..., max_shard_size=...)`` shards into ``model-0000i-of-0000n.safetensors`` plus
  ``model.safetensors.index.json`` (``{"metadata": {"total_parameters", "total_size"}, "weight_map"}``);
  the safetensors metadata is ``{"format": "pt"}``.
- Qwen2 attention projections q/k/v carry biases; o_proj and the MLP do not.

The tokenizer is a byte-level BPE laid out like Qwen2's: NFC normalizer, Qwen's split regex then
ByteLevel(use_regex=False), ByteLevel decoder; base vocabulary first, then the added special tokens
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``. ``tokenizer_config.json`` mirrors Qwen2.5-Instruct's
(``tokenizer_class: Qwen2Tokenizer``, eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tests fork subprocesses after training

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from laps_jax.text.tokenizer import QWEN25_CHAT_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
DEFAULT_TOKENIZER_VOCAB = 1024

# A little non-English text so that some multi-byte merges exist too (most CJK/emoji stay split into bytes).
_EXTRA_TEXT = (
    "Größe, café, naïve, Ελληνικά, русский текст. 你好，世界！你好吗？我很好。日本語のテキストです。"
    "한국어 문장입니다. 🙂🙂 🚀 ✨ — “quotes” … ½ € £ ¥\n"
) * 20

_TOKENIZER_CACHE: dict[int, str] = {}  # vocab_size -> tokenizer JSON


def _training_texts() -> list[str]:
    from pydoc_data.topics import topics  # CPython's stdlib help text: ~460 KB, always available offline

    return [topics[k] for k in sorted(topics)] + [_EXTRA_TEXT]


def train_bpe_tokenizer(vocab_size: int = DEFAULT_TOKENIZER_VOCAB) -> Tokenizer:
    """A deterministic Qwen2-style byte-level BPE with ``vocab_size`` base tokens plus the 3 special tokens
    (ids ``vocab_size``, +1, +2). Trained once per process and size; each call returns a fresh copy."""
    if vocab_size not in _TOKENIZER_CACHE:
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
        )
        tok.train_from_iterator(_training_texts(), trainer=trainer)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        _TOKENIZER_CACHE[vocab_size] = tok.to_str()
    return Tokenizer.from_str(_TOKENIZER_CACHE[vocab_size])


def qwen25_tokenizer_config(tokenizer: Tokenizer, chat_template: str | None = QWEN25_CHAT_TEMPLATE) -> dict:
    """A tokenizer_config.json shaped like Qwen2.5-Instruct's for ``tokenizer``."""
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tokenizer.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg


def write_tokenizer_files(
    path: str | os.PathLike,
    *,
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB,
    chat_template: str | None = QWEN25_CHAT_TEMPLATE,
    chat_template_in: str | None = "tokenizer_config",
    generation_config: bool = True,
) -> Path:
    """Write tokenizer.json + tokenizer_config.json (+ chat_template.jinja when ``chat_template_in="jinja"``;
    no template at all when ``chat_template_in=None``) and, unless disabled, a Qwen2.5-like
    generation_config.json (eos ids [<|im_end|>, <|endoftext|>]). Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_bpe_tokenizer(tokenizer_vocab_size)
    tok.save(str(path / "tokenizer.json"))
    in_config = chat_template if chat_template_in == "tokenizer_config" else None
    cfg = qwen25_tokenizer_config(tok, in_config)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if chat_template_in == "jinja" and chat_template is not None:
        (path / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    elif chat_template_in not in ("tokenizer_config", "jinja", None):
        raise ValueError(f"chat_template_in must be 'tokenizer_config', 'jinja' or None, not {chat_template_in!r}")
    if generation_config:
        eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
        gen = {"bos_token_id": eot, "do_sample": False, "eos_token_id": [im_end, eot], "pad_token_id": eot}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    return path


def _reinit_(model, seed: int, std: float = 0.1) -> None:
    """Larger-than-default random weights so logits are far from uniform and mistakes show."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_tiny_qwen2_checkpoint(
    path: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    dtype: str = "float32",
    seed: int = 0,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    shard: bool = False,
    tokenizer_vocab_size: int = DEFAULT_TOKENIZER_VOCAB,
    chat_template_in: str | None = "tokenizer_config",
    weight_std: float = 0.1,
    rope_scaling: dict | None = None,
) -> Path:
    """Save a random ``transformers.Qwen2ForCausalLM`` with our tokenizer files into ``path``; returns ``path``.

    ``vocab_size`` defaults to the tokenizer's size (base + 3 special tokens); pass a larger one to mimic
    Qwen's padded embedding tables. ``dtype`` "bfloat16" stores BF16 safetensors. ``shard=True`` writes
    several shards and ``model.safetensors.index.json``. ``chat_template_in``: "tokenizer_config",
    "jinja" (``chat_template.jinja``) or None (no template). ``rope_scaling``: extra RoPE parameters
    (e.g. ``{"rope_type": "yarn", "factor": 4.0, ...}``), written into ``rope_parameters``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    write_tokenizer_files(path, tokenizer_vocab_size=tokenizer_vocab_size, chat_template_in=chat_template_in,
                          generation_config=False)
    tok = train_bpe_tokenizer(tokenizer_vocab_size)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    if vocab_size is None:
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < tok.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({tok.get_vocab_size()})")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")
    extra = {"head_dim": head_dim} if head_dim is not None else {}
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta), **(rope_scaling or {})},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eot,
        eos_token_id=im_end,
        **extra,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    _reinit_(model, seed, weight_std)
    if tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot,
                                               do_sample=False)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.eval()
    kwargs = {"max_shard_size": _shard_size(model)} if shard else {}
    model.save_pretrained(str(path), **kwargs)
    return path


def _shard_size(model) -> int:
    """A shard size giving a few shards: a third of the model, but at least the largest tensor."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return max(max(sizes), sum(sizes) // 3)


def load_hf_model(path: str | os.PathLike):
    """The saved checkpoint as a transformers model: float32, eval mode, eager attention (the reference)."""
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def load_hf_tokenizer(path: str | os.PathLike):
    """``transformers.AutoTokenizer`` on the checkpoint (offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def copy_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A copy of a checkpoint directory (to corrupt or edit one file without touching a shared fixture)."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    return Path(dst)


__all__ = [
    "SPECIAL_TOKENS",
    "QWEN2_PRETOKENIZE_REGEX",
    "train_bpe_tokenizer",
    "qwen25_tokenizer_config",
    "write_tokenizer_files",
    "make_tiny_qwen2_checkpoint",
    "load_hf_model",
    "load_hf_tokenizer",
    "copy_checkpoint",
]
