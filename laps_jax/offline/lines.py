"""Input lines of the offline job: each into token ids or the reason it cannot run, and where an
interrupted run's output leaves off (`--resume`).

Nothing in a line (bytes, nesting, numbers, fields) can fail more than that line: every problem
becomes that line's error, in the words the HTTP server would use for the same prompt.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from laps_jax.engine.engine import Engine
from laps_jax.engine.sequence import Sequence
from laps_jax.text.prompts import parse_messages, parse_prompt


@dataclasses.dataclass
class JobItem:
    line_no: int
    id: Any
    prompt: list[int] | None = None
    error: str | None = None
    seq: Sequence | None = None
    prompt_lps: list[float] | None = None  # log p(token t | < t) for t >= 1
    result: dict | None = None


def parse_line(line_no: int, raw: bytes | str, tokenizer, engine: Engine) -> JobItem:
    """One input line -> a JobItem holding token ids or the reason it cannot run."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        return JobItem(line_no, None, error=f"line {line_no}: not valid UTF-8 (byte "
                                            f"{e.start}: {e.reason})")
    if not text.strip():
        return JobItem(line_no, None, error=f"line {line_no}: blank line (expected a JSON "
                                            "object)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return JobItem(line_no, None, error=f"line {line_no}: invalid JSON ({e.msg})")
    except RecursionError:
        return JobItem(line_no, None, error=f"line {line_no}: JSON nested too deeply")
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        return JobItem(line_no, None, error=f"line {line_no}: invalid JSON ({e})")
    if not isinstance(obj, dict):
        return JobItem(line_no, None, error=f"line {line_no}: expected a JSON object")
    item = JobItem(line_no, obj.get("id", line_no))
    try:  # the HTTP server's own parser: the same input is refused alike, same message
        item.prompt = list(_prompt_ids(obj, tokenizer, engine))
    except Exception as e:  # every problem stays on its own line (a PromptError: its message)
        item.error = f"line {line_no}: {e}"
    if item.error is not None and not _json_safe(item.id):
        item.id = None
    return item


def _prompt_ids(obj: dict, tokenizer, engine: Engine) -> list[int]:
    limit, vocab = engine.ecfg.max_model_len, engine.cfg.vocab_size
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = parse_prompt({"prompt": ids}, vocab, tokenizer, limit + 1)
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError("prompt must be a string (token ids go in prompt_token_ids)")
        ids = parse_prompt(obj, vocab, tokenizer, limit + 1)
    elif "messages" in obj:
        ids = parse_messages(obj, tokenizer, limit + 1)
    else:
        raise ValueError("expected one of prompt, prompt_token_ids or messages")
    engine.check_prompt(ids)
    return ids


def _json_safe(value) -> bool:
    """An id we can write back (a huge or deep one from a broken line is dropped)."""
    try:
        json.dumps(value)
        return True
    except (ValueError, RecursionError, TypeError):
        return False


def strip_eol(raw: bytes | str):
    return raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw.rstrip("\r\n")


def _line_id(line_no: int, raw: bytes):
    """The id parse_line gives a line, without tokenizing it (None for a broken line)."""
    try:
        obj = json.loads(strip_eol(raw).decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return obj.get("id", line_no) if isinstance(obj, dict) else None


def resume_point(written: list[bytes], inputs: list[bytes]) -> int:
    """How many input lines an earlier run's output already answers: its complete lines, each
    checked to carry the id of the input line at its place (a cut-off last line is dropped).
    Raises ValueError when the output is not an earlier run of this input."""
    n = 0
    for k, raw in enumerate(written):
        if not raw.endswith(b"\n"):
            break  # an interrupted write
        try:
            row = json.loads(raw)
        except ValueError:
            raise ValueError(f"--resume: output line {k + 1} is not JSON") from None
        want = _line_id(k + 1, inputs[k]) if k < len(inputs) else None
        if k >= len(inputs) or not isinstance(row, dict) or row.get("id") != want:
            got = row.get("id") if isinstance(row, dict) else row
            raise ValueError(f"--resume: output line {k + 1} (id {got!r}) does not "
                             f"answer input line {k + 1}; is this the output of this input?")
        n += 1
    return n
