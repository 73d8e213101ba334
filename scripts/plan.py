#!/usr/bin/env python
"""Memory plan for a preset or checkpoint: weight bytes, KV bytes per token, KV tokens that fit
(`serve.py --dry-run` prints this plan with the bucket grid and the LAPS threshold, and refuses
settings that do not fit). `--compile` compiles the default server's executables for --device
(h200 or h100; the gpu-aot extra) and plans with the compiler's largest temp buffer."""

from __future__ import annotations

import argparse
import sys

from laps_jax.config import EngineConfig, resolve_model
from laps_jax.engine import settings
from laps_jax.models.plan import DEVICES_GB, device_gb, memory_plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="preset name or Hugging Face Qwen2 directory")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", default="h200",
                    help=f"device name ({', '.join(DEVICES_GB)}) or its memory in GB")
    ap.add_argument("--reserve", type=float, default=0.1,
                    help="fraction of device memory kept for activations/runtime (default 0.1; "
                         "with --compile the compiler's temps and the runtime reserve instead)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="weights and KV heads split over N devices (default 1)")
    ap.add_argument("--compile", action="store_true",
                    help="compile the default grid's executables for --device and use the "
                         "largest temp buffer (minutes on a CPU for a large model)")
    args = ap.parse_args(argv)
    try:
        gb = device_gb(args.device)
    except ValueError as e:
        ap.error(str(e))
    cfg, _ = resolve_model(args.model)
    temp, source = 0, ""
    if args.compile:
        from laps_jax.engine.gpu_targets import device_memory_bytes
        from laps_jax.server.dry_run import compiled_temp
        ecfg = settings.resolve(EngineConfig(tensor_parallel=args.tensor_parallel), cfg)
        try:
            temp, source = compiled_temp(cfg, ecfg, args.dtype, args.device)
            gb = device_memory_bytes(args.device) / 1e9  # the driver's total, as JAX sees it
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(memory_plan(cfg, args.dtype, gb, args.reserve, args.tensor_parallel, temp,
                      source).format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
