"""OpenAI request validation: JSON bodies -> a `GenerationRequest`, or an `APIError` (4xx).

Every check names the field at fault, so a client sees what to fix; nothing here touches the
engine, so a rejected request changes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from laps_jax.engine.sequence import SamplingParams

MAX_STOP = 4
MAX_LOGPROBS = 20
# OpenAI fields this server does not implement, with the value that asks for nothing: any other
# value is refused rather than silently ignored (the answer would not be what was asked for)
NOT_IMPLEMENTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
                   "logit_bias": {}, "tools": [], "functions": [], "best_of": 1, "suffix": "",
                   "response_format": {"type": "text"}}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "code", "param"}} with `status`."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request",
                 param: str | None = None, type_: str | None = None, headers=None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}


@dataclasses.dataclass
class GenerationRequest:
    kind: str                      # "completion" or "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = dataclasses.field(default_factory=list)
    logprobs: int | None = None    # None = no logprobs; else how many top alternatives
    model: str = ""
    return_token_ids: bool = False  # extension: each choice carries "token_ids" (for replays)


def _field(body: dict, name: str, types, default=None, *, allow_none: bool = True):
    value = body.get(name, default)
    if value is None:
        if not allow_none and name in body:
            raise APIError(f"'{name}' must not be null", param=name)
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(f"'{name}' must be {_type_name(types)}, got a boolean", param=name)
    if not isinstance(value, types):
        raise APIError(f"'{name}' must be {_type_name(types)}, got {type(value).__name__}",
                       param=name)
    return value


def _type_name(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "a list", dict: "an object"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def parse_sampling(body: dict, default_max_tokens: int | None, max_tokens_limit: int,
                   kind: str) -> tuple[SamplingParams, list[str], int | None]:
    max_tokens = _field(body, "max_completion_tokens", int, None)
    max_tokens = _field(body, "max_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_tokens_limit
    if max_tokens <= 0:
        raise APIError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    temperature = float(_field(body, "temperature", (int, float), 1.0))
    if not 0 <= temperature <= 2:
        raise APIError(f"'temperature' must be between 0 and 2, got {temperature}",
                       param="temperature")
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    if not 0 < top_p <= 1:
        raise APIError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _field(body, "top_k", int, 0)
    if top_k < -1:
        raise APIError(f"'top_k' must be -1, 0 (no limit) or positive, got {top_k}", param="top_k")
    seed = _field(body, "seed", int, None)
    n = _field(body, "n", int, 1)
    if n != 1:
        raise APIError("only n=1 is supported", param="n", code="unsupported")
    if _field(body, "echo", bool, False):
        raise APIError("'echo' is not supported", param="echo", code="unsupported")
    for name, neutral in NOT_IMPLEMENTED.items():
        if body.get(name) not in (None, neutral):
            raise APIError(f"'{name}' is not supported by this server (only {neutral!r})",
                           param=name, code="unsupported")
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise APIError("'stop' must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise APIError(f"'stop' takes at most {MAX_STOP} non-empty strings", param="stop")
    if kind == "chat":
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, None)
        if top is not None and not want:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if want else None
        pname = "top_logprobs"
    else:
        logprobs = _field(body, "logprobs", int, None)
        pname = "logprobs"
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"'{pname}' must be between 0 and {MAX_LOGPROBS}", param=pname)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                            top_k=max(top_k, 0), top_p=top_p, seed=seed,
                            logprobs=logprobs or 0)
    return params, stops, logprobs


def parse_prompt(body: dict, vocab_size: int, tokenizer) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a one-element list of either."""
    if "prompt" not in body:
        raise APIError("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError("this model has no tokenizer: send 'prompt' as token ids",
                           param="prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(f"token id {bad[0]} in 'prompt' is outside the vocabulary "
                           f"[0, {vocab_size})", param="prompt")
    elif isinstance(prompt, list):
        raise APIError("'prompt' must be a string or a list of token ids (one prompt per "
                       "request)", param="prompt")
    else:
        raise APIError(f"'prompt' must be a string or a list of token ids, got "
                       f"{type(prompt).__name__}", param="prompt")
    if not ids:
        raise APIError("'prompt' is empty", param="prompt")
    return list(ids)


def parse_messages(body: dict, tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(f"messages[{i}] must be an object", param="messages")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise APIError(f"messages[{i}] needs a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(f"messages[{i}].content parts must be text parts",
                               param="messages")
            m = dict(m, content="".join(p["text"] for p in content))
            messages[i] = m
        elif not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise APIError(f"messages[{i}].content must be a string", param="messages")
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot serve chat", code="unsupported")
    try:
        return tokenizer.encode_chat(messages)
    except Exception as e:  # the template refused this conversation
        raise APIError(f"chat template error: {e}", param="messages") from None


def parse_request(body: Any, kind: str, *, vocab_size: int, tokenizer, max_model_len: int,
                  served_names: tuple[str, ...]) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in served_names):
        raise APIError(f"the model {model!r} does not exist; this server serves "
                       f"{', '.join(served_names)}", status=404, code="model_not_found",
                       param="model")
    ids = parse_prompt(body, vocab_size, tokenizer) if kind == "completion" else \
        parse_messages(body, tokenizer)
    if len(ids) >= max_model_len:
        raise APIError(f"the prompt has {len(ids)} tokens; this model's maximum context length "
                       f"is {max_model_len} tokens", param="messages" if kind == "chat"
                       else "prompt", code="context_length_exceeded")
    room = max_model_len - len(ids)
    params, stops, logprobs = parse_sampling(body, 16 if kind == "completion" else None, room,
                                             kind)
    if params.max_tokens > room:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens; the "
                       f"prompt has {len(ids)} and max_tokens asks for {params.max_tokens}",
                       param="max_tokens", code="context_length_exceeded")
    stream = _field(body, "stream", bool, False)
    opts = _field(body, "stream_options", dict, {}) or {}
    include_usage = bool(opts.get("include_usage", False))
    return GenerationRequest(kind, ids, params, stream, include_usage, stops, logprobs,
                             model or served_names[0],
                             _field(body, "return_token_ids", bool, False))
