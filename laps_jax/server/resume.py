"""Streams the router can resume elsewhere (its failover: cluster/failover.py).

- `TOKEN_IDS_HEADER: 1` on a streamed request: each generated token's id goes out as an SSE
  comment line, `: id N`, at the head of the event that carries its text (or alone, when the
  token released no text yet). Clients ignore comment lines; the router reads and drops them,
  and so knows exactly which tokens the client has.
- A request with `laps_resume` (protocol.py) continues such a stream: the tokens the client
  has are its prompt's tail, its text is replayed through a fresh `TextStream` (so the
  detokenizer, the text held back for stop strings and the logprobs' offsets are where the
  first instance left them), its chunks carry the first response's id, and its usage counts
  the client's prompt and every generated token. `ended` answers a resumed request that has
  nothing left to generate (its last token ended it, or max_tokens is spent) without the engine.
"""

from __future__ import annotations

import dataclasses

from laps_jax.server.output import TextStream
from laps_jax.server.protocol import GenerationRequest

TOKEN_IDS_HEADER = "X-Laps-Token-Ids"


def id_line(token_id: int) -> bytes:
    return b": id %d\n" % token_id


def replay(text: TextStream, req: GenerationRequest) -> int:
    """Pushes a resumed request's earlier tokens through `text`; returns how many."""
    done = req.resume.token_ids if req.resume is not None else []
    for t in done:
        text.push(t)
    return len(done)


@dataclasses.dataclass
class _Stats:
    finish_reason: str
    cached_tokens: int = 0


class Ended:
    """The handle of a resumed request that generates nothing: no events, its finish reason."""

    finished, error = False, None

    def __init__(self, reason: str):
        self.stats = _Stats(reason)

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise StopAsyncIteration

    async def result(self) -> _Stats:
        return self.stats

    def abort(self) -> None:
        pass


def ended(req: GenerationRequest, tokenizer, max_model_len: int) -> Ended | None:
    """A handle for a resumed request whose earlier tokens already ended it, else None: the
    first instance failed between its last token and the stream's end."""
    if req.resume is None or not req.resume.token_ids:
        return None
    if req.params.max_tokens == 0 or len(req.prompt_ids) >= max_model_len:
        return Ended("length")
    eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    if not req.params.ignore_eos and req.resume.token_ids[-1] in eos:
        return Ended("stop")
    text = TextStream(tokenizer, req.stop)
    replay(text, req)
    return Ended("stop") if text.stopped else None
