"""The engine: runs prefill chunks and decode steps for sequences a caller picked.

It owns the runner (device side) and the KV cache manager (host side). Deciding *which*
sequences run when is the scheduler's job; `generate` is a small synchronous loop for the
offline job, tests and benchmarks.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence as Seq

from laps_jax.config import EngineConfig, ModelConfig
from laps_jax.engine.buckets import Bucket, BucketGrid
from laps_jax.engine.compile_owner import EngineExecutables
from laps_jax.engine.kv_cache import KVCacheManager, OutOfPages
from laps_jax.engine.kv_transfer import KVTransfer
from laps_jax.engine.packing import shortest_first
from laps_jax.engine.paged import PagedSequences
from laps_jax.engine.runner import ModelRunner, SeqInput, SeqOutput
from laps_jax.engine.sampling import position_uniform
from laps_jax.engine.settings import resolve as resolve_settings
from laps_jax.engine.sequence import (TOP_P_FLOOR, SamplingParams, Sequence, Status,
                                      TokenLogprobs)
from laps_jax.models.qwen2 import default_layer_loop
from laps_jax.pallas_kernels import default_backend

log = logging.getLogger(__name__)


class Engine(PagedSequences):
    def __init__(self, cfg: ModelConfig, params: dict, ecfg: EngineConfig | None = None,
                 eos_token_ids: Iterable[int] = (), devices=None):
        """`devices`: what a tensor-parallel mesh spans (default: this process's), e.g. the
        compile-only GPUs of engine/aot.py."""
        self.cfg = cfg
        self.ecfg = ecfg = resolve_settings(ecfg or EngineConfig(), cfg)
        self.grid = BucketGrid.of_settings(ecfg)
        mesh = None
        if ecfg.tensor_parallel > 1:  # weights and KV heads split over that many devices
            from laps_jax.models.sharding import make_mesh, tensor_mesh
            n = ecfg.tensor_parallel
            mesh = tensor_mesh(n) if devices is None else make_mesh(devices=devices[:n])
        self.runner = ModelRunner(cfg, params, num_pages=ecfg.num_pages,
                                  page_size=ecfg.page_size, max_model_len=ecfg.max_model_len,
                                  grid=self.grid,
                                  attention_backend=ecfg.attention_backend or default_backend(),
                                  layer_loop=ecfg.layer_loop or default_layer_loop(params),
                                  mesh=mesh)
        self.kv = KVCacheManager(ecfg.num_pages, ecfg.page_size, ecfg.enable_prefix_cache)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.transfer = KVTransfer(self.runner)  # laps-spatial's KV hand-off
        self.executables = EngineExecutables(self.runner, self.transfer)  # compiles them all

    def warmup(self, prompt_logprobs: bool = False, progress=None) -> None:
        self.executables.warmup(prompt_logprobs, progress)

    # -- admission ------------------------------------------------------------------------
    def check_prompt(self, prompt: Seq[int], max_tokens: int = 0) -> None:
        """Raises ValueError with the limit in the message when a prompt cannot run."""
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        limit = self.ecfg.max_model_len
        if max_tokens == 0 and len(prompt) > limit:
            raise ValueError(f"the prompt is {len(prompt)} tokens, longer than the context of "
                             f"{limit} tokens (--max-model-len)")
        if len(prompt) + max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the maximum context length of {limit} tokens")

    # -- steps ----------------------------------------------------------------------------
    def _input(self, seq: Sequence, start: int, n: int, next_token: int = -1) -> SeqInput:
        p = seq.params
        u = 0.0
        if p.temperature > 0 and start + n >= len(seq.prompt):
            # keyed by the position sampled: a retried step, or the sequence resumed elsewhere
            # from its prompt and first tokens, samples with the same number
            u = position_uniform(seq.seed, start + n)
        # the executables take int32 top-k and float32 top-p: a top-k past the vocabulary is no
        # limit, and a top-p under the floor keeps only the likeliest token (as greedy does)
        # instead of flushing to 0 and keeping none
        top_k = min(p.top_k, self.cfg.vocab_size)
        top_p = max(p.top_p, TOP_P_FLOOR)
        return SeqInput(seq.token_slice(start, start + n), start, seq.pages.pages, p.temperature,
                        top_k, top_p, u, next_token)

    def prefill(self, work: Seq[tuple[Sequence, int]], prompt_logprobs: bool = False,
                sample: bool = True, bucket: Bucket | None = None) -> list[SeqOutput]:
        """Computes `n` more prompt tokens of each sequence in one bucket (`bucket`, when the
        caller planned one). A sequence whose prompt completes gets its first token (when
        `sample`) and moves to decode."""
        inputs = []
        for seq, n in work:
            start = seq.num_computed
            nxt = seq.prompt[start + n] if start + n < len(seq.prompt) else -1
            inputs.append(self._input(seq, start, n, nxt))
        outs = self.runner.run(inputs, prompt_logprobs, bucket)
        for (seq, n), out in zip(work, outs):
            seq.num_computed += n
            self.kv.commit(seq.pages, seq.prompt[:seq.num_computed])
            if seq.num_computed == len(seq.prompt):
                seq.status = Status.DECODE
                if sample:
                    self._append(seq, out)
        return outs

    def decode(self, seqs: Seq[Sequence], bucket: Bucket | None = None) -> list[SeqOutput]:
        """One token for each sequence (in `bucket`, when the caller planned one). Raises
        OutOfPages before touching anything."""
        need = sum(max(self.kv.pages_for(s.num_tokens) - len(s.pages.pages), 0) for s in seqs)
        if need > self.kv.num_free:
            raise OutOfPages(f"decode needs {need} more KV pages, {self.kv.num_free} free")
        for s in seqs:
            self.kv.grow(s.pages, s.num_tokens)
        outs = self.runner.run([self._input(s, s.num_tokens - 1, 1) for s in seqs], False,
                               bucket)
        for s, out in zip(seqs, outs):
            s.num_computed = s.num_tokens
            self._append(s, out)
        return outs

    def _append(self, seq: Sequence, out: SeqOutput) -> None:
        p = seq.params
        seq.output.append(out.token_id)
        k = min(p.logprobs, len(out.top_ids))
        seq.logprobs.append(TokenLogprobs(out.token_id, out.logprob,
                                          list(zip(out.top_ids[:k].tolist(),
                                                   out.top_logprobs[:k].tolist()))))
        if not p.ignore_eos and out.token_id in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif out.token_id in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output) >= p.max_tokens or seq.num_tokens >= self.ecfg.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason:
            self.kv.commit(seq.pages, seq.token_slice(0, seq.num_computed))
            self.release(seq)

    # -- a simple synchronous loop ---------------------------------------------------------
    def next_prefill(self, seqs: Seq[Sequence]) -> list[tuple[Sequence, int]]:
        """The next prefill step over `seqs` (empty when none has prompt left): the shortest
        remaining prompts, as many as one bucket holds, packed as the dispatcher packs."""
        return shortest_first(seqs, lambda s: s.remaining_prefill, self.grid)

    def prefill_prompts(self, seqs: Seq[Sequence]) -> None:
        """Admits `seqs` and prefills their whole prompts in the steps `next_prefill` picks
        (benchmarks set up decode batches with it)."""
        for s in seqs:
            self.admit(s)
        while step := self.next_prefill(seqs):
            self.prefill(step)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
                 ) -> list[Sequence]:
        """Runs every prompt to completion; output order follows input order."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        seqs = [Sequence(list(map(int, p)), sp) for p, sp in zip(prompts, plist)]
        for s in seqs:
            self.check_prompt(s.prompt, s.params.max_tokens)
        waiting = list(seqs)
        running: list[Sequence] = []
        while waiting or running:
            while waiting:
                try:
                    self.admit(waiting[0])
                except OutOfPages:
                    if not running:
                        raise
                    break
                running.append(waiting.pop(0))
            step = self.next_prefill([s for s in running if s.status is Status.PREFILL])
            if step:
                self.prefill(step)
            dec = [s for s in running if s.status is Status.DECODE]
            for i in range(0, len(dec), self.grid.decode_batches[-1]):
                self.decode(dec[i:i + self.grid.decode_batches[-1]])
            running = [s for s in running if not s.is_finished]
        return seqs
