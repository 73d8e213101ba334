#!/usr/bin/env python
"""Memory plan for a preset or checkpoint: weight bytes, KV bytes per token, KV tokens that fit."""

from __future__ import annotations

import argparse
import sys

from laps_jax.config import resolve_model
from laps_jax.models.plan import DEVICES_GB, memory_plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="preset name or Hugging Face Qwen2 directory")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", default="h200",
                    help=f"device name ({', '.join(DEVICES_GB)}) or its memory in GB")
    ap.add_argument("--reserve", type=float, default=0.1,
                    help="fraction of device memory kept for activations/runtime (default 0.1)")
    args = ap.parse_args(argv)
    try:
        gb = DEVICES_GB[args.device] if args.device in DEVICES_GB else float(args.device)
    except ValueError:
        ap.error(f"--device: unknown device {args.device!r}")
    cfg, _ = resolve_model(args.model)
    print(memory_plan(cfg, args.dtype, gb, args.reserve).format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
