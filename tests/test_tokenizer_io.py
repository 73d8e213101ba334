"""laps_jax's tokenizer, chat templates, incremental detokenizer and safetensors reader, checked
against transformers and the safetensors package (which laps_jax itself never imports)."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from hf_fixtures import (
    load_hf_tokenizer,
    make_tiny_qwen2_checkpoint,
    write_tokenizer_files,
)
from laps_jax.models.safetensors_io import (
    CheckpointError,
    SafetensorsCheckpoint,
    save_safetensors,
    save_safetensors_sharded,
)
from laps_jax.text.tokenizer import (
    QWEN25_CHAT_TEMPLATE,
    ChatTemplateError,
    IncrementalDecoder,
    Tokenizer,
    TokenizerError,
)

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand more",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café Größe — “quoted” … ½ €100",
    "你好，世界！这是一个测试。日本語のテキスト。한국어 문장.",
    "emoji 🙂🚀✨ family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "Combining: e\u0301 vs \u00e9 (NFC)",
    "numbers 1234567890 3.14159 -42 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "mixed<|im_end|>special tokens<|im_start|> inside",
    "'s 't 're 've 'm 'll 'd CAPS'S",
    "\u200b zero width \ufeff bom \u00a0nbsp",
]

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is the capital of France?"}],
    "single_system": [SYSTEM, {"role": "user", "content": "What is 2 + 2? 🙂"}],
    "multi": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫."},
    ],
    "multi_system": [
        SYSTEM,
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall\nquietly\n  on the pond."},
        {"role": "user", "content": "Another, please.\n\n"},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <b>now</b> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp_c\": 21}"},
    {"role": "tool", "content": "second result"},
]

# A different template for chat_template.jinja, so a test can tell which source was used.
JINJA_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + ' [jinja]\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tok_config"))


@pytest.fixture(scope="module")
def tok_jinja_dir(tmp_path_factory):
    # The config holds the Qwen template, chat_template.jinja a different one: the .jinja must win.
    d = write_tokenizer_files(tmp_path_factory.mktemp("tok_jinja"))
    (d / "chat_template.jinja").write_text(JINJA_TEMPLATE, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def ours(tok_dir):
    return Tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    return load_hf_tokenizer(tok_dir)


# --- tokenizer ------------------------------------------------------------------------------------


def test_encode_decode_match_transformers(ours, hf):
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(hf)
    assert ours.eos_token == hf.eos_token == "<|im_end|>"
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.bos_token is None and ours.bos_token_id is None


def test_eos_ids_from_tokenizer_and_generation_config(ours):
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert ours.eos_token_ids == [im_end, eot]
    assert ours.is_special(im_end) and not ours.is_special(ours.encode("a")[0])


def _hf_chat(hf, messages, **kw):
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)["input_ids"]
    return text, ids


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("where", ["tokenizer_config", "jinja"])
def test_chat_template_matches_transformers(conv, where, tok_dir, tok_jinja_dir, hf):
    d = tok_dir if where == "tokenizer_config" else tok_jinja_dir
    ours = Tokenizer(d)
    hf_tok = hf if where == "tokenizer_config" else load_hf_tokenizer(d)
    messages = CONVERSATIONS[conv]
    text, ids = _hf_chat(hf_tok, messages)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == text
    assert ours.encode_chat(messages) == ids
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == hf_tok.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False)
    if where == "jinja":
        assert "[jinja]" in text and ours.has_chat_template
    else:
        assert text.endswith("<|im_start|>assistant\n")
        if messages[0]["role"] != "system":  # Qwen2.5's default system prompt
            assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_chat_template_tools_match_transformers(ours, hf):
    for messages in (CONVERSATIONS["single"], CONVERSATIONS["single_system"], TOOL_CONVERSATION):
        text, ids = _hf_chat(hf, messages, tools=TOOLS)
        assert ours.apply_chat_template(messages, tools=TOOLS) == text
        assert ours.encode_chat(messages, tools=TOOLS) == ids
    # tojson must not HTML-escape, and keeps non-ASCII as is (ensure_ascii=False)
    assert "<b>now</b> & later" in ours.apply_chat_template(CONVERSATIONS["single"], tools=TOOLS)
    assert '"Zürich"' in ours.apply_chat_template(TOOL_CONVERSATION)


def test_chat_roles_developer_is_system_and_unknown_roles_are_refused(ours, hf):
    """The template drops a role it does not know without a word (an OpenAI client's
    "developer" instruction vanished from the prompt); parse_messages renders "developer" as
    transformers renders "system", and refuses any other unknown role, naming it."""
    from laps_jax.text.prompts import PromptError, parse_messages
    instruction = "Answer in French, in one short sentence. " * 3
    for later in (False, True):
        msgs = [{"role": "user", "content": "What is a list?"}]
        at = 2 if later else 0
        if later:
            msgs += [{"role": "assistant", "content": "A sequence."}]
        as_system = msgs[:at] + [{"role": "system", "content": instruction}] + msgs[at:]
        as_developer = [dict(m, role="developer") if m["role"] == "system" else m
                        for m in as_system]
        got = parse_messages({"messages": as_developer}, ours, 4096)
        assert got == _hf_chat(hf, as_system)[1] != ours.encode_chat(msgs)
    for role in ("wizard", "function", "System"):
        with pytest.raises(PromptError, match=f"role must be one of .*got '{role}'") as e:
            parse_messages({"messages": [{"role": role, "content": "hi"}]}, ours, 4096)
        assert e.value.param == "messages"


def test_template_list_in_config_and_template_kwargs(tmp_path):
    d = write_tokenizer_files(tmp_path, chat_template_in=None)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "{{ bos_token or 'NOBOS' }}|{{ eos_token }}|{% for m in messages %}"
                                        "{{ m.content }}{% endfor %}{% if flag %}+flag{% endif %}"},
        {"name": "tool_use", "template": "TOOLS {{ tools | tojson }} {{ messages | length }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer(d), load_hf_tokenizer(d)
    msgs = [{"role": "user", "content": "x"}]
    for kw in ({}, {"tools": TOOLS}, {"flag": True}):
        assert ours.apply_chat_template(msgs, **kw) == hf.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=False, **kw), kw
    assert ours.apply_chat_template(msgs, flag=True) == "NOBOS|<|im_end|>|x+flag"


def test_builtin_template_when_checkpoint_has_none(tmp_path):
    d = write_tokenizer_files(tmp_path, chat_template_in=None)
    ours = Tokenizer(d)
    assert not ours.has_chat_template and ours.chat_template == QWEN25_CHAT_TEMPLATE
    hf = load_hf_tokenizer(d)
    for messages in CONVERSATIONS.values():
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, chat_template=QWEN25_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CONVERSATIONS["single"]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_errors(tmp_path, ours):
    with pytest.raises(ValueError):
        ours.apply_chat_template([])
    d = write_tokenizer_files(tmp_path / "raise", chat_template_in=None)
    (d / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.content }}{% endfor %}{% set ns = namespace(n=1) %}{{ ns.n }}{% generation %}G{% endgeneration %}")
    t = Tokenizer(d)
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        t.apply_chat_template([SYSTEM])
    out = t.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert out.endswith("a1G") and out[:4].isdigit()
    bad = write_tokenizer_files(tmp_path / "syntax", chat_template_in=None)
    (bad / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TokenizerError, match="chat_template.jinja"):
        Tokenizer(bad)


def test_tokenizer_file_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer(tmp_path / "nope")
    d = write_tokenizer_files(tmp_path / "a")
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(d)
    d = write_tokenizer_files(tmp_path / "b")
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json.*invalid JSON"):
        Tokenizer(d)
    d = write_tokenizer_files(tmp_path / "c")
    (d / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(d)
    d = write_tokenizer_files(tmp_path / "d")
    (d / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json.*invalid JSON"):
        Tokenizer(d)
    d = write_tokenizer_files(tmp_path / "e")
    (d / "generation_config.json").write_text("oops")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer(d)


def test_special_tokens_as_dicts_and_missing_generation_config(tmp_path):
    d = write_tokenizer_files(tmp_path, generation_config=False)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t, hf = Tokenizer(d), load_hf_tokenizer(d)
    assert t.eos_token == hf.eos_token == "<|endoftext|>"
    assert t.eos_token_ids == [hf.eos_token_id]
    cfg["eos_token"] = "<|not_a_token|>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="tokenizer_config.json.*<\\|not_a_token\\|>"):
        Tokenizer(d)


# --- incremental decoding ---------------------------------------------------------------------------

STREAM_TEXTS = [
    "🙂🚀✨ 👨‍👩‍👧‍👦 🇫🇷 👍🏽 done",
    "你好，世界！这是一个流式解码测试。",
    "mixed ascii 和中文 and emoji 🎉 in one line 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "plain English text only.",
    "\ufffd a real replacement char \ufffd",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decoder_matches_full_decode(ours, text):
    ids = ours.encode(text, add_special_tokens=False)
    for skip in (True, False):
        stream_ids = [ours.token_to_id("<|im_start|>")] + ids + [ours.token_to_id("<|im_end|>")]
        dec = ours.incremental_decoder(skip_special_tokens=skip)
        chunks = [dec.push(t) for t in stream_ids]
        chunks.append(dec.flush())
        assert "".join(chunks) == ours.decode(stream_ids, skip_special_tokens=skip) == dec.text
        if "\ufffd" not in text:
            assert not any("\ufffd" in c for c in chunks)
    # Multi-byte characters are split across byte tokens, so some pushes must have held text back.
    if any(ord(c) > 0x7FF for c in text) and "\ufffd" not in text:
        dec = IncrementalDecoder(ours)
        assert "" in [dec.push(t) for t in ids]


def test_incremental_decoder_random_byte_streams(ours):
    # Random token sequences (arbitrary byte soup): the stream never emits a partial character, and the
    # joined stream equals the full decode after flush.
    rng = np.random.default_rng(0)
    for _ in range(30):
        ids = rng.integers(0, ours.base_vocab_size, size=int(rng.integers(1, 40))).tolist()
        dec = ours.incremental_decoder()
        chunks = [dec.push(t) for t in ids]
        assert all(not c.endswith("\ufffd") for c in chunks)
        chunks.append(dec.flush())
        assert "".join(chunks) == ours.decode(ids)


# --- safetensors ------------------------------------------------------------------------------------


def _sample_tensors():
    rng = np.random.default_rng(1)
    return {
        "w.f32": rng.standard_normal((5, 7)).astype(np.float32),
        "w.f16": rng.standard_normal((3,)).astype(np.float16),
        "w.bf16": rng.standard_normal((4, 2, 3)).astype(ml_dtypes.bfloat16),
        "w.i32": np.arange(-6, 6, dtype=np.int32).reshape(3, 4),
        "w.i64": np.arange(9, dtype=np.int64),
        "w.u8": np.arange(10, dtype=np.uint8),
        "w.bool": np.array([True, False, True]),
        "w.f64": np.linspace(0, 1, 4),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def test_reads_files_written_by_safetensors_numpy(tmp_path):
    from safetensors.numpy import save_file

    tensors = {k: v for k, v in _sample_tensors().items() if v.dtype != ml_dtypes.bfloat16}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    ck = SafetensorsCheckpoint(tmp_path)
    assert ck.names() == sorted(tensors) and ck.metadata == {"format": "np"}
    for k, v in tensors.items():
        got = ck.get(k)
        assert got.dtype == v.dtype and got.shape == v.shape == ck.shape(k) and np.array_equal(got, v)
        assert ck.has(k) and k in ck
    assert not ck.get("w.f32").flags.writeable and ck.get("w.f32", copy=True).flags.writeable


def test_bf16_roundtrip_with_torch(tmp_path):
    import torch
    from safetensors.torch import load_file as torch_load
    from safetensors.torch import save_file as torch_save

    t = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    torch_save({"x": t, "y": t[:2].float()}, str(tmp_path / "t.safetensors"))
    ck = SafetensorsCheckpoint(tmp_path / "t.safetensors")
    x = ck.get("x")
    assert x.dtype == ml_dtypes.bfloat16
    assert np.array_equal(x.astype(np.float32), t.float().numpy())
    assert np.array_equal(ck.get("y"), t[:2].float().numpy())
    # ... and the other way round
    save_safetensors(tmp_path / "ours.safetensors", {"x": x, "z": np.ones((2, 2), np.float32)}, {"format": "pt"})
    back = torch_load(str(tmp_path / "ours.safetensors"))
    assert back["x"].dtype == torch.bfloat16 and torch.equal(back["x"], t)
    assert torch.equal(back["z"], torch.ones(2, 2))


def test_writer_is_read_by_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    tensors = _sample_tensors()
    tensors["noncontig"] = np.arange(12, dtype=np.float32).reshape(3, 4).T
    tensors["bigendian"] = np.arange(4, dtype=">i4")
    save_safetensors(tmp_path / "a.safetensors", tensors, metadata={"k": "v"})
    loaded = load_file(str(tmp_path / "a.safetensors"))
    with safe_open(str(tmp_path / "a.safetensors"), framework="np") as f:
        assert f.metadata() == {"k": "v"}
    ours = SafetensorsCheckpoint(tmp_path / "a.safetensors")
    for k, v in tensors.items():
        if v.dtype == ml_dtypes.bfloat16:  # safetensors.numpy has no bf16; check through our reader
            assert np.array_equal(ours.get(k).view(np.uint16), v.view(np.uint16))
            continue
        assert loaded[k].shape == v.shape and np.array_equal(loaded[k], v), k
        assert np.array_equal(ours.get(k), v)


def test_sharded_writer_and_index(tmp_path):
    from safetensors.numpy import load_file

    tensors = {f"layer.{i}.w": np.full((64,), i, dtype=np.float32) for i in range(6)}
    paths = save_safetensors_sharded(tmp_path, tensors, max_shard_bytes=600)
    assert len(paths) == 3 and (tmp_path / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 256
    ck = SafetensorsCheckpoint(tmp_path)
    assert ck.names() == sorted(tensors)
    for k, v in tensors.items():
        assert np.array_equal(ck.get(k), v)
        assert np.array_equal(load_file(str(tmp_path / index["weight_map"][k]))[k], v)


def test_hf_sharded_bf16_checkpoint(tmp_path):
    from safetensors import safe_open

    d = make_tiny_qwen2_checkpoint(tmp_path, dtype="bfloat16", shard=True, tie_word_embeddings=True, num_layers=1)
    ck = SafetensorsCheckpoint(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ck.names() == sorted(index["weight_map"])
    assert "lm_head.weight" not in ck and "model.embed_tokens.weight" in ck  # tied: not saved
    for name, fname in index["weight_map"].items():
        with safe_open(str(d / fname), framework="pt") as f:
            ref = f.get_tensor(name).float().numpy()
        got = ck.get(name)
        assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32), ref), name
        assert ck.file_of(name) == d / fname


def _write_raw(path, header: dict | bytes, data: bytes = b"", header_len: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def test_checkpoint_errors_name_the_culprit(tmp_path):
    with pytest.raises(CheckpointError, match="not found.*missing_dir"):
        SafetensorsCheckpoint(tmp_path / "missing_dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no safetensors.*empty"):
        SafetensorsCheckpoint(empty)

    # index naming a shard that is not there
    sh = tmp_path / "sharded"
    save_safetensors_sharded(sh, {"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32)}, max_shard_bytes=400)
    (sh / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        SafetensorsCheckpoint(sh)
    # index mapping a tensor to a shard that lacks it
    sh2 = tmp_path / "sharded2"
    save_safetensors_sharded(sh2, {"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float32)}, max_shard_bytes=400)
    idx = json.loads((sh2 / "model.safetensors.index.json").read_text())
    idx["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    (sh2 / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="'ghost'.*model-00001-of-00002"):
        SafetensorsCheckpoint(sh2)
    (sh2 / "model.safetensors.index.json").write_text("{bad")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        SafetensorsCheckpoint(sh2)

    good = {"t": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    cases = {
        "tiny.safetensors": (lambda p: p.write_bytes(b"\x01\x02"), "truncated"),
        "hlen.safetensors": (lambda p: _write_raw(p, good, bytes(16), header_len=10_000), "header length 10000"),
        "json.safetensors": (lambda p: _write_raw(p, b"{not json}", bytes(16)), "not valid JSON"),
        "beyond.safetensors": (lambda p: _write_raw(p, good, bytes(8)), "'t'.*beyond the end"),
        "dtype.safetensors": (lambda p: _write_raw(
            p, {"t": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)), "'t'.*unsupported dtype 'C64'"),
        "size.safetensors": (lambda p: _write_raw(
            p, {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "'t'.*need 12"),
    }
    for fname, (make, pattern) in cases.items():
        p = tmp_path / fname
        make(p)
        with pytest.raises(CheckpointError, match=pattern) as e:
            SafetensorsCheckpoint(p)
        assert fname in str(e.value)

    # a model.safetensors truncated in its data section
    d = tmp_path / "trunc"
    d.mkdir()
    save_safetensors(d / "model.safetensors", {"w": np.ones((32, 32), np.float32)})
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="model.safetensors.*'w'.*beyond"):
        SafetensorsCheckpoint(d)

    ok = tmp_path / "ok"
    ok.mkdir()
    save_safetensors(ok / "model.safetensors", {"w": np.ones(3, np.float32)})
    ck = SafetensorsCheckpoint(ok)
    with pytest.raises(CheckpointError, match="'lm_head.weight'.*ok"):
        ck.get("lm_head.weight")
    with pytest.raises(CheckpointError, match="'x'"):
        ck.shape("x")
