"""OpenAI request validation: JSON bodies -> a `GenerationRequest`, or an `APIError` (4xx).

Every check names the field at fault, so a client sees what to fix; nothing here touches the
engine, so a rejected request changes nothing. Numbers are range-checked in their own type
before any conversion (a 401-digit temperature is out of range, not an OverflowError) and to
ranges the executables can hold (int32 top-k, float32 top-p, a uint64-sized seed); text must be
valid Unicode (no lone surrogates). Prompts and messages are read by text/prompts.py, the parser
the offline job uses too; its `PromptError` is answered here as a 400 `APIError`. This runs on
a worker thread (app.py): a large prompt tokenizes without holding up the event loop.

A `top_p` under `TOP_P_FLOOR` (1e-6) keeps only the likeliest token of any vocabulary, so it is
served as greedy sampling (temperature 0) rather than refused.

`laps_resume` (an extension the router sets when it resumes a stream whose instance failed,
cluster/failover.py) carries the token ids the client already has and the response's id: they
are appended to the prompt and taken off max_tokens, checked as a prompt's ids are.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from laps_jax.engine.sequence import TOP_P_FLOOR, SamplingParams
from laps_jax.text import prompts
from laps_jax.text.prompts import PromptError

MAX_STOP = 4
MAX_LOGPROBS = 20
RESUME_ID = re.compile(r"(chat)?cmpl-[A-Za-z0-9]{1,64}")  # a response id, as output.py makes them
CREATED_LIMIT = 1 << 40
SEED_LIMIT = 2 ** 63  # seeds are in [0, 2**63): what numpy's generators take, and int64 holds
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
class Resume:
    """A stream resumed here after its instance failed: what the client already got."""

    token_ids: list[int]  # generated before the failure: the prompt's continuation
    id: str               # the response's id and creation time, kept for the client
    created: int


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
    resume: Resume | None = None   # extension `laps_resume`: prompt_ids end with its token ids

    @property
    def prompt_tokens(self) -> int:
        """The client's prompt (without the tokens a resumed stream already generated)."""
        return len(self.prompt_ids) - (len(self.resume.token_ids) if self.resume else 0)


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


def _show(value: Any) -> str:
    """A value for an error message, cut short (a client's 400-digit number need not come back)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False
            ) -> float:
    """A number in [lo, hi] (or (lo, hi]), compared before it becomes a float."""
    value = _field(body, name, (int, float), default)
    ok = (lo < value if lo_open else lo <= value) and value <= hi  # NaN fails both
    if not ok:
        span = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise APIError(f"'{name}' must be in {span}, got {_show(value)}", param=name)
    return float(value)


def _type_name(types) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "a list", dict: "an object"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def parse_sampling(body: dict, default_max_tokens: int | None, max_tokens_limit: int,
                   kind: str, vocab_size: int) -> tuple[SamplingParams, list[str], int | None]:
    max_tokens = _field(body, "max_completion_tokens", int, None)
    max_tokens = _field(body, "max_tokens", int, max_tokens)
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_tokens_limit
    if max_tokens <= 0:
        raise APIError(f"'max_tokens' must be at least 1, got {_show(max_tokens)}",
                       param="max_tokens")
    temperature = _number(body, "temperature", 1.0, 0, 2)
    top_p = _number(body, "top_p", 1.0, 0, 1, lo_open=True)
    if top_p < TOP_P_FLOOR:  # keeps one token whatever the distribution: greedy
        temperature, top_p = 0.0, 1.0
    top_k = _field(body, "top_k", int, 0)
    if not -1 <= top_k <= vocab_size:
        raise APIError(f"'top_k' must be -1 or 0 (no limit) or at most the vocabulary size "
                       f"{vocab_size}, got {_show(top_k)}", param="top_k")
    seed = _field(body, "seed", int, None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise APIError(f"'seed' must be in [0, 2**63), got {_show(seed)}", param="seed")
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
        stops = [_text(stop, "stop")]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = [_text(s, "stop") for s in stop]
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


def _as_api_error(parse):
    """`parse` (text/prompts.py, shared with the offline job) with its `PromptError` answered
    as this server's 400: the same message, field and code."""
    @functools.wraps(parse)
    def wrapped(*args, **kwargs):
        try:
            return parse(*args, **kwargs)
        except PromptError as e:
            raise APIError(e.message, code=e.code, param=e.param) from None
    return wrapped


parse_prompt = _as_api_error(prompts.parse_prompt)
parse_messages = _as_api_error(prompts.parse_messages)
_text = _as_api_error(prompts.check_text)


def parse_request(body: Any, kind: str, *, vocab_size: int, tokenizer, max_model_len: int,
                  served_names: tuple[str, ...]) -> GenerationRequest:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = _field(body, "model", str, None)
    if model is not None and model not in served_names:
        raise APIError(f"the model {_show(model)} does not exist; this server serves "
                       f"{', '.join(served_names)}", status=404, code="model_not_found",
                       param="model")
    ids = parse_prompt(body, vocab_size, tokenizer, max_model_len) if kind == "completion" \
        else parse_messages(body, tokenizer, max_model_len)
    if len(ids) >= max_model_len:
        raise APIError(f"the prompt has {len(ids)} tokens; this model's maximum context length "
                       f"is {max_model_len} tokens", param="messages" if kind == "chat"
                       else "prompt", code="context_length_exceeded")
    room = max_model_len - len(ids)
    params, stops, logprobs = parse_sampling(body, 16 if kind == "completion" else None, room,
                                             kind, vocab_size)
    if params.max_tokens > room:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens; the "
                       f"prompt has {len(ids)} and max_tokens asks for {params.max_tokens}",
                       param="max_tokens", code="context_length_exceeded")
    stream = _field(body, "stream", bool, False)
    opts = _field(body, "stream_options", dict, {}) or {}
    include_usage = opts.get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise APIError(f"'stream_options.include_usage' must be a boolean, got "
                       f"{type(include_usage).__name__}", param="stream_options.include_usage")
    resume = _resume(body, kind, vocab_size, params.max_tokens, stream)
    if resume is not None:
        ids = ids + resume.token_ids
        params.max_tokens -= len(resume.token_ids)
    return GenerationRequest(kind, ids, params, stream, include_usage, stops, logprobs,
                             model or served_names[0],
                             _field(body, "return_token_ids", bool, False), resume)


def _resume(body: dict, kind: str, vocab_size: int, max_tokens: int, stream: bool
            ) -> Resume | None:
    """`laps_resume`: {"token_ids": at most max_tokens ids in the vocabulary, "id": a response
    id of this kind, "created": a time}, on streams only (the router resumes those)."""
    r = body.get("laps_resume")
    if r is None:
        return None
    if not stream:
        raise APIError("'laps_resume' needs 'stream': true", param="laps_resume")
    if not isinstance(r, dict) or set(r) != {"token_ids", "id", "created"}:
        raise APIError("'laps_resume' must be an object of 'token_ids', 'id' and 'created'",
                       param="laps_resume")
    ids, rid, created = r["token_ids"], r["id"], r["created"]
    if not (isinstance(ids, list) and len(ids) <= max_tokens and all(
            type(t) is int and 0 <= t < vocab_size for t in ids)):
        raise APIError(f"'laps_resume.token_ids' must be at most max_tokens ({max_tokens}) "
                       f"token ids in [0, {vocab_size})", param="laps_resume.token_ids")
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    if not (isinstance(rid, str) and RESUME_ID.fullmatch(rid) and rid.startswith(prefix)):
        raise APIError(f"'laps_resume.id' must be a response id '{prefix}...', got "
                       f"{_show(rid)}", param="laps_resume.id")
    if not (type(created) is int and 0 <= created < CREATED_LIMIT):
        raise APIError("'laps_resume.created' must be a time in seconds",
                       param="laps_resume.created")
    return Resume(list(ids), rid, created)
