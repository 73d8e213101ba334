"""Generated tokens -> OpenAI text, logprobs and chunks, with stop strings.

`TextStream` detokenizes incrementally (never splitting a multi-byte character) and holds back
the tail that could still become a stop string, so streamed deltas joined equal the final text.
"""

from __future__ import annotations

import time
import uuid


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.decoder = tokenizer.incremental_decoder() if tokenizer is not None else None
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""      # all text so far (up to a stop string, once one is found)
        self.emitted = 0    # characters of `text` already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Adds a token; returns the text that is now safe to send."""
        if self.decoder is None or self.stopped:
            return ""
        self.text += self.decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        if self.decoder is not None and not self.stopped:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stops and not self.stopped:
            start = max(self.emitted - self.hold, 0)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
                final = True
        end = len(self.text) if final else max(len(self.text) - self.hold, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, events, offset0: int = 0) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    offset = offset0
    for ev in events:
        t = token_text(tokenizer, ev.token_id)
        tokens.append(t)
        lps.append(ev.logprob)
        tops.append({token_text(tokenizer, i): lp for i, lp in ev.top})
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, events) -> dict:
    def entry(tid: int, lp: float) -> dict:
        t = token_text(tokenizer, tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [dict(entry(ev.token_id, ev.logprob),
                             top_logprobs=[entry(i, lp) for i, lp in ev.top]) for ev in events]}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseBuilder:
    """Builds the JSON objects of one response (whole or streamed) in OpenAI's shapes."""

    def __init__(self, kind: str, model: str, id_: str | None = None,
                 created: int | None = None):
        """`id_` and `created`: a resumed stream's (server/resume.py); else new ones."""
        self.kind, self.model = kind, model
        new = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        self.id = id_ or new
        self.created = int(time.time()) if created is None else created
        self.object = "text_completion" if kind == "completion" else "chat.completion"

    def _base(self, chunk: bool) -> dict:
        obj = self.object + (".chunk" if chunk and self.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None, logprobs, chunk: bool,
               first: bool = False) -> dict:
        if self.kind == "completion":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if chunk:
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}

    def whole(self, text: str, finish_reason: str, logprobs, use: dict) -> dict:
        return dict(self._base(False), choices=[self.choice(text, finish_reason, logprobs, False)],
                    usage=use)

    def chunk(self, choice: dict | None, use: dict | None = None) -> dict:
        return dict(self._base(True), choices=[choice] if choice else [], usage=use)
