#!/usr/bin/env python
"""Memory plan for a preset or checkpoint: weight bytes, KV bytes per token, KV tokens that fit
(`serve.py --dry-run` prints this plan with the bucket grid and the LAPS threshold, and refuses
settings that do not fit)."""

from __future__ import annotations

import argparse
import sys

from laps_jax.config import resolve_model
from laps_jax.models.plan import DEVICES_GB, device_gb, memory_plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="preset name or Hugging Face Qwen2 directory")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--device", default="h200",
                    help=f"device name ({', '.join(DEVICES_GB)}) or its memory in GB")
    ap.add_argument("--reserve", type=float, default=0.1,
                    help="fraction of device memory kept for activations/runtime (default 0.1)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="weights and KV heads split over N devices (default 1)")
    args = ap.parse_args(argv)
    try:
        gb = device_gb(args.device)
    except ValueError as e:
        ap.error(str(e))
    cfg, _ = resolve_model(args.model)
    print(memory_plan(cfg, args.dtype, gb, args.reserve, args.tensor_parallel).format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
