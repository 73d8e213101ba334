"""What a simulation replays: a public trace (open loop) or multi-turn chat sessions (closed loop).

Prompts are built only when a request is submitted and dropped when it finishes: a Mooncake
replay would otherwise hold hundreds of millions of token ids. The *rate* of a run is set by
scaling arrival times (traces, session files) or by generating sessions at that rate (the
LMSYS-like generator), so think times stay what the workload says they are.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from laps_jax.workload.family import MEMBERS
from laps_jax.workload.generator import SessionGenConfig, generate_sessions
from laps_jax.workload.records import (TokenSpace, TraceOptions, TraceRequest,
                                       implied_new_tokens)
from laps_jax.workload.load import load as load_trace
from laps_jax.workload.sessions import SessionTrace

KINDS = ("azure", "mooncake", "sessions", "lmsys") + tuple(MEMBERS)  # + the trace family


@dataclasses.dataclass
class OpenItem:
    """One open-loop request: its recorded arrival and what a warm prefix cache leaves to do."""

    trace: TraceRequest
    new_tokens: int   # implied by the trace (Mooncake blocks seen before count as cached)

    @property
    def arrival_s(self) -> float:
        return self.trace.arrival_s


@dataclasses.dataclass
class Workload:
    """Requests (open loop) or sessions (closed loop), plus how to put them at a given rate."""

    name: str
    kind: str
    items: list[OpenItem] = dataclasses.field(default_factory=list)
    sessions: SessionTrace | None = None
    gen: tuple[int, SessionGenConfig, int, int] | None = None  # (sessions, config, seed, max_len)
    gen_name: tuple[str, str] = ("lmsys-sessions", "lmsys")  # (name, kind) of generated ones

    @property
    def closed_loop(self) -> bool:
        return self.sessions is not None

    @property
    def num_requests(self) -> int:
        return self.sessions.num_requests if self.sessions else len(self.items)

    def new_token_counts(self) -> np.ndarray:
        """New tokens per request if every cacheable prefix were cached (session answers too)."""
        if self.sessions:
            return np.array([s.new_tokens(k) for s in self.sessions.sessions
                             for k in range(len(s.turns))])
        return np.array([it.new_tokens for it in self.items])

    def natural_rate(self) -> float:
        """Requests per second as recorded (sessions: turns over the span of session starts)."""
        if self.sessions:
            starts = [s.arrival_s for s in self.sessions.sessions]
            span = max(starts) - min(starts) if len(starts) > 1 else 0.0
            return self.num_requests / span if span > 0 else float("inf")
        t = [it.arrival_s for it in self.items]
        span = t[-1] - t[0] if len(t) > 1 else 0.0
        return (len(t) - 1) / span if span > 0 else float("inf")

    def at_rate(self, rate: float | None) -> tuple[Workload, float]:
        """(workload, time scale) that offers `rate` requests/s (None: as recorded)."""
        if rate is None:
            return self, 1.0
        if self.gen is not None:
            n, cfg, seed, max_len = self.gen
            return lmsys(n, rate, seed, cfg, self.sessions.token_space, max_len,
                         self.gen_name), 1.0
        return self, self.natural_rate() / rate

    def shared_prefixes(self) -> list[list[int]]:
        """Token ids of each shared prefix the sessions open with (a RAG corpus, a system
        prompt): a simulation starts with them cached, as a deployment serving them would."""
        if not self.sessions:
            return []
        first = {s.prefix_id: s for s in self.sessions.sessions if s.prefix_tokens}
        return [s.prefix_ids(self.sessions.token_space) for s in first.values()]

    def summary(self) -> dict:
        new = self.new_token_counts()
        return {"name": self.name, "kind": self.kind, "requests": self.num_requests,
                "natural_rate_rps": self.natural_rate(),
                "new_tokens_mean": float(new.mean()) if len(new) else 0.0,
                "new_tokens_p50": float(np.median(new)) if len(new) else 0.0,
                "short_fraction_256": float((new <= 256).mean()) if len(new) else 0.0}




def load(kind: str, path: str | None = None, max_requests: int | None = None,
         length_scale: float = 1.0, max_len: int = 32768, vocab_size: int = 151643,
         seed: int = 0, rate: float = 1.0, sample: float = 1.0) -> Workload:
    """A workload by kind: azure/mooncake/sessions read `path` (with `workload.load`, the
    reader every replayer uses; `sample` keeps that fraction of its conversations); lmsys
    generates sessions (`max_requests` turns in all, about) at `rate` requests/s."""
    if kind not in KINDS:
        raise ValueError(f"workload kind must be one of {', '.join(KINDS)}, got {kind!r}")
    opts = TraceOptions(max_requests=max_requests, length_scale=length_scale,
                        vocab_size=vocab_size, max_len=max_len, seed=seed, sample=sample)
    if kind == "lmsys" or kind in MEMBERS:  # generated: a family member has its own seed
        cfg, name = SessionGenConfig(length_scale=length_scale), ("lmsys-sessions", "lmsys")
        if kind in MEMBERS:
            m = MEMBERS[kind]
            cfg, seed, name = (dataclasses.replace(m.config, length_scale=length_scale),
                               m.seed + seed, (kind, kind))
        n = max(1, round((max_requests or 300) / cfg.mean_turns))
        return lmsys(n, rate, seed, cfg, TokenSpace(vocab_size, 10, seed), max_len, name)
    if path is None:
        raise ValueError(f"workload {kind} needs a file")
    name = os.path.basename(path)
    trace = load_trace(kind, path, opts)
    if isinstance(trace, SessionTrace):
        return Workload(name, kind, sessions=trace)
    new = implied_new_tokens(trace.requests)
    return Workload(name, kind, [OpenItem(r, n) for r, n in zip(trace.requests, new)])


def lmsys(n_sessions: int, rate: float, seed: int = 0, cfg: SessionGenConfig | None = None,
          space: TokenSpace | None = None, max_len: int = 32768,
          name: tuple[str, str] = ("lmsys-sessions", "lmsys")) -> Workload:
    """Generated sessions (LMSYS-Chat-1M-shaped by default, or a family member's `cfg`)
    offering about `rate` requests/s (sessions start at rate / mean turns per second; the same
    seed gives the same lengths at every rate)."""
    cfg = cfg or SessionGenConfig()
    cfg = dataclasses.replace(cfg, rate=rate / cfg.mean_turns)
    sessions = generate_sessions(n_sessions, cfg, seed)
    for s in sessions:  # a conversation ends when it would outgrow the context
        total, keep = s.prefix_tokens, []
        for t in s.turns:
            total += t.new_input_tokens + t.output_tokens
            if total > max_len and keep:
                break
            keep.append(t)
        s.turns = keep
    trace = SessionTrace(f"{name[1]}-generated", sessions, space or TokenSpace())
    for s in sessions:  # the simulator starts with the shared prefixes cached (`simulate`)
        s.prefix_cold = False
    return Workload(name[0], name[1], sessions=trace,
                    gen=(n_sessions, dataclasses.replace(cfg, rate=1.0), seed, max_len),
                    gen_name=name)
