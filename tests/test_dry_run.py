"""`serve.py --dry-run`: the plan of a Qwen2.5-32B server from shapes alone (no weights, no
compile): per-device weights by the partition rules, checked against a count by hand; a plan
that does not fit is refused with its numbers."""

from __future__ import annotations

import pytest

from laps_jax.config import PRESETS
from laps_jax.models.plan import GB, memory_plan
from laps_jax.server.run import main


def run(capsys, *flags: str) -> tuple[int, str]:
    rc = main(["--model", "qwen2.5-32b", "--dry-run", *flags])
    return rc, capsys.readouterr().out


def test_plan_fits_and_shows_grid_and_threshold(capsys):
    rc, out = run(capsys)
    assert rc == 0, out
    assert "weights          65.53 GB" in out
    assert "buckets: prefill 1-8 x 16-2048 tokens (budget 2048), decode 1-32" in out
    assert "LAPS threshold   223 new tokens over 0 cached" in out  # the H200 roofline ridge
    assert "fits: KV pool 65,536 tokens" in out


def test_tensor_parallel_weights_per_device_match_a_count_by_hand():
    cfg = PRESETS["qwen2.5-32b"]
    h, L = cfg.hidden_size, cfg.num_layers
    norms = 2 * L * h + h  # RMSNorm weights stay whole on every device; all else divides by 8
    by_hand = ((cfg.num_params() - norms) // 8 + norms) * 2
    plan = memory_plan(cfg, "bfloat16", 141.0, tensor_parallel=8)
    assert plan.weight_bytes == by_hand
    assert plan.kv_bytes_per_token == 2 * L * cfg.num_kv_heads * cfg.head_dim * 2 // 8
    assert plan.kv_tokens == (int(141 * GB) - int(14.1 * GB) - by_hand) // plan.kv_bytes_per_token


def test_plan_that_does_not_fit_is_refused_with_numbers(capsys):
    rc, out = run(capsys, "--device", "h100")  # 65.5 GB of weights leave 6.5 GB for KV
    assert rc == 1
    assert ("refused: --kv-cache-tokens 65536 does not fit: 17.18 GB of KV per device, "
            "6.47 GB left after the weights (24,689 tokens)") in out
    rc, out = run(capsys, "--device", "h100", "--tensor-parallel", "2")
    assert rc == 0 and "weights          32.76 GB per device" in out
    rc, out = run(capsys, "--device", "a100-40g")
    assert rc == 1 and "refused: the weights do not fit: 65.53 GB per device, 36.00 GB usable" in out


@pytest.mark.parametrize("flags, message", [
    (("--tensor-parallel", "3"), "--tensor-parallel 3 does not divide the model's 8 KV heads"),
    (("--device", "tpu9"), "--device: unknown device 'tpu9'"),
])
def test_bad_flags_are_one_line_errors(capsys, flags, message):
    assert main(["--model", "qwen2.5-32b", "--dry-run", *flags]) == 2
    assert message in capsys.readouterr().err


TINY_GRID = ("--max-chunk", "16", "--max-prefill-batch", "1", "--max-decode-batch", "1",
             "--max-model-len", "64", "--kv-cache-tokens", "1024")


def compiled_run(capsys, monkeypatch, model: str, device: str) -> tuple[int, str]:
    from laps_jax.engine import gpu_targets
    if not gpu_targets.plugin_installed():
        pytest.skip(gpu_targets.INSTALL_HINT)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    rc = main(["--model", model, "--dry-run", "--compile", "--device", device, *TINY_GRID])
    return rc, capsys.readouterr().out


@pytest.mark.slow
def test_compiled_plan_uses_the_compilers_temp(capsys, monkeypatch):
    rc, out = compiled_run(capsys, monkeypatch, "tiny", "h200")
    assert rc == 0, out
    lines = {ln[:17].strip(): ln[17:] for ln in out.splitlines()}
    temp = lines["temp buffers"]
    assert temp.endswith("[compiler: largest of 7 executables, prefill+logprobs 1x16, "
                         "compiled for NVIDIA H200]")
    assert lines["weights"].endswith("[arithmetic: shapes]")
    # the reserve is what lies outside JAX's allocator (25% by default) and 2% of the rest
    # of the 143,771 MiB the driver reports for an H200 (not the datasheet's 141 GB): JAX's
    # allocator takes its share of that
    assert lines["device memory"] == ("150.8 GB (40.0 GB kept for the runtime  [arithmetic: 25% "
                                      "outside JAX's allocator, 2% of the rest for "
                                      "fragmentation])")
    plan = memory_plan(PRESETS["tiny"], "bfloat16", 150.0, temp_bytes=1, temp_source="x")
    assert plan.reserved_bytes == int(150 * GB * 0.25 + 150 * GB * 0.75 * 0.02)


@pytest.mark.slow
def test_compiled_plan_that_does_not_fit_is_refused_with_numbers(capsys, monkeypatch):
    """32B on one H100: 65.5 GB of weights; JAX's allocator may use 75% of its 85.5 GB."""
    rc, out = compiled_run(capsys, monkeypatch, "qwen2.5-32b", "h100")
    assert rc == 1, out
    refused = [ln for ln in out.splitlines() if ln.startswith("refused: ")]
    assert len(refused) == 1 and refused[0].startswith(
        "refused: the weights do not fit: 65.53 GB per device and 0.")
    assert refused[0].endswith("GB of temps, 62.86 GB usable (85.5 GB less the reserve)")
