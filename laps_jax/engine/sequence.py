"""The state of one sequence as the engine sees it: tokens, pages, sampling, progress."""

from __future__ import annotations

import dataclasses
import enum
import itertools

from laps_jax.engine.kv_cache import SeqPages

_ids = itertools.count()
# top-p values under this keep only the likeliest token (the top token of any vocabulary under
# a million ids has probability over 1e-6), so they mean greedy; float32 would flush the
# smallest ones to 0, which kept no token and sampled the least likely one
TOP_P_FLOOR = 1e-6


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # top log-probs to keep per generated token (0 = only the chosen one)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


class Status(enum.Enum):
    WAITING = "waiting"      # no pages yet
    PREFILL = "prefill"      # pages held, prompt partly computed
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    pages: SeqPages | None = None
    num_computed: int = 0   # tokens whose K/V are in the pages
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    seed: int | None = None  # the sampling seed (the client's, or drawn at admission): the
                             # token at position i samples with position_uniform(seed, i)
    error: str | None = None     # why the engine could not run it (finish_reason "error")

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """len(tokens) without building the list (decode asks every step)."""
        return len(self.prompt) + len(self.output)

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] without copying the whole conversation."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]

    @property
    def remaining_prefill(self) -> int:
        """Prompt tokens still to compute: the number LAPS classifies a request by."""
        return max(len(self.prompt) - self.num_computed, 0)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
