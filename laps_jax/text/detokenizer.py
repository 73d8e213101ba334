"""Incremental detokenization: token ids in, complete text out (never half a character)."""

from __future__ import annotations

from typing import Iterable, Protocol


class RawDecode(Protocol):
    """What the decoder needs of a tokenizer (text.tokenizer.Tokenizer is one): its decode
    without clean-up, so this module needs nothing from tokenizer.py, which imports it."""

    def decode_raw(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text, emitting text only once it is complete.

    Byte-level BPE splits multi-byte UTF-8 characters (emoji, CJK) across tokens; decoding a partial
    character yields U+FFFD, so text ending in U+FFFD is held back until the next token completes it.
    Each step decodes a small window (the tokens of the previous emission plus the new ones) and emits
    what the new tokens added, so decoders with context effects (SentencePiece's leading space) stay
    right. ``"".join(pushes) + flush() == tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: RawDecode, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens before this have been emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode_raw(ids, self.skip_special_tokens)

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
