#!/usr/bin/env python
"""Prefill and decode speed of laps_jax against Hugging Face transformers (torch, CPU) on the same
random checkpoint, in one process, plus achieved GFLOP/s against the measured matmul rate.

laps_jax runs as a server would after warm-up (every bucket compiled and run once, XLA's own
matmuls). The two sides take turns (one untimed call, then --block timed ones;
repeated) and the speedup is the median of the per-turn ratios, so a noisy neighbour slows both
sides alike. The untimed call matters: right after a switch the other library's threads still
hold the two cores (torch's OpenMP workers busy-wait after each parallel region), and with one
call per turn that had cost laps_jax ~30% of its matmul speed (2048x384x1024 alone 203-214
GFLOP/s, 123-142 timed right after a torch call).
Decode on both sides is one greedy step at a time over each side's own KV cache.

transformers and torch are only the comparison here (install the `test` extra); laps_jax itself
never imports them.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from laps_jax.timing import median_time, paired_times


def matmul_rate(n: int = 2048) -> float:
    """Measured float32 matmul GFLOP/s of jax on this machine."""
    import jax
    import jax.numpy as jnp
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    t = median_time(lambda: f(a).block_until_ready(), 5)
    return 2 * n ** 3 / t / 1e9


def time_decode(eng, hf, prompts: list[list[int]], steps: int,
                block: int = 1) -> tuple[float, float, float]:
    """One greedy decode step of the batch at a time, laps_jax and transformers alternately.
    laps_jax keeps each sequence's own history (paged); transformers left-pads the batch to the
    longest prompt with an attention mask, as its generate() does."""
    import torch
    from laps_jax.engine.sequence import SamplingParams, Sequence
    seqs = [Sequence(p, SamplingParams(max_tokens=10 ** 6, ignore_eos=True)) for p in prompts]
    eng.prefill_prompts(seqs)
    width = max(map(len, prompts))
    x = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        state = {"out": hf(x, attention_mask=mask, use_cache=True), "mask": mask}

        def hf_step():
            nxt = state["out"].logits[:, -1:].argmax(-1)
            state["mask"] = torch.cat([state["mask"], torch.ones_like(nxt)], 1)
            state["out"] = hf(nxt, attention_mask=state["mask"],
                              past_key_values=state["out"].past_key_values, use_cache=True)

        result = paired_times(lambda: eng.decode(seqs), hf_step, steps, block)
    for s in seqs:
        eng.release(s)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="bench-cpu", help="preset to benchmark (random weights)")
    ap.add_argument("--prefill", default="128,512,2048", help="prefill lengths")
    ap.add_argument("--decode-batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--decode-context", type=int, default=128, help="prompt length before decode")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--mixed-decode", default="2000,300,300,300,300,300,300,300",
                    help="one more decode row over these history lengths (one per sequence; "
                         "transformers pads them to the longest, as generate() does; '' to skip)")
    ap.add_argument("--repeats", type=int, default=5, help="turns per side")
    ap.add_argument("--block", type=int, default=3,
                    help="timed calls per turn, after one untimed call (1: plain alternation, "
                         "no untimed call)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    import jax
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from laps_jax.builder import EngineBuild, build
    from laps_jax.config import PRESETS, EngineConfig
    from laps_jax.engine.runner import SeqInput
    from laps_jax.models.weights import params_from_hf

    cfg = PRESETS[args.model]
    lengths = [int(x) for x in args.prefill.split(",")]
    batches = [int(x) for x in args.decode_batches.split(",")]
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg.to_hf_dict(), attn_implementation="sdpa")).eval()
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    params = params_from_hf(sd.__getitem__, sd.__contains__, cfg)
    mixed = [int(x) for x in args.mixed_decode.split(",")] if args.mixed_decode else []
    longest = (max(lengths + mixed + [args.decode_context])
               + (args.decode_steps + 1) * (args.block + 1) + 64)
    ecfg = EngineConfig(kv_cache_tokens=max(lengths) * 2 + sum(mixed) + 8192,
                        max_model_len=longest, max_chunk=max(lengths), max_prefill_batch=1,
                        max_decode_batch=max(batches + [len(mixed)]))
    # as a server starts: every bucket compiled and run once
    eng = build(EngineBuild(args.model, ecfg), weights=(cfg, params)).engine
    peak = matmul_rate()
    print(f"{args.model}: {cfg.num_params() / 1e6:.1f}M params; jax float32 matmul "
          f"{peak:.0f} GFLOP/s; torch threads {torch.get_num_threads()}; "
          f"jax devices {jax.devices()}", file=sys.stderr)
    rows = []
    rng = np.random.default_rng(0)
    for n in lengths:
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        pages = list(range(1, eng.kv.pages_for(n) + 1))
        x = torch.tensor([ids])
        with torch.no_grad():
            t_ours, t_hf, speedup = paired_times(
                lambda: eng.runner.run([SeqInput(ids, 0, pages)]),
                lambda: hf(x, logits_to_keep=1), args.repeats, args.block)
        flops = cfg.flops_per_token() * n + 4 * cfg.num_layers * cfg.q_size * n * n / 2
        rows.append({"phase": "prefill", "tokens": n, "laps_jax_tok_s": n / t_ours,
                     "transformers_tok_s": n / t_hf, "speedup": speedup,
                     "laps_jax_gflops": flops / t_ours / 1e9,
                     "fraction_of_matmul_peak": flops / t_ours / 1e9 / peak})
    for ctxs in [[args.decode_context] * b for b in batches] + ([mixed] if mixed else []):
        prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in ctxs]
        t_ours, t_hf, speedup = time_decode(eng, hf, prompts, args.decode_steps, args.block)
        rows.append({"phase": "decode", "batch": len(ctxs), "context": ctxs[0] if
                     len(set(ctxs)) == 1 else "+".join(map(str, ctxs)),
                     "laps_jax_tok_s": len(ctxs) / t_ours,
                     "transformers_tok_s": len(ctxs) / t_hf, "speedup": speedup})
    print(f"\n| phase | shape | laps_jax tok/s | transformers tok/s | speedup (median of pairs) "
          f"| laps_jax GFLOP/s "
          f"(% of {peak:.0f}) |\n|---|---|---|---|---|---|")
    for r in rows:
        shape = (f"{r['tokens']} tokens" if r["phase"] == "prefill"
                 else f"batch {r['batch']} @ {r['context']}")
        g = (f"{r['laps_jax_gflops']:.0f} ({100 * r['fraction_of_matmul_peak']:.0f}%)"
             if "laps_jax_gflops" in r else "-")
        print(f"| {r['phase']} | {shape} | {r['laps_jax_tok_s']:.0f} | "
              f"{r['transformers_tok_s']:.0f} | {r['speedup']:.2f}x | {g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "matmul_gflops": peak, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
