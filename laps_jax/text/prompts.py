"""Prompts from request fields: a completion prompt or chat messages -> token ids, or a
`PromptError` naming the field at fault.

One parser for every way text comes in: the HTTP server answers a `PromptError` as its OpenAI
400 (server/protocol.py wraps these functions) and the offline job writes it on the input line's
output line, so the same input is refused alike, with the same message. A prompt whose size
alone shows it cannot fit the context is refused before it is tokenized (`max_prompt_bytes`);
text must be valid Unicode (no lone surrogates).
"""

from __future__ import annotations

# a token covers at most the tokenizer's longest vocabulary entry; normalizers (NFC) can shrink
# text a little, so the prompt-size bound keeps this much slack before refusing unread
SIZE_SLACK = 2
# the chat roles a Qwen2-style template renders; "developer" (what newer OpenAI clients send in
# place of "system") is rendered as "system". Any other role would be dropped from the prompt
# by the template without a word, so it is refused instead.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class PromptError(ValueError):
    """A prompt that cannot run: `param` is the request field at fault, `code` the OpenAI error
    code a server answers with (its status is always 400)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def check_text(value: str, name: str) -> str:
    """Refuses text that is not valid Unicode (a lone surrogate like "\\ud800" from JSON)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"'{name}' is not valid Unicode text (a lone surrogate at character "
                          f"{e.start})", param=name) from None
    return value


def max_prompt_bytes(tokenizer, max_model_len: int) -> int | None:
    """UTF-8 bytes past which a text prompt is surely over the context, or None (no bound)."""
    per_token = getattr(tokenizer, "max_token_bytes", None)
    return None if not per_token else max_model_len * per_token * SIZE_SLACK


def _check_size(nbytes: int, bound: int | None, max_model_len: int, param: str) -> None:
    if bound is not None and nbytes > bound:
        raise PromptError(f"the prompt is {nbytes} bytes of text, which cannot fit this model's "
                          f"maximum context length of {max_model_len} tokens", param=param,
                          code="context_length_exceeded")


def parse_prompt(body: dict, vocab_size: int, tokenizer, max_model_len: int) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a one-element list of either."""
    if "prompt" not in body:
        raise PromptError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("this model has no tokenizer: send 'prompt' as token ids",
                              param="prompt")
        _check_size(len(check_text(prompt, "prompt").encode("utf-8")),
                    max_prompt_bytes(tokenizer, max_model_len), max_model_len, "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and len(prompt) >= max_model_len:
        ids = prompt  # too long whatever it holds: the caller says so
    elif isinstance(prompt, list) and set(map(type, prompt)) <= {int}:  # (bool is not int)
        # type() and min/max loop in C: 0.38 ms for 2,000 ids against 0.77 with a check per id
        ids = prompt
        if ids and not (0 <= min(ids) and max(ids) < vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise PromptError(f"token id {bad} in 'prompt' is outside the vocabulary "
                              f"[0, {vocab_size})", param="prompt")
    elif isinstance(prompt, list):
        raise PromptError("'prompt' must be a string or a list of token ids (one prompt per "
                          "request)", param="prompt")
    else:
        raise PromptError(f"'prompt' must be a string or a list of token ids, got "
                          f"{type(prompt).__name__}", param="prompt")
    if not ids:
        raise PromptError("'prompt' is empty", param="prompt")
    return ids if isinstance(prompt, str) else list(ids)  # a client's list is copied


def parse_messages(body: dict, tokenizer, max_model_len: int) -> list[int]:
    """Chat messages (text content, or OpenAI text parts) rendered by the tokenizer's chat
    template (`encode_chat`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"messages[{i}] must be an object", param="messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise PromptError(f"messages[{i}] needs a string 'role'", param="messages")
        if m["role"] not in CHAT_ROLES:
            raise PromptError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                              f"got {m['role'][:40]!r}", param="messages")
        if m["role"] == "developer":
            m = messages[i] = dict(m, role="system")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise PromptError(f"messages[{i}].content parts must be text parts",
                                  param="messages")
            m = dict(m, content="".join(p["text"] for p in content))
            messages[i] = m
        elif not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise PromptError(f"messages[{i}].content must be a string", param="messages")
    if tokenizer is None:
        raise PromptError("this model has no tokenizer, so it cannot serve chat",
                          code="unsupported")
    nbytes = 0
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            if isinstance(m.get(key), str):
                nbytes += len(check_text(m[key], f"messages[{i}].{key}").encode("utf-8"))
    _check_size(nbytes, max_prompt_bytes(tokenizer, max_model_len), max_model_len, "messages")
    try:
        return tokenizer.encode_chat(messages)
    except Exception as e:  # the template refused this conversation
        raise PromptError(f"chat template error: {e}", param="messages") from None
