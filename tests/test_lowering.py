"""`device_check.py --lower-only`: the GPU server's executables for Qwen2.5-32B lowered for cuda
on this CPU from shapes alone (bf16, scan, Pallas as Triton), at TP 1 and TP 8 over virtual
devices; and a GPU-only mistake (a head_dim the Triton kernels cannot tile) makes it fail.

At TP 1 the whole default grid (46 executables: what serve.py --model qwen2.5-32b compiles on
one H200); at TP 8 a cut-down grid (prefill widths 16-128, batches 1-2, decode 1-2: 19) to keep
the suite inside its time budget: every bucket shape runs the same kernels with another token
count, and TP only changes the head split."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine.lowering import abstract_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")
SMALL_GRID = ["--max-chunk", "128", "--max-prefill-batch", "2", "--max-decode-batch", "2",
              "--max-model-len", "4096"]


def lower_only(*flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, SCRIPT, "--lower-only", *flags], capture_output=True,
                          text=True, env=env, timeout=600)


SMALL_ECFG = EngineConfig(max_chunk=128, max_prefill_batch=2, max_decode_batch=2,
                          max_model_len=4096)


def planned(ecfg: EngineConfig) -> list[str]:
    """The executables the compile owner plans for a grid (asked in this process)."""
    eng = abstract_engine(PRESETS["qwen2.5-32b"], ecfg)
    return [str(k) for _, k in eng.executables.planned()]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 8])
def test_32b_programs_lower_for_cuda(tp):
    grid = [] if tp == 1 else SMALL_GRID
    r = lower_only("--model", "qwen2.5-32b", "--tensor-parallel", str(tp), *grid)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(f"qwen2.5-32b bfloat16, tensor parallel {tp}, pallas attention, "
                               "scan layer loop, lowering for cuda")
    rows = [ln for ln in lines if ln.endswith(" ok")]
    n = len(planned(EngineConfig() if tp == 1 else SMALL_ECFG))
    assert len(rows) == n and n == (46 if tp == 1 else 19)  # TP 8: 9 + 2 buckets, 8 copies
    assert {"prefill 2x64", "decode 2x1", "kv scatter 256 pages"} <= {r[:24].strip() for r in rows}
    assert lines[-1].startswith(f"lowered {n} of {n} executables for cuda") \
        and lines[-1].endswith("; 0 failed")


def test_a_gpu_only_mistake_fails_the_check(tmp_path):
    """head_dim 24: the interpreted kernels (CPU) run it, Triton cannot tile it."""
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=24, name="hd24")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    r = lower_only("--model", str(tmp_path), "--max-chunk", "16", "--max-prefill-batch", "1",
                   "--max-decode-batch", "1", "--max-model-len", "64")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "prefill 1x16" in r.stdout and "FAILED ValueError: The Pallas Triton lowering " \
        "currently requires that all operations have array arguments and results whose size " \
        "is a power of 2" in r.stdout
    assert "kv gather 1 pages" in r.stdout  # the rest still lowered and reported
    assert r.stdout.strip().splitlines()[-1].endswith("; 2 failed")
