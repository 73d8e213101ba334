"""Tokenizer, chat template and incremental detokenizer for a Hugging Face model directory.

Reads ``tokenizer.json`` with the ``tokenizers`` library and renders chat templates with jinja2
exactly the way transformers (5.x) does, so prompts tokenize to the same ids the model was trained
on, without importing transformers.

Where the chat template comes from (same precedence as ``transformers.AutoTokenizer``):
``chat_template.jinja`` (plus named templates in ``additional_chat_templates/*.jinja``) if present,
else the ``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}``), else the built-in Qwen2.5 ChatML template :data:`QWEN25_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from tokenizers import Tokenizer as _HFTokenizer

from laps_jax.text.chat_template import (QWEN25_CHAT_TEMPLATE, ChatTemplateError,
                                           compile_chat_template, _normalize_messages, _plain)
from laps_jax.text.detokenizer import IncrementalDecoder

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# The special-token attributes transformers passes to every chat template (``special_tokens_map``).
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """The tokenizer files cannot be loaded; the message names the file at fault."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: invalid JSON ({e})") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from None


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """The tokenizer of a model directory.

    Attributes: ``eos_token_ids`` (every id that ends generation: the tokenizer's eos token, then
    ``generation_config.json``'s ``eos_token_id``), ``eos_token``/``pad_token``/``bos_token`` (str or
    None) and their ``*_id``, ``vocab_size`` (number of token ids including added tokens, i.e. the
    largest id + 1), ``chat_template`` (the default template source), ``has_chat_template`` (False
    when the built-in Qwen2.5 template stands in).
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise TokenizerError(f"tokenizer directory not found: {self.model_dir}")
        tok_path = self.model_dir / TOKENIZER_FILE
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: missing (the model directory needs a tokenizers-format {TOKENIZER_FILE})")
        try:
            tok_text = tok_path.read_text(encoding="utf-8")
            tok_json = json.loads(tok_text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"{tok_path}: invalid JSON ({e})") from None
        try:
            self._tok = _HFTokenizer.from_str(tok_text)
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tok_path}: not a valid tokenizers file ({e})") from None
        self._model_type = (tok_json.get("model") or {}).get("type") if isinstance(tok_json, dict) else None

        cfg_path = self.model_dir / TOKENIZER_CONFIG_FILE
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        if not isinstance(cfg, dict):
            raise TokenizerError(f"{cfg_path}: expected a JSON object")
        self.config = cfg
        if cfg.get("split_special_tokens"):
            self._tok.encode_special_tokens = True
        self._clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False)) and (
            self._model_type != "BPE"
            or bool(cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )

        # Special tokens named in tokenizer_config.json (a string or {"content": ...}).
        self.special_tokens: dict[str, str] = {}
        for attr in SPECIAL_TOKEN_ATTRIBUTES:
            content = _token_content(cfg.get(attr))
            if content is not None:
                self.special_tokens[attr] = content
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.pad_token = self.special_tokens.get("pad_token")
        self.bos_token_id = self._special_id(self.bos_token, cfg_path)
        self.eos_token_id = self._special_id(self.eos_token, cfg_path)
        self.pad_token_id = self._special_id(self.pad_token, cfg_path)

        self.eos_token_ids = self._collect_eos_ids()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.base_vocab_size = self._tok.get_vocab_size(with_added_tokens=False)

        self.chat_templates, self.has_chat_template, self._template_source = self._load_templates(cfg, cfg_path)
        self._compiled: dict[str, jinja2.Template] = {}
        for name, src in self.chat_templates.items():
            try:
                self._compiled[name] = compile_chat_template(src)
            except jinja2.TemplateSyntaxError as e:
                raise TokenizerError(f"{self._template_source}: chat template {name!r} has a syntax error: {e}") from None

    # --- loading ---

    def _special_id(self, token: str | None, cfg_path: Path) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"{cfg_path}: special token {token!r} is not in the vocabulary of {TOKENIZER_FILE}")
        return tid

    def _collect_eos_ids(self) -> list[int]:
        ids: list[int] = []
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        gen_path = self.model_dir / GENERATION_CONFIG_FILE
        from_gen = _as_id_list(_read_json(gen_path).get("eos_token_id")) if gen_path.is_file() else []
        ids += [i for i in from_gen if i not in ids]
        if not ids:
            cfg_path = self.model_dir / MODEL_CONFIG_FILE
            if cfg_path.is_file():
                model_cfg = _read_json(cfg_path)
                if isinstance(model_cfg, dict):
                    ids += _as_id_list(model_cfg.get("eos_token_id"))
        if not ids:
            # Last resort: the ChatML end tokens, if the vocabulary has them as added tokens.
            for t in ("<|im_end|>", "<|endoftext|>"):
                tid = self._tok.token_to_id(t)
                if tid is not None:
                    ids.append(tid)
        return ids

    def _load_templates(self, cfg: dict, cfg_path: Path) -> tuple[dict[str, str], bool, str]:
        templates: dict[str, str] = {}
        source = str(cfg_path)
        jinja_path = self.model_dir / CHAT_TEMPLATE_FILE
        if jinja_path.is_file():
            templates["default"] = jinja_path.read_text(encoding="utf-8")
            source = str(jinja_path)
        extra_dir = self.model_dir / CHAT_TEMPLATE_DIR
        if extra_dir.is_dir():
            for p in sorted(extra_dir.glob("*.jinja")):
                templates[p.name.removesuffix(".jinja")] = p.read_text(encoding="utf-8")
        if templates:  # template files replace the config's field entirely, as in transformers
            return templates, True, source
        field = cfg.get("chat_template")
        if isinstance(field, str):
            return {"default": field}, True, source
        if isinstance(field, list):
            try:
                return {t["name"]: t["template"] for t in field}, True, source
            except (TypeError, KeyError):
                raise TokenizerError(f"{cfg_path}: chat_template list entries need 'name' and 'template'") from None
        if field is not None:
            raise TokenizerError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}}")
        return {"default": QWEN25_CHAT_TEMPLATE}, False, "built-in Qwen2.5 template"

    # --- tokens ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens`` applies the post-processor, e.g. a BOS; Qwen adds none).

        Goes through ``encode_batch_fast`` (same ids, no character offsets), which releases the GIL while
        it works: ``encode`` holds it, so a 3 MiB prompt tokenized on a worker thread would still stall the
        event loop for seconds, and freeing the offsets of ~2M tokens holds it for 0.2 s more."""
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # tokenizers < 0.20
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest vocabulary entry (added tokens included): no token covers more
        bytes of text, so a prompt of ``n`` bytes has at least ``n / max_token_bytes`` tokens."""
        return max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def decode_raw(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The model's own decode, without the clean-up of spaces (IncrementalDecoder's view)."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        added = self._tok.get_added_tokens_decoder().get(token_id)
        return bool(added is not None and added.special)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # --- chat ---

    @property
    def chat_template(self) -> str:
        return self.chat_templates.get("default") or next(iter(self.chat_templates.values()))

    def _pick_template(self, name: str | None, tools) -> str:
        if name is not None:
            if name not in self._compiled:
                raise ChatTemplateError(f"no chat template named {name!r} (have {sorted(self._compiled)})")
            return name
        if len(self._compiled) == 1:
            return next(iter(self._compiled))
        if tools is not None and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        raise ChatTemplateError(
            f"{self._template_source}: several chat templates and none named 'default' (have {sorted(self._compiled)})"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_name: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt string, as ``transformers``' ``apply_chat_template(tokenize=False)``.

        ``template_kwargs`` (e.g. ``enable_thinking=False``) reach the template, after the special tokens
        (``bos_token``, ``eos_token``, ...). Raises :class:`ChatTemplateError` when the template rejects the
        conversation, ``ValueError``/``TypeError`` for malformed input.
        """
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        chat = _normalize_messages(messages)
        if tools is not None:
            if not all(isinstance(t, Mapping) for t in tools):
                raise TypeError("tools must be JSON-schema dicts")
            tools = _plain(list(tools))
        if documents is not None:
            if not all(isinstance(d, Mapping) for d in documents):
                raise TypeError("documents must be dicts with 'title' and 'text'")
            documents = _plain(list(documents))
        kwargs = _plain({**self.special_tokens, **template_kwargs})
        template = self._compiled[self._pick_template(template_name, tools)]
        try:
            return template.render(
                messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(str(e)) from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes any BOS itself: no special tokens added)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
        .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve").replace(" 're", "'re")
    )
