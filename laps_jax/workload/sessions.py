"""Multi-turn chat sessions: the workload LAPS is about.

A later turn re-sends the whole conversation, so its prompt is long but nearly all of it is
cached history; what matters to the scheduler is the *new* tokens. And a later turn cannot
arrive before the previous answer is done, so a session is not a list of timestamps but an
object a replayer walks: first-turn arrival, then a think time after each completed answer.

File format (one JSON object per line)::

    {"session_id": "s0", "turns": [
        {"arrival_s": 0.0, "new_input_tokens": 120, "output_tokens": 200},
        {"think_s": 4.2, "new_input_tokens": 35, "output_tokens": 150}]}

A session may open with a shared prefix, ``"prefix": {"id": "doc3", "tokens": 4000}``: its
first prompt is that document (the same tokens in every session naming the same id: a RAG
corpus, an agent's system prompt) and then the turn's new input. The first session of a trace
to name a prefix has to prefill it (``prefix_cold``); later ones find it cached.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from .records import (LengthSummary, Segment, TokenSpace, Trace, TraceFormatError,
                      TraceOptions, TraceRequest, iter_json_objects, parse_count,
                      require_field, segment_key, summarize)
from .sampling import keeps


@dataclasses.dataclass(frozen=True)
class Turn:
    """What the user adds and how long the answer is; ``think_s`` waits after the last answer."""

    new_input_tokens: int
    output_tokens: int
    think_s: float = 0.0  # unused for the first turn


def build_turn_prompt(prev_prompt_ids: Sequence[int] | None, answer_ids: Sequence[int] | None,
                      new_ids: Sequence[int]) -> list[int]:
    """Turn k's prompt: turn k-1's prompt, the answer it actually got, then the new input."""
    return [*(prev_prompt_ids or ()), *(answer_ids or ()), *new_ids]


@dataclasses.dataclass
class Session:
    """One conversation. Arrival of turn k > 0 = completion of turn k-1 + ``turns[k].think_s``."""

    session_id: str
    arrival_s: float
    turns: list[Turn]
    prefix_id: str = ""      # a shared prefix its first prompt opens with ("": none)
    prefix_tokens: int = 0
    prefix_cold: bool = dataclasses.field(default=False, compare=False)  # first to use it

    def _key(self, kind: str, k: int) -> int:
        return segment_key("session", self.session_id, kind, k)

    def _prefix_segments(self) -> list[Segment]:
        if not self.prefix_tokens:
            return []
        return [Segment(segment_key("session-prefix", self.prefix_id), self.prefix_tokens)]

    def prefix_ids(self, space: TokenSpace) -> list[int]:
        """The shared prefix's token ids (the same for every session naming it)."""
        return [int(t) for s in self._prefix_segments() for t in space.tokens(s.key, s.length)]

    def new_tokens(self, k: int) -> int:
        """Prompt tokens of turn k a warm prefix cache leaves to prefill: the new input, and
        for the first session to use a shared prefix, that prefix too."""
        cold = self.prefix_tokens if k == 0 and self.prefix_cold else 0
        return self.turns[k].new_input_tokens + cold

    def turn_arrival(self, k: int, prev_done_s: float | None = None) -> float:
        """When turn k arrives, given when turn k-1's answer finished (ignored for k = 0)."""
        if k == 0:
            return self.arrival_s
        if prev_done_s is None:
            raise ValueError("a later turn's arrival needs the previous turn's completion time")
        return prev_done_s + self.turns[k].think_s

    def new_input_ids(self, k: int, space: TokenSpace) -> list[int]:
        """The fresh user tokens of turn k (deterministic per session id, turn and seed)."""
        return space.tokens(self._key("in", k), self.turns[k].new_input_tokens).tolist()

    def nominal_answer_ids(self, k: int, space: TokenSpace) -> list[int]:
        """Stand-in answer of turn k (``output_tokens`` long) for open-loop replays."""
        return space.tokens(self._key("out", k), self.turns[k].output_tokens).tolist()

    def prompt_ids(self, k: int, space: TokenSpace, prev_prompt_ids: Sequence[int] | None = None,
                   answer_ids: Sequence[int] | None = None) -> list[int]:
        """Turn k's prompt from turn k-1's prompt and the answer ids actually produced."""
        if k > 0 and prev_prompt_ids is None:
            raise ValueError("a later turn's prompt needs the previous prompt ids")
        if k == 0:
            prev_prompt_ids = self.prefix_ids(space)
        return build_turn_prompt(prev_prompt_ids, answer_ids if k else None,
                                 self.new_input_ids(k, space))

    def nominal_segments(self, k: int) -> tuple[Segment, ...]:
        """Turn k's prompt as if every earlier answer had its nominal length."""
        segs: list[Segment] = self._prefix_segments()
        for j in range(k):
            segs += [Segment(self._key("in", j), self.turns[j].new_input_tokens),
                     Segment(self._key("out", j), self.turns[j].output_tokens)]
        segs.append(Segment(self._key("in", k), self.turns[k].new_input_tokens))
        return tuple(segs)

    def nominal_prompt_len(self, k: int) -> int:
        return sum(s.length for s in self.nominal_segments(k))

    def request(self, k: int, arrival_s: float, space: TokenSpace,
                prompt_ids: list[int] | None = None) -> TraceRequest:
        """A request for turn k; with ``prompt_ids`` (closed loop) it sends exactly those."""
        segs = self.nominal_segments(k)
        input_len = len(prompt_ids) if prompt_ids is not None else sum(s.length for s in segs)
        return TraceRequest(f"{self.session_id}/{k}", arrival_s, input_len,
                            self.turns[k].output_tokens, segs, session_id=self.session_id,
                            turn=k, history_len=input_len - self.new_tokens(k),
                            prompt_ids=prompt_ids, token_space=space)

    def to_json(self) -> dict[str, Any]:
        turns: list[dict[str, Any]] = []
        for k, t in enumerate(self.turns):
            first = {"arrival_s": self.arrival_s} if k == 0 else {"think_s": t.think_s}
            turns.append({**first, "new_input_tokens": t.new_input_tokens,
                          "output_tokens": t.output_tokens})
        out: dict[str, Any] = {"session_id": self.session_id, "turns": turns}
        if self.prefix_tokens:
            out["prefix"] = {"id": self.prefix_id, "tokens": self.prefix_tokens}
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], path: str = "<session>", line: int = 0) -> "Session":
        """Parse one file line; every problem raises ``TraceFormatError`` naming the line."""
        sid = require_field(obj, "session_id", path, line)
        if not isinstance(sid, str) or not sid:
            raise TraceFormatError(path, line, f"session_id must be a non-empty string, "
                                               f"got {sid!r}")
        raw = require_field(obj, "turns", path, line)
        if not isinstance(raw, list) or not raw:
            raise TraceFormatError(path, line, "turns must be a non-empty list")
        turns, arrival = [], 0.0
        for k, t in enumerate(raw):
            where = f"turn {k} of session {sid!r}"
            if not isinstance(t, dict):
                raise TraceFormatError(path, line, f"{where} is not a JSON object")
            name = "arrival_s" if k == 0 else "think_s"
            if name not in t:
                raise TraceFormatError(path, line, f"{where}: missing field {name!r}")
            secs = t[name]
            if isinstance(secs, bool) or not isinstance(secs, (int, float)) \
                    or not math.isfinite(secs) or secs < 0:
                raise TraceFormatError(path, line, f"{where}: {name} must be a number >= 0, "
                                                   f"got {secs!r}")
            counts = []
            for field in ("new_input_tokens", "output_tokens"):
                if field not in t:
                    raise TraceFormatError(path, line, f"{where}: missing field {field!r}")
                counts.append(parse_count(t[field], f"{where}: {field}", path, line))
            if k == 0:
                arrival = float(secs)
            turns.append(Turn(counts[0], counts[1], 0.0 if k == 0 else float(secs)))
        prefix = obj.get("prefix")
        if prefix is None:
            return cls(sid, arrival, turns)
        if not isinstance(prefix, dict) or not isinstance(prefix.get("id"), str) \
                or not prefix["id"] or "tokens" not in prefix:
            raise TraceFormatError(path, line, f"prefix of session {sid!r} must be "
                                               f'{{"id": non-empty string, "tokens": count}}')
        n = parse_count(prefix["tokens"], f"prefix tokens of session {sid!r}", path, line)
        return cls(sid, arrival, turns, prefix["id"], n)


@dataclasses.dataclass
class SessionTrace:
    """Sessions in first-arrival order, the token space their prompts use, and reader notes."""

    source: str
    sessions: list[Session]
    token_space: TokenSpace = dataclasses.field(default_factory=TokenSpace)
    notes: list[str] = dataclasses.field(default_factory=list)
    truncated: int = 0
    dropped_turns: int = 0

    def __post_init__(self) -> None:
        mark_cold_prefixes(self.sessions)

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def summary(self, threshold: int = 256) -> dict[str, LengthSummary]:
        return session_summary(self.sessions, threshold)


def mark_cold_prefixes(sessions: Iterable[Session]) -> None:
    """Sets ``prefix_cold`` on the earliest-arriving session of each shared prefix."""
    seen: set[str] = set()
    for s in sorted(sessions, key=lambda s: s.arrival_s):
        s.prefix_cold = bool(s.prefix_tokens) and s.prefix_id not in seen
        seen.add(s.prefix_id)


def session_summary(sessions: Iterable[Session], threshold: int = 256) -> dict[str, LengthSummary]:
    """First-turn prompts, later-turn new inputs, outputs and turns per session."""
    sessions = list(sessions)
    return {
        "first_turn_input": summarize([s.turns[0].new_input_tokens for s in sessions], threshold),
        "later_turn_new_input": summarize(
            [t.new_input_tokens for s in sessions for t in s.turns[1:]], threshold),
        "output": summarize([t.output_tokens for s in sessions for t in s.turns], threshold),
        "turns_per_session": summarize([len(s.turns) for s in sessions], threshold),
    }


def _apply_options(s: Session, opts: TraceOptions, budget: int | None) -> tuple[Session, int, int]:
    """Scale lengths and times, cap turns at ``budget``; cut to ``max_len`` (see TraceOptions)."""
    prefix = opts.scale_len(s.prefix_tokens) if s.prefix_tokens else 0
    if opts.max_len is not None:
        prefix = min(prefix, opts.max_len // 2)
    turns, history, truncated, dropped = [], prefix, 0, 0
    for k, t in enumerate(s.turns):
        if budget is not None and len(turns) >= budget:
            break
        n_in, n_out = opts.scale_len(t.new_input_tokens), opts.scale_len(t.output_tokens)
        if opts.max_len is not None and history + n_in + n_out > opts.max_len:
            if k > 0:  # the conversation no longer fits the context: it ends here
                dropped = len(s.turns) - k
                break
            n_in, n_out, _ = opts.fit(n_in, n_out)
            truncated = 1
        turns.append(Turn(n_in, n_out, t.think_s * opts.time_scale))
        history += n_in + n_out
    return (Session(s.session_id, s.arrival_s * opts.time_scale, turns, s.prefix_id, prefix),
            truncated, dropped)


def read_sessions_jsonl(path: str | os.PathLike[str],
                        opts: TraceOptions | None = None) -> SessionTrace:
    """Sessions JSONL; ``max_requests`` counts turns, ``max_len`` ends sessions that outgrow it,
    ``sample`` keeps that fraction of the sessions.

    Arrivals are kept as written (already seconds from the replay's start), times scaled.
    """
    opts, path = opts or TraceOptions(), os.fspath(path)
    sessions: list[Session] = []
    seen: dict[str, int] = {}
    n_requests = truncated = dropped = n_read = 0
    for line, obj in iter_json_objects(path):
        if opts.max_requests is not None and n_requests >= opts.max_requests:
            break
        s = Session.from_json(obj, path, line)
        if s.session_id in seen:
            raise TraceFormatError(path, line, f"session_id {s.session_id!r} already used on "
                                               f"line {seen[s.session_id]}")
        seen[s.session_id] = line
        n_read += 1
        if not keeps(s.session_id, opts.sample, opts.seed):
            continue
        budget = None if opts.max_requests is None else opts.max_requests - n_requests
        s, cut, gone = _apply_options(s, opts, budget)
        sessions.append(s)
        n_requests += len(s.turns)
        truncated, dropped = truncated + cut, dropped + gone
    sessions.sort(key=lambda s: s.arrival_s)
    notes = []
    if opts.sample < 1:
        notes.append(f"sample {opts.sample:g}: kept {len(sessions)} of the {n_read} sessions read")
    if truncated:
        notes.append(f"{truncated} first turns cut to max_len={opts.max_len}")
    if dropped:
        notes.append(f"{dropped} later turns dropped: their prompt + output would exceed "
                     f"max_len={opts.max_len}")
    return SessionTrace(path, sessions, opts.token_space, notes, truncated, dropped)


def write_sessions_jsonl(sessions: Iterable[Session], path: str | os.PathLike[str]) -> int:
    """Write one session per line; returns the number of sessions written."""
    n = 0
    with open(path, "w") as f:
        for s in sessions:
            f.write(json.dumps(s.to_json(), separators=(",", ":")) + "\n")
            n += 1
    return n


def flatten_sessions(trace: SessionTrace, response_s: float = 0.0) -> Trace:
    """Open-loop view: every turn as a request, answers assumed nominal and ``response_s`` long.

    For simulators and length statistics; a real replay should walk the sessions instead,
    since turn k+1 then waits for the answer turn k actually got.
    """
    requests = []
    for s in trace.sessions:
        t = s.arrival_s
        for k, turn in enumerate(s.turns):
            if k:
                t += response_s + turn.think_s
            requests.append(s.request(k, t, trace.token_space))
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(trace.source, requests, list(trace.notes), trace.truncated)
