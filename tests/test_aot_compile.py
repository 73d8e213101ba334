"""The GPU server's executables compiled by XLA's GPU compiler for an H200 this CPU machine does
not have (`device_check.py --compile-only`, the gpu-aot extra): Qwen2.5-32B at TP 1 and TP 8,
a kernel block configuration that exceeds shared memory caught and named, a GPU-only mistake
failing the check with the rest still compiled; and the plugin leaving the CPU default as it was.

The 32B tests compile a cut of the grid to keep the suite inside its time budget: at TP 1 the
largest prefill shapes (1x2048 and 8x256, the token budget's two ends), 1x2048 with prompt
log-probs and the largest decode (32x1); at TP 8 prefill 1x2048 and decode 32x1; every KV copy
at both. The other buckets run the same kernels with other token counts
(docs/KERNELS.md has the whole grid's figures)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from laps_jax.config import PRESETS, EngineConfig
from laps_jax.engine import gpu_targets
from laps_jax.engine.buckets import Bucket

needs_plugin = pytest.mark.skipif(not gpu_targets.plugin_installed(),
                                  reason=gpu_targets.INSTALL_HINT)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")
CUT = {1: {Bucket(1, 2048), Bucket(8, 256), Bucket(1, 2048, True), Bucket(32, 1)},
       8: {Bucket(1, 2048), Bucket(32, 1)}}


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 8])
def test_32b_compiles_for_h200(tp):
    from laps_jax.engine.aot import abstract_engine, compile_all
    from laps_jax.models.plan import memory_plan
    cfg = PRESETS["qwen2.5-32b"]
    devices = gpu_targets.compile_devices("h200", tp)
    eng = abstract_engine(cfg, EngineConfig(tensor_parallel=tp), "bfloat16", devices)
    report = compile_all(eng, True, device="h200",
                         only=lambda k: not isinstance(k, Bucket) or k in CUT[tp])
    assert not report.failures, [p.format() for p in report.failures]
    by_name = {p.name: p for p in report.programs}
    assert len(by_name) == len(CUT[tp]) + 2 * len(eng.transfer.sizes)
    # the compiler's per-device arguments are the plan's arithmetic: the weights split by the
    # partition rules and the KV pool split over the heads (plus a few KiB of token ids)
    plan = memory_plan(cfg, "bfloat16", tensor_parallel=tp)
    pool = eng.ecfg.num_pages * eng.ecfg.page_size * plan.kv_bytes_per_token
    decode = by_name["decode 32x1"]
    assert 0 <= decode.argument_bytes - (plan.weight_bytes + pool) < 2**20
    assert decode.output_bytes >= pool  # the pages come back (donated: updated in place)
    assert all(p.temp_bytes > 0 for p in report.programs if not p.name.startswith("kv "))
    assert report.largest_temp.temp_bytes < 8 * 2**30


@needs_plugin
def test_shared_memory_overflow_is_caught_and_named():
    """The prefill kernel with 1024-row query blocks over 256-key blocks at 32B's heads: Triton
    asks for more shared memory than an H200 block may opt into (the target config's 232,448
    bytes); the kernel's default blocks compile."""
    from laps_jax.engine.aot import compile_program, native_pallas
    from laps_jax.engine.executable_store import fresh_compiles
    from laps_jax.pallas_kernels.prefill_kernel import paged_prefill_attention
    one = jax.sharding.SingleDeviceSharding(gpu_targets.compile_devices("h200", 1)[0])
    s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=one)
    T, pages = 256, 17
    kv = s((1, pages, 16, 8, 128), jnp.bfloat16)
    args = (s((1, T, 40, 128), jnp.bfloat16), kv, kv, s(()), s((1,)), s((1,)), s((1, pages - 1)))

    def build(**blocks):
        fn = jax.jit(functools.partial(paged_prefill_attention, scale=0.1, **blocks))
        return compile_program("prefill 1x256", "q [1, 256, 40, 128]",
                               lambda: fn.lower(*args).compile())
    with native_pallas(), fresh_compiles():
        big, default = build(block_q=1024, block_k=256), build()
    assert big.error is not None and big.error.startswith(
        "JaxRuntimeError: RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested ")
    assert "available: 232448" in big.error and "FAILED" in big.format()
    assert default.error is None and default.temp_bytes > 0


@needs_plugin
def test_a_gpu_only_mistake_fails_the_check_and_the_report_names_it(tmp_path):
    """head_dim 24: the interpreted kernels (CPU) run it, Triton cannot tile it."""
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=24, name="hd24")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, SCRIPT, "--compile-only", "--model", str(tmp_path),
                        "--max-chunk", "16", "--max-prefill-batch", "1", "--max-decode-batch",
                        "1", "--max-model-len", "64", "--no-prompt-logprobs",
                        "--report", str(report)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].endswith(" bfloat16, tensor parallel 1, pallas attention, "
                                             "scan layer loop, compiling for NVIDIA H200 x1")
    rep = json.loads(report.read_text())
    assert (rep["platform"], rep["device"], rep["tensor_parallel"]) == ("cuda", "h200", 1)
    progs = {p["name"]: p for p in rep["programs"]}
    assert set(progs) == {"decode 1x1", "prefill 1x16", "kv gather 1 pages",
                          "kv scatter 1 pages", "kv gather 4 pages", "kv scatter 4 pages"}
    assert progs["prefill 1x16"]["error"].startswith("ValueError: The Pallas Triton lowering "
                                                     "currently requires that all operations "
                                                     "have array arguments and results whose "
                                                     "size is a power of 2")
    assert progs["kv gather 4 pages"]["error"] is None  # the rest still compiled
    assert progs["kv gather 4 pages"]["argument_bytes"] > 0
    assert r.stdout.strip().splitlines()[-1].startswith("compiled 4 of 6 executables for h200 x1")


def test_without_the_plugin_one_line_says_how_to_install_it(monkeypatch, capsys):
    from conftest import load_script
    monkeypatch.setattr(gpu_targets, "plugin_installed", lambda: False)
    assert load_script("device_check").compile_only(["--compile-only", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err == gpu_targets.INSTALL_HINT + "\n" and 'pip install -e ".[gpu-aot]"' in err


@needs_plugin
@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a machine with an NVIDIA driver")
def test_the_plugin_without_a_driver_leaves_the_cpu_default_quiet():
    """Installed for compiling, the CUDA plugin must not change the CPU path: JAX would try its
    CUDA backend first and log the failure with a traceback (read by tests of the scripts'
    stderr); laps_jax says "cpu" up front when there is no driver and the user said nothing."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = ROOT
    code = "import laps_jax, jax; print(jax.default_backend(), len(jax.devices()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["cpu", "1"], r.stderr
    assert "Traceback" not in r.stderr and "plugin configuration error" not in r.stderr
