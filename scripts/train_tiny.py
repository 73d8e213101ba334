#!/usr/bin/env python
"""Train the small built-in Qwen2 checkpoint that `python scripts/serve.py` serves by default.

Everything it needs is on every machine: the English text is CPython's own documentation
(`pydoc_data.topics`, the text behind `help("topic")`) plus the docstrings of the standard
library, read with `ast` (nothing is imported or executed). It trains a byte-level BPE tokenizer
laid out like Qwen2's, then a Qwen2-architecture model through laps_jax's real forward pass
(`models.qwen2.forward_hidden` over a scratch KV page cache), and writes a Hugging Face
checkpoint: config.json, model.safetensors, tokenizer.json, tokenizer_config.json (Qwen2.5 chat
template, eos <|im_end|>, pad <|endoftext|>) and generation_config.json. Part of the data is
rendered through the chat template, so chat requests get English back.

    python scripts/train_tiny.py                      # the shipped model (see docs/BUILTIN_MODEL.md)
    python scripts/train_tiny.py --steps 20 --out /tmp/tiny   # a quick smoke run

The same seed on the same Python version gives the same tokenizer, data order and weights.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "laps_jax", "builtin_model")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2's pre-tokenizer split (the same regex as Qwen2's tokenizer.json).
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SYSTEM_PROMPT = "You are a helpful assistant."
MAX_BYTES = 8 * 1024 * 1024


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=900, help="optimizer steps")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (AdamW)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    ap.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096,
                    help="model vocabulary: BPE tokens plus the 3 special tokens")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--max-position-embeddings", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--chat-fraction", type=float, default=0.35,
                    help="share of documents that are also turned into chat samples")
    ap.add_argument("--save-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="safetensors dtype; auto = float32 if the directory fits 8 MiB, else bfloat16")
    ap.add_argument("--sample-tokens", type=int, default=40,
                    help="greedy tokens per sample printed at the end (0: no samples)")
    return ap.parse_args(argv)


# --- corpus ------------------------------------------------------------------------------------

_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|[+|]|\S+\s*::=)")


def prose_paragraphs(text: str) -> list[str]:
    """The English paragraphs of reStructuredText-ish help text, each re-flowed onto one line.

    Drops tables, grammar rules, code examples, headings and anything mostly not letters."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines or any(_CODE_LINE.match(ln) for ln in lines):
            continue
        if lines[0].startswith("   ") or re.fullmatch(r"[=*\-~^]+", lines[-1].strip()):
            continue  # indented code / literal block, or a heading
        s = " ".join(ln.strip() for ln in lines)
        s = re.sub(r"\s+", " ", s).strip()
        s = re.sub(r"(?<=[a-z])- (?=[a-z])", "-", s)  # "built-\nin" re-flowed
        s = re.sub(r"\*{1,2}([^*\s][^*]*?)\*{1,2}", r"\1", s)  # *emphasis*, **strong**
        if len(s) < 60 or not s[0].isupper() or s[-1] not in ".:!?)\"":
            continue
        if s.endswith("::"):
            s = s[:-1]
        letters = sum(c.isalpha() or c == " " for c in s)
        if letters < 0.85 * len(s) or not s.isascii():
            continue
        out.append(s)
    return out


def pydoc_documents() -> list[tuple[str, str, list[str]]]:
    """(key, subject, paragraphs) for every topic of `help()`; the subject comes from its heading."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        text = topics[key]
        title = text.split("\n", 1)[0].strip()
        title = re.sub(r"\s+\u2014\s+", " (", title) + (")" if "\u2014" in title else "")
        title = title.replace('"', "").strip() or key
        # "The assert statement" -> "the assert statement", "Mapping Types" -> "mapping types"
        title = " ".join(w.lower() if w.istitle() and w != "Python" else w for w in title.split())
        paras = prose_paragraphs(text)
        if paras:
            docs.append((key, title, paras))
    return docs


_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
              "turtledemo", "__pycache__", "pydoc_data", "__phello__", "encodings"}


def stdlib_docstrings() -> list[tuple[str, str, str, list[str]]]:
    """(module, kind, dotted name, paragraphs) of every documented module, class and function of the
    standard library, parsed from source (nothing is imported); sorted, so deterministic."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith(("config-", ".")))
        for f in sorted(files):
            if not f.endswith(".py") or f.startswith("_"):
                continue
            path = os.path.join(d, f)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            if any(part.startswith("_") for part in module.split(".")[:-1]):
                continue
            module = module.removesuffix(".__init__")
            try:
                with open(path, encoding="utf-8") as fh, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tree = ast.parse(fh.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            out.extend((module, *item) for item in _docstrings_of(tree, module))
    return out


def _docstrings_of(tree, module: str):
    def visit(node, prefix, kind):
        doc = ast.get_docstring(node)
        if doc:
            paras = prose_paragraphs(doc)
            if paras:
                yield kind, prefix, paras
        for child in node.body:
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                yield from visit(child, f"{prefix}.{child.name}", "class")
            elif (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and not child.name.startswith("_") and kind != "function"):
                yield from visit(child, f"{prefix}.{child.name}",
                                 "method" if kind == "class" else "function")

    yield from visit(tree, module, "module")


_QUESTIONS = {
    "topic": ("Tell me about {s}.", "Explain {s}.", "What should I know about {s}?",
              "Can you describe {s} in Python?", "How does Python handle {s}?"),
    "alias-what": ("What is {s}?",),
    "alias": ("What is {s} in Python?", "Explain {s}.", "Tell me about {s}."),
    "module": ("What is the {s} module?", "Tell me about the {s} module.",
               "What does the {s} module do?"),
    "class": ("What is {s}?", "Tell me about the {s} class.", "What is {s} used for?"),
    "function": ("What does {s} do?", "How do I use {s}?", "Explain {s}."),
    "method": ("What does {s} do?", "What is the {s} method?"),
}
# Everyday names for a few help() topics, so plain questions ("What is a list?") have answers.
_ALIASES = {
    "typesmapping": ("a dictionary", "a dict", "a mapping"),
    "typesseq": ("a list", "a tuple", "a sequence", "a range"),
    "typesseq-mutable": ("a mutable sequence",),
    "string-methods": ("a string", "a str"),
    "lambda": ("a lambda",),
    "function": ("a function",),
    "class": ("a class",),
    "exceptions": ("an exception",),
    "typesmodules": ("a module",),
    "truth": ("truth value testing",),
    "context-managers": ("a context manager",),
    "integers": ("an integer",),
}


def build_documents(chat_fraction: float, rng: random.Random):
    """Plain documents (str) and chat samples (lists of messages), in a seeded order.
    Repeated paragraphs (boilerplate docstrings) are kept once."""
    seen: set[str] = set()

    def fresh(paras):
        out = [p for p in paras if p not in seen]
        seen.update(out)
        return out

    plain, chats = [], []
    for key, title, paras in pydoc_documents():
        paras = fresh(paras)
        if not paras:
            continue
        plain.append(title[0].upper() + title[1:] + "\n\n" + "\n\n".join(paras))
        answers = [p for p in paras if not p.endswith(":")]
        for i in range(0, len(answers), 2):  # each pair of paragraphs can answer a question
            if rng.random() < min(1.0, 2 * chat_fraction):
                chats.append(("topic", title, answers[i:i + 2]))
        for alias in _ALIASES.get(key, ()):  # one answer per everyday question, asked twice
            chats += [("alias-what", alias, answers[:1]), ("alias", alias, answers[:1])]
    # One plain document per module (its docstrings in source order), so documents run long.
    for _, items in itertools.groupby(stdlib_docstrings(), key=lambda item: item[0]):
        text = []
        for _, kind, name, paras in items:
            paras = fresh(paras)
            text += paras
            answers = [p for p in paras if not p.endswith(":")]
            if answers and rng.random() < chat_fraction:
                chats.append((kind, name, answers[:2]))
        if text:
            plain.append("\n\n".join(text))
    samples = []
    for kind, subject, paras in chats:
        question = rng.choice(_QUESTIONS[kind]).format(s=subject)
        answer = "\n\n".join(paras)
        if len(answer) > 900:
            answer = paras[0]
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]
        if rng.random() < 0.5:  # with an explicit system prompt, and with the template's default
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        samples.append(messages)
    return plain, samples


# --- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE laid out like Qwen2's: NFC, Qwen's split regex, ByteLevel; the base
    vocabulary first, then <|endoftext|>, <|im_start|>, <|im_end|> (the last three ids)."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise SystemExit(f"the corpus only supports {tok.get_vocab_size(with_added_tokens=True)} "
                         f"tokens; pass a smaller --vocab-size")
    return tok


def write_tokenizer_files(out: str, tok) -> None:
    from laps_jax.text.tokenizer import QWEN25_CHAT_TEMPLATE

    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    cfg = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": QWEN25_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 2048,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    _write_json(os.path.join(out, "tokenizer_config.json"), cfg)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# --- data --------------------------------------------------------------------------------------


def token_stream(tokenizer, plain: list[str], chats: list[list[dict]], rng: random.Random):
    """All documents and chat samples, shuffled, each followed by <|endoftext|>: one int32 array.
    Chat samples are rendered with the checkpoint's own chat template (what the server renders)."""
    import numpy as np

    eot = tokenizer.token_to_id("<|endoftext|>")
    texts = plain + [tokenizer.apply_chat_template(m) for m in chats]
    rng.shuffle(texts)
    ids = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_special_tokens=False))
        ids.append(eot)
    return np.asarray(ids, np.int32)


# --- training ----------------------------------------------------------------------------------


@contextlib.contextmanager
def differentiable_attention():
    """The CPU attention path (`xla`) runs a while loop whose trip count depends on the data, which
    reverse-mode autodiff cannot go through; while tracing the training step, the model's attention
    call goes to the pure-jnp reference of the same paged layout (same math, tested equal)."""
    from laps_jax.models import qwen2
    from laps_jax.pallas_kernels import paged_attention_reference

    def attention(q, k_cache, v_cache, layer, q_lens, cached_lens, page_table, *, scale, backend):
        return paged_attention_reference(q, k_cache, v_cache, layer, q_lens, cached_lens,
                                         page_table, scale)

    saved = qwen2.paged_attention
    qwen2.paged_attention = attention
    try:
        yield
    finally:
        qwen2.paged_attention = saved


def make_train_step(cfg, optimizer, batch_size: int, seq_len: int, page_size: int = 16):
    import jax
    import jax.numpy as jnp
    import optax

    from laps_jax.models.qwen2 import Batch, forward_hidden, lm_logits

    if seq_len % page_size:
        raise SystemExit(f"--seq-len must be a multiple of {page_size}")
    per_seq = seq_len // page_size
    num_pages = batch_size * per_seq + 1  # page 0 is the trash page
    page_table = 1 + jnp.arange(batch_size * per_seq, dtype=jnp.int32).reshape(batch_size, per_seq)
    cache_shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)

    def loss_fn(params, window):
        tokens, targets = window[:, :-1], window[:, 1:]
        batch = Batch(tokens, jnp.full((batch_size,), seq_len, jnp.int32),
                      jnp.zeros((batch_size,), jnp.int32), page_table)
        scratch = jnp.zeros(cache_shape, jnp.float32)
        hidden, _, _ = forward_hidden(params, cfg, scratch, scratch, batch, "xla")
        logits = lm_logits(params, cfg, hidden)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(params, opt_state, window):
        loss, grads = jax.value_and_grad(loss_fn)(params, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_optimizer(args):
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=min(args.warmup, max(args.steps - 1, 1)),
        decay_steps=max(args.steps, 2), end_value=args.lr * args.min_lr_ratio)

    def decay_mask(params):  # decay matrices and (stacked) biases, not the RMSNorm scales
        return jax.tree_util.tree_map_with_path(
            lambda path, p: p.ndim >= 2 and "norm" not in jax.tree_util.keystr(path), params)

    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                                   mask=decay_mask))


# --- checkpoint ----------------------------------------------------------------------------------


def hf_config(cfg, tokenizer, dtype: str) -> dict:
    """config.json as transformers writes a Qwen2Config (Qwen2.5 Hub style: top-level rope_theta)."""
    eot, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    d = cfg.to_hf_dict()
    d.update({
        "attention_dropout": 0.0, "bos_token_id": eot, "eos_token_id": im_end,
        "initializer_range": 0.02, "layer_types": ["full_attention"] * cfg.num_layers,
        "max_window_layers": cfg.num_layers, "rope_scaling": None, "sliding_window": None,
        "torch_dtype": dtype, "transformers_version": "4.43.1", "use_cache": True,
        "use_sliding_window": False,
    })
    return dict(sorted(d.items()))


def save_checkpoint(out: str, tmp_tok_dir: str, cfg, params, tokenizer, save_dtype: str) -> str:
    import ml_dtypes
    import numpy as np

    from laps_jax.models.safetensors_io import save_safetensors
    from laps_jax.models.weights import params_to_hf

    tensors = {k: np.asarray(v, np.float32) for k, v in params_to_hf(params, cfg).items()}
    tok_bytes = sum(os.path.getsize(os.path.join(tmp_tok_dir, f)) for f in os.listdir(tmp_tok_dir))
    f32_bytes = sum(t.nbytes for t in tensors.values())
    if save_dtype == "auto":
        save_dtype = "float32" if f32_bytes + tok_bytes + 64 * 1024 <= MAX_BYTES else "bfloat16"
    if save_dtype == "bfloat16":
        tensors = {k: t.astype(ml_dtypes.bfloat16) for k, t in tensors.items()}
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(tmp_tok_dir):
        shutil.copy(os.path.join(tmp_tok_dir, f), os.path.join(out, f))
    save_safetensors(os.path.join(out, "model.safetensors"), tensors, {"format": "pt"})
    _write_json(os.path.join(out, "config.json"), hf_config(cfg, tokenizer, save_dtype))
    eot, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    _write_json(os.path.join(out, "generation_config.json"), {
        "bos_token_id": eot, "do_sample": False, "eos_token_id": [im_end, eot],
        "pad_token_id": eot, "transformers_version": "4.43.1"})
    return save_dtype


def print_samples(out: str, max_tokens: int) -> list[tuple[str, str]]:
    """Greedy completions from the written checkpoint, loaded the way the server loads it."""
    from laps_jax.config import EngineConfig
    from laps_jax.engine.engine import Engine
    from laps_jax.engine.sequence import SamplingParams
    from laps_jax.models.loader import load_model
    from laps_jax.text.tokenizer import Tokenizer

    model = load_model(out)
    tok = Tokenizer(out)
    engine = Engine(model.cfg, model.params,
                    EngineConfig(kv_cache_tokens=2048, max_model_len=512, max_chunk=64,
                                 max_prefill_batch=1, max_decode_batch=1),
                    tok.eos_token_ids)
    prompts = [("completion", "The list type"),
               ("chat", [{"role": "user", "content": "What is a dictionary?"}])]
    results = []
    for kind, p in prompts:
        ids = (tok.encode(p, add_special_tokens=False) if kind == "completion"
               else tok.encode_chat(p, add_generation_prompt=True))
        seq = engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0]
        text = tok.decode(seq.output, skip_special_tokens=True)
        shown = p if kind == "completion" else p[-1]["content"]
        print(f"[{kind}] {shown!r} -> {text!r}")
        results.append((shown, text))
    return results


# --- main --------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    rng = random.Random(args.seed)
    plain, chats = build_documents(args.chat_fraction, rng)
    print(f"corpus: {len(plain)} documents ({sum(map(len, plain)) / 1e6:.2f} MB of text), "
          f"{len(chats)} chat samples", flush=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from laps_jax.config import ModelConfig
    from laps_jax.models.qwen2 import init_params
    from laps_jax.text.tokenizer import Tokenizer

    tok_dir = tempfile.mkdtemp(prefix="laps_tiny_tok_")
    try:
        chat_text = [m["content"] for msgs in chats for m in msgs]
        hf_tok = train_tokenizer(plain + chat_text, args.vocab_size)
        write_tokenizer_files(tok_dir, hf_tok)
        tokenizer = Tokenizer(tok_dir)
        stream = token_stream(tokenizer, plain, chats, rng)
        window = args.seq_len + 1
        print(f"tokens: {len(stream):,} ({len(stream) // window:,} windows of {window}); "
              f"tokenizer ready in {time.time() - t0:.0f}s", flush=True)

        head_dim = args.hidden_size // args.num_heads
        cfg = ModelConfig(args.vocab_size, args.hidden_size, args.intermediate_size,
                          args.num_layers, args.num_heads, args.num_kv_heads, head_dim,
                          rope_theta=args.rope_theta, rms_norm_eps=1e-6, tie_word_embeddings=True,
                          max_position_embeddings=args.max_position_embeddings, name="builtin")
        print(f"model: {cfg.num_params():,} parameters "
              f"(hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads}q/"
              f"{cfg.num_kv_heads}kv heads x {cfg.head_dim}, mlp {cfg.intermediate_size}, "
              f"vocab {cfg.vocab_size}, tied embeddings)", flush=True)

        params = init_params(cfg, jnp.float32, args.seed)
        optimizer = make_optimizer(args)
        opt_state = optimizer.init(params)
        with differentiable_attention():
            step = make_train_step(cfg, optimizer, args.batch_size, args.seq_len)
            data_rng = np.random.default_rng(args.seed)
            bar = tqdm(range(args.steps), desc="train", unit="step", mininterval=2.0,
                       file=sys.stdout, dynamic_ncols=False, ncols=100)
            losses = []
            t_train = time.time()
            for i in bar:
                starts = data_rng.integers(0, len(stream) - window, args.batch_size)
                batch = np.stack([stream[s:s + window] for s in starts])
                params, opt_state, loss = step(params, opt_state, jnp.asarray(batch))
                losses.append(float(loss))
                recent = float(np.mean(losses[-20:]))
                bar.set_postfix(loss=f"{losses[-1]:.3f}", avg20=f"{recent:.3f}", refresh=False)
            bar.close()
            train_s = time.time() - t_train
        jax.block_until_ready(params)
        saved = save_checkpoint(args.out, tok_dir, cfg, params, hf_tok, args.save_dtype)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)

    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"final loss {recent:.4f} (mean of the last 20 steps; last step {losses[-1]:.4f}); "
          f"training {train_s:.0f}s, "
          f"total {time.time() - t0:.0f}s; "
          f"{args.steps * args.batch_size * args.seq_len:,} tokens seen")
    print(f"wrote {args.out} ({saved} weights, {size / 2**20:.2f} MiB)")
    if size > MAX_BYTES:
        print(f"warning: the checkpoint is larger than {MAX_BYTES // 2**20} MiB", file=sys.stderr)
    if args.sample_tokens > 0:
        print_samples(args.out, args.sample_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
