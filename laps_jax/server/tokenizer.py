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

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# The special-token attributes transformers passes to every chat template (``special_tokens_map``).
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Qwen2.5-Instruct's chat template, verbatim. Used only when a checkpoint ships no template.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Names a message's reasoning may come under; transformers copies it to all of them before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """The tokenizer files cannot be loaded; the message names the file at fault."""


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (``raise_exception``) or failed while rendering."""


# --- jinja environment, configured as transformers' ``_cached_compile_jinja_template`` -------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Unlike jinja's own tojson, no HTML escaping; same options as transformers.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A ``namespace()`` that refuses underscore-prefixed attributes (no reaching CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


def _jinja_version_ok() -> bool:
    parts = []
    for p in jinja2.__version__.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= (3, 1, 6)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox transformers uses (jinja2 >= 3.1.6 required: older has escapes)."""
    if not _jinja_version_ok():
        raise ImportError(f"chat templates need jinja2>=3.1.6 (have {jinja2.__version__}): older versions have sandbox escapes")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types (as transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return _plain(value.item())
        except (TypeError, ValueError):
            pass
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    out = []
    for m in messages:
        if callable(getattr(m, "model_dump", None)):
            m = m.model_dump()
        if not isinstance(m, Mapping):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        # Keys whose value is None are dropped (OpenAI clients send content=None, tool_calls=None).
        m = _plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# --- loading helpers -------------------------------------------------------------------------------


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
        """Token ids of ``text`` (``add_special_tokens`` applies the post-processor, e.g. a BOS; Qwen adds none)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

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


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text, emitting text only once it is complete.

    Byte-level BPE splits multi-byte UTF-8 characters (emoji, CJK) across tokens; decoding a partial
    character yields U+FFFD, so text ending in U+FFFD is held back until the next token completes it.
    Each step decodes a small window (the tokens of the previous emission plus the new ones) and emits
    what the new tokens added, so decoders with context effects (SentencePiece's leading space) stay
    right. ``"".join(pushes) + flush() == tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this have been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        return self._step(final=False)

    def extend(self, token_ids: Iterable[int]) -> str:
        for t in token_ids:
            self.ids.append(int(t))
        return self._step(final=False)

    def flush(self) -> str:
        """At the end of the stream: whatever is held back (an incomplete character decodes to U+FFFD)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full_text = self._decode(self.ids[self._prefix :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        new = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new
