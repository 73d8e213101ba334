"""Checks of a decode leg's `X-Laps-PD-Handoff` header, field by field, before anything is
spent on it.

The header comes from a prefill instance through the router; it is still input. Token ids
outside the vocabulary broke the detokenizer mid-stream (a 500, or a dropped stream); a page
count beyond the pool, or a shape or dtype this engine does not hold, would reserve pages or
a pull thread for nothing. Each is a 400 `invalid_handoff` here, before the body is parsed.
"""

from __future__ import annotations

import dataclasses
import json
import math

from laps_jax.engine.sequence import TokenLogprobs
from laps_jax.server.protocol import APIError

# The split's wire names, one copy for both sides and the router (cluster/pd_router.py)
PD_HEADER = "X-Laps-PD"                # "prefill" or "decode": which leg (pd.py)
HANDOFF_HEADER = "X-Laps-PD-Handoff"
RELEASE_HEADER = "X-Laps-PD-Release"   # the prefill instance's base URL (the router's word)
MAX_HEADER = 8000  # bytes of a descriptor: a genuine one is a few hundred, ~1,500 with 20 top
                   # logprobs; under aiohttp's 8,190 per header field, so the router's cap on
                   # the prefill leg's answer and this side's check are the same number
MAX_TOP = 20           # OpenAI's top_logprobs cap
REASONS = (None, "stop", "length")


@dataclasses.dataclass
class Handoff:
    offer: object | None   # engine/kv_remote.py's Offer (None: the first token ended it)
    first: TokenLogprobs
    finish_reason: str | None


def _bad(why: str) -> APIError:
    return APIError(f"bad {HANDOFF_HEADER} header: {why}", code="invalid_handoff")


def _token(x, vocab_size: int, what: str) -> int:
    if type(x) is not int or not 0 <= x < vocab_size:
        raise _bad(f"{what} {x!r} is not a token id of this model (0..{vocab_size - 1})")
    return x


def _logprob(x, what: str) -> float:
    if type(x) not in (int, float) or not math.isfinite(x) or x > 0:
        raise _bad(f"{what} {x!r} is not a log-probability")
    return float(x)


def _first(f, vocab_size: int) -> TokenLogprobs:
    if not isinstance(f, dict):
        raise _bad("'first' must be an object")
    top = f.get("top") or []
    if not isinstance(top, list) or len(top) > MAX_TOP:
        raise _bad(f"'first.top' must be a list of at most {MAX_TOP} pairs")
    pairs = []
    for p in top:
        if not isinstance(p, list) or len(p) != 2:
            raise _bad("'first.top' entries are [token_id, logprob] pairs")
        pairs.append((_token(p[0], vocab_size, "first.top token_id"),
                      _logprob(p[1], "first.top logprob")))
    return TokenLogprobs(_token(f.get("token_id"), vocab_size, "first.token_id"),
                         _logprob(f.get("logprob"), "first.logprob"), pairs)


def read_handoff(raw: str, vocab_size: int) -> Handoff:
    """The header's hand-off, every field checked (no engine needed yet)."""
    from laps_jax.engine.kv_remote import Offer
    if not raw or len(raw) > MAX_HEADER:
        raise _bad("missing" if not raw else f"too long (over {MAX_HEADER} bytes)")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise _bad("not a JSON object")
    first = _first(d.get("first"), vocab_size)
    reason = d.get("finish_reason")
    if reason not in REASONS:
        raise _bad(f"finish_reason {reason!r} is not one of {REASONS}")
    offer = None
    if d.get("handoff") is not None:
        if not isinstance(d["handoff"], dict):
            raise _bad("'handoff' must be an object")
        try:
            offer = Offer.from_json(d["handoff"])
        except ValueError as e:
            raise _bad(str(e)) from None
    elif reason is None:
        raise _bad("no handoff and no finish_reason")
    return Handoff(offer, first, reason)


def check_offer(offer, engine) -> None:
    """The offer against this engine: page and token counts, the array shape and dtype."""
    from laps_jax.engine.kv_remote import expected_shape
    kv = engine.kv
    if offer.num_pages != kv.pages_for(offer.num_tokens):
        raise _bad(f"{offer.num_tokens} tokens fill {kv.pages_for(offer.num_tokens)} pages, "
                   f"not {offer.num_pages}")
    if offer.num_tokens > engine.ecfg.max_model_len or offer.num_pages > kv.num_pages - 1:
        raise _bad(f"{offer.num_tokens} tokens is more than this instance holds")
    want, dtype = expected_shape(engine, offer.num_pages)
    if offer.shape != want or offer.dtype != dtype:
        raise _bad(f"the offered K/V is {offer.dtype}{offer.shape}, this engine holds "
                   f"{dtype}{want}: both instances need the same model, --dtype, --page-size "
                   f"and --max-model-len")


__all__ = ["HANDOFF_HEADER", "Handoff", "check_offer", "read_handoff"]
