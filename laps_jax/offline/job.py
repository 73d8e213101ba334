"""The offline job's run: prefill every good line, shared prefixes first, and write one output
line per input line, in input order, a window of lines at a time.

Each window computes the full-block prefixes two or more of its prompts share once (later
prompts find them in the prefix cache), then admits prompts as pages allow and prefills them in
steps cut by the dispatcher's own packing (`engine/packing.py`), shortest first so similar
lengths share a bucket. A step that fails is re-run one line at a time: the line at fault gets
the error, its batch-mates their results.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Iterable, TextIO

import numpy as np
from tqdm import tqdm

from laps_jax.engine.engine import Engine
from laps_jax.engine.kv_cache import OutOfPages, block_hash
from laps_jax.engine.packing import shortest_first
from laps_jax.engine.sequence import SamplingParams, Sequence, Status
from laps_jax.offline.lines import JobItem, parse_line, strip_eol

MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass
class JobSummary:
    requests: int = 0
    failed: int = 0
    skipped: int = 0              # lines an earlier run wrote (--resume)
    prompt_tokens: int = 0
    computed_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0          # prefill, compiles excluded
    compile_seconds: float = 0.0  # the buckets this input needed that were not compiled yet
    compiled: int = 0
    padding_fraction: float = 0.0

    def format(self) -> str:
        tps = self.computed_tokens / self.seconds if self.seconds else 0.0
        skipped = f", {self.skipped} already written" if self.skipped else ""
        return (f"requests {self.requests} (failed {self.failed}{skipped}) | "
                f"{self.compiled} buckets compiled (or read from the compilation cache) in "
                f"{self.compile_seconds:.1f} s | prefill "
                f"{self.seconds:.2f} s: prompt tokens {self.prompt_tokens} (computed "
                f"{self.computed_tokens}, from prefix cache {self.cached_tokens}), "
                f"{tps:.1f} tokens/s, padding {100 * self.padding_fraction:.1f}%")


def shared_prefixes(prompts: list[list[int]], page_size: int) -> list[list[int]]:
    """The deepest full-block prefixes that two or more prompts share (each listed once)."""
    counts: collections.Counter = collections.Counter()
    chains = []
    for p in prompts:
        chain, h = [], b""
        for i in range((len(p) - 1) // page_size):
            h = block_hash(h, p[i * page_size:(i + 1) * page_size])
            chain.append(h)
        chains.append(chain)
        counts.update(chain)
    out: dict[bytes, list[int]] = {}
    for p, chain in zip(prompts, chains):
        depth = 0
        while depth < len(chain) and counts[chain[depth]] >= 2:
            depth += 1
        if depth:
            out.setdefault(chain[depth - 1], p[:depth * page_size])
    return sorted(out.values(), key=len)


class PrefillJob:
    def __init__(self, engine: Engine, top_logprobs: int = 5, prompt_logprobs: bool = False,
                 max_active: int = 64):
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"--top-logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        self.engine, self.k, self.prompt_lp = engine, top_logprobs, prompt_logprobs
        self.max_active = max_active
        self.prefix_lps: dict[bytes, np.ndarray] = {}  # chained hash -> lps of its tokens 1..

    def _run(self, items: list[JobItem], bar=None) -> None:
        """Prefills every item's prompt (admitting as pages allow) and records results."""
        eng = self.engine
        pending = collections.deque(sorted(items, key=lambda it: len(it.prompt)))
        active: list[JobItem] = []
        while pending or active:
            while pending and len(active) < self.max_active:
                it = pending[0]
                it.seq = Sequence(it.prompt, SamplingParams(max_tokens=1))
                try:
                    self._admit(it)
                except OutOfPages:
                    if not active:
                        it.error = f"line {it.line_no}: prompt does not fit the KV cache"
                        pending.popleft()
                        continue
                    break
                active.append(pending.popleft())
            seqs = {id(it.seq): it for it in active}
            step = shortest_first([it.seq for it in active], _remaining, eng.grid)
            if not step:
                break
            for seq, n, out in self._prefill_contained(step, seqs):
                it = seqs[id(seq)]
                if self.prompt_lp:
                    it.prompt_lps.extend(out.target_logprobs.tolist())
                if seq.status is Status.DECODE:
                    self._finish(it, out)
                    if bar is not None:
                        bar.update(1)
            active = [it for it in active if it.result is None and it.error is None]

    def _prefill_contained(self, step, items: dict) -> list:
        """Runs one step; if it fails, each of its sequences alone, so a line whose prefill
        fails gets that error and the others go on. [(seq, n, output)] of what ran."""
        try:
            outs = self.engine.prefill(step, self.prompt_lp, sample=False)
            return [(seq, n, out) for (seq, n), out in zip(step, outs)]
        except Exception as e:  # noqa: BLE001 - contained to the lines of this step
            if len(step) > 1:
                return [r for work in step for r in self._prefill_contained([work], items)]
            it = items[id(step[0][0])]
            why = (str(e).splitlines() or [type(e).__name__])[0][:300]
            it.error = f"line {it.line_no}: prefill failed: {why}"
            self.engine.release(it.seq, "abort")
            return []

    def _admit(self, it: JobItem) -> None:
        eng, seq = self.engine, it.seq
        eng.admit(seq)
        it.prompt_lps = []
        if not self.prompt_lp or seq.cached_tokens == 0:
            return
        known = self.prefix_lps.get(seq.pages.hashes[-1]) if seq.pages.hashes else None
        if known is None:  # history cached by someone else: recompute it (same K/V values)
            seq.num_computed = 0
        else:  # recompute the last cached token to get the next token's distribution
            seq.num_computed = seq.cached_tokens - 1
            it.prompt_lps = known[:seq.num_computed].tolist()  # tokens 1 .. num_computed

    def _finish(self, it: JobItem, out) -> None:
        seq = it.seq
        res = {"id": it.id, "num_prompt_tokens": len(it.prompt),
               "num_cached_tokens": seq.cached_tokens,
               "top_logprobs": [[int(t), float(lp)] for t, lp in
                                zip(out.top_ids[:self.k], out.top_logprobs[:self.k])]}
        if self.prompt_lp:
            lps = it.prompt_lps[:len(it.prompt) - 1]
            res["prompt_logprobs"] = [None] + [float(x) for x in lps]
            page = self.engine.ecfg.page_size
            for d, h in enumerate(seq.pages.hashes if seq.pages else []):
                self.prefix_lps.setdefault(h, np.asarray(lps[:(d + 1) * page - 1]))
        it.result = res
        self.engine.release(seq, "stop")

    def run(self, lines: Iterable[bytes | str], tokenizer, out: TextIO, progress: bool = True,
            skip: int = 0, window: int = 256) -> JobSummary:
        """Validates every line first, then prefills them `window` lines at a time and writes
        (and flushes) each window's output lines in input order, one per input line, so an
        interrupted job keeps what it finished. `skip`: lines an earlier run wrote."""
        eng = self.engine
        lines = list(lines)
        items = [parse_line(i + 1, strip_eol(raw), tokenizer, eng)
                 for i, raw in enumerate(lines) if i >= skip]
        summary = JobSummary(requests=len(lines), skipped=min(skip, len(lines)))
        stats, cache = eng.runner.stats, eng.runner.executables
        real0, bucket0, hits0 = stats.real_tokens, stats.bucket_tokens, eng.kv.hit_tokens
        compile0, compiled0 = cache.compile_seconds, len(cache)
        t0 = time.perf_counter()
        todo = items
        good = sum(it.error is None for it in todo)
        with tqdm(total=good, desc="prefill", unit="req", disable=not progress) as bar:
            for w in range(0, len(todo), window):
                part = todo[w:w + window]
                self._run_window([it for it in part if it.error is None], bar)
                for it in part:
                    if it.result is None:
                        summary.failed += 1
                        out.write(json.dumps({"id": it.id, "error": it.error or "not run"})
                                  + "\n")
                    else:
                        summary.prompt_tokens += len(it.prompt)
                        out.write(json.dumps(it.result) + "\n")
                out.flush()
        summary.computed_tokens = stats.real_tokens - real0
        summary.cached_tokens = eng.kv.hit_tokens - hits0
        bucket = stats.bucket_tokens - bucket0
        summary.padding_fraction = 1 - summary.computed_tokens / bucket if bucket else 0.0
        summary.compile_seconds = cache.compile_seconds - compile0
        summary.compiled = len(cache) - compiled0
        summary.seconds = time.perf_counter() - t0 - summary.compile_seconds
        return summary

    def _run_window(self, good: list[JobItem], bar) -> None:
        eng = self.engine
        prefixes = shared_prefixes([it.prompt for it in good], eng.ecfg.page_size)
        if prefixes:  # compute each shared history once; later prompts find it cached
            self._run([JobItem(-1, None, prompt=p + [0]) for p in prefixes])
        self._run(good, bar)


def _remaining(seq: Sequence) -> int:
    return seq.remaining_prefill
