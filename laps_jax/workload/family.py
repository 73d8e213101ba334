"""A named family of generated traces: the workloads a scheduler's defaults are screened on.

Each member is a `SessionGenConfig` (generator.py) and a seed: chat shaped like LMSYS-Chat-1M,
code assistance (long prompts, short outputs), RAG (long documents shared by many sessions)
and agent loops (many short turns), each with bursts, length tails, think times, follow-up
shares and prefix reuse set apart. Write one as sessions JSONL with
`scripts/make_sessions.py --member NAME`; the simulator generates them by name
(`simulate.py run --workload NAME`).

Where the numbers come from (nothing else here is fitted to a trace; the rest are choices that
span the space, named as such):
- LMSYS-Chat-1M: 63% of first turns and 81% of later turns under 256 new tokens, as the LAPS
  paper (MLSys 2026, arXiv 2601.11589) reports it (generator.py's LMSYS_* mixtures).
- Azure LLM inference trace 2023, conversation (Patel et al., "Splitwise", ISCA 2024;
  ../shared/traces/azure_llm_2023_conv.csv, 19,366 requests, measured here): context p50 1,020
  and p90 2,735 tokens (a lognormal through both has log-sigma 0.77), 2.1% over 4,096; output
  p50 129, log-sigma 0.86; inter-arrival
  coefficient of variation 1.09 (about Poisson within the hour).
- Mooncake conversation trace (FAST'25; ../shared/traces/mooncake_conversation_trace.jsonl,
  12,031 requests, measured here): input p50 6,909 and p90 27,367 (log-sigma 1.07 through
  both); output p50 350; 37% of
  the 512-token blocks repeat an earlier request's leading blocks and 39% of the requests
  open with at least two such blocks (follow-ups: mean turns 1 / (1 - 0.39) = 1.6);
  inter-arrival coefficient of variation 3.0 (bursty).
- BurstGPT (Wang et al., arXiv 2401.17644; 10.31 M Azure OpenAI GPT requests): arrivals far
  burstier than Poisson (the authors model them with Gamma inter-arrivals): the bursty
  members, whose burst sizes and gaps are choices, not fits.
- ServeGen (Xiang et al., arXiv 2505.09999, NSDI '26): input lengths a mixture of a Pareto
  tail and a lognormal body: the very-long shares of the tailed members (shares chosen).
"""

from __future__ import annotations

import dataclasses

from .generator import (LMSYS_FIRST_TURN, LMSYS_LATER_TURN, LMSYS_OUTPUT, LengthMixture,
                        LogNormal, SessionGenConfig, tailed)


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    kind: str               # chat, code, rag or agent
    what: str               # one line: what it stresses
    config: SessionGenConfig
    seed: int


def _m(name: str, kind: str, what: str, seed: int, **cfg) -> Member:
    return Member(name, kind, what, SessionGenConfig(**cfg), seed)


_AZURE_IN = tailed(1020, 0.77)           # Azure conversation context (measured, see above)
_AZURE_OUT = tailed(129, 0.86, max_len=4096)
_MOONCAKE_IN = tailed(6909, 1.07)        # Mooncake conversation input (measured)
_MOONCAKE_OUT = tailed(350, 0.8, max_len=4096)
_SHORT_OUT = tailed(16, 0.8, max_len=512)

MEMBERS: dict[str, Member] = {m.name: m for m in (
    # -- chat ---------------------------------------------------------------------------------
    _m("chat-lmsys", "chat", "LMSYS-Chat-1M lengths, 3 turns, 4 s think", 101),
    _m("chat-bursty", "chat", "LMSYS lengths in bursts of 8 sessions 50 ms apart", 102,
       burst_size=8.0, burst_gap_s=0.05),
    _m("chat-heavy-tail", "chat", "LMSYS body, 6% pasted documents around 6k tokens", 103,
       first_input=LengthMixture((0.60, 0.34, 0.06), (LogNormal(48, 1.0), LogNormal(900, 1.0),
                                                    LogNormal(6000, 0.5)), 32768)),
    _m("chat-azure", "chat", "Azure 2023 conversation lengths, single turns", 104,
       mean_turns=1.0, max_turns=1, first_input=_AZURE_IN, output=_AZURE_OUT),
    _m("chat-long-answers", "chat", "LMSYS prompts, answers around 700 tokens", 105,
       output=tailed(700, 0.7, max_len=4096)),
    # -- code assistance ----------------------------------------------------------------------
    _m("code-complete", "code", "completions: ~1.5k-token prompts, ~16-token outputs, bursts",
       201, mean_turns=1.2, first_input=tailed(1500, 0.8), later_input=tailed(200, 1.0),
       output=_SHORT_OUT, think_s=LogNormal(2.0, 0.8), burst_size=3.0, burst_gap_s=0.2),
    _m("code-chat", "code", "~2.5k-token prompts with 10% over 12k, short follow-ups", 202,
       first_input=tailed(2500, 0.9, 0.10, 12000), later_input=tailed(300, 1.0),
       output=tailed(200, 0.8, max_len=4096), think_s=LogNormal(8.0, 0.8)),
    _m("code-longctx", "code", "Mooncake conversation lengths, follow-ups 1.6 turns", 203,
       mean_turns=1.6, first_input=_MOONCAKE_IN, later_input=tailed(800, 1.2),
       output=_MOONCAKE_OUT, think_s=LogNormal(60.0, 0.6)),
    # -- RAG ----------------------------------------------------------------------------------
    _m("rag-docs", "rag", "80% of sessions open with one of 20 ~4k-token documents", 301,
       mean_turns=1.5, first_input=tailed(60, 0.8), later_input=tailed(40, 0.8),
       output=tailed(150, 0.8, max_len=4096), prefix_share=0.8, prefix_docs=20,
       prefix_len=tailed(4000, 0.5)),
    _m("rag-big-docs", "rag", "90% open with one of 4 ~12k-token documents, bursts of 4", 302,
       mean_turns=1.2, first_input=tailed(40, 0.8), later_input=tailed(40, 0.8),
       output=tailed(120, 0.8, max_len=4096), prefix_share=0.9, prefix_docs=4,
       prefix_len=tailed(12000, 0.3), burst_size=4.0, burst_gap_s=0.1),
    _m("rag-mixed", "rag", "half RAG over 50 ~2k-token documents, half LMSYS chat", 303,
       prefix_share=0.5, prefix_docs=50, prefix_len=tailed(2000, 0.6),
       first_input=LMSYS_FIRST_TURN, later_input=LMSYS_LATER_TURN, output=LMSYS_OUTPUT),
    # -- agent loops --------------------------------------------------------------------------
    _m("agent-loop", "agent", "12 turns of tool output (~150 tokens, 3% ~4k), 0.3 s think",
       401, mean_turns=12.0, max_turns=40, first_input=tailed(1500, 0.6),
       later_input=tailed(150, 1.0, 0.03, 4000), output=tailed(80, 0.8, max_len=2048),
       think_s=LogNormal(0.3, 0.8)),
    _m("agent-system-prompt", "agent", "agent loops behind 3 shared ~3k-token system prompts",
       402, mean_turns=8.0, max_turns=30, first_input=tailed(200, 0.8),
       later_input=tailed(120, 1.0), output=tailed(60, 0.8, max_len=2048),
       think_s=LogNormal(0.5, 0.8), prefix_share=1.0, prefix_docs=3,
       prefix_len=tailed(3000, 0.2)),
    _m("agent-fanout", "agent", "sub-agents launched in bursts of 6, 20 ms apart", 403,
       mean_turns=6.0, max_turns=20, first_input=tailed(800, 0.7),
       later_input=tailed(200, 1.0), output=tailed(100, 0.8, max_len=2048),
       think_s=LogNormal(0.4, 0.8), burst_size=6.0, burst_gap_s=0.02),
)}


def member(name: str) -> Member:
    if name not in MEMBERS:
        raise ValueError(f"no family member {name!r}; members: {', '.join(MEMBERS)}")
    return MEMBERS[name]
