"""What users run, with the defaults: the README's serve command, prefill_batch.py with default
engine settings on several Qwen2 layouts (against transformers), and a start-up matrix of
context and chunk settings that each start or are refused in one line before compiling."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

from hf_fixtures import load_hf_model, load_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _chat(url: str) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": "What is a list?"}],
                       "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.slow
def _cuda_plugin_loader_line(line: str) -> bool:
    """The two lines JAX's CUDA plugin (the gpu-aot extra, installed for the H200 compile
    tests) prints from native code each time it loads on a machine with no NVIDIA driver; no
    setting silences them. The README's own install (no extras) prints neither."""
    if importlib.util.find_spec("jax_plugins") is None or \
            importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return False
    return (line == "WARNING: All log messages before absl::InitializeLog() is called are "
                    "written to STDERR"
            or line.endswith("Could not find cuda drivers on your machine, GPU will not be used."))


def test_readme_serve_command_starts_three_times():
    """`python scripts/serve.py` with no flag but --port: ready, an answer, SIGTERM, exit 0;
    three times in a row (the first compiles, the others read the persistent cache)."""
    from laps_jax.workload.http_compare import free_port, wait_ready
    answers = []
    for start in range(3):
        port = free_port()
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"readme_serve_{port}.log"),
                   "w+")
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "serve.py"),
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, 600)
            out = _chat(f"http://127.0.0.1:{port}")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, f"start {start}: exit code {proc.returncode}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            text = log.read()
            log.close()
        assert out["choices"][0]["finish_reason"] in ("length", "stop")
        assert out["usage"]["completion_tokens"] >= 1
        answers.append(out["choices"][0]["message"]["content"])
        lines = [l for l in text.replace("\r", "\n").splitlines() if l.strip()]
        ours = "\n".join(l for l in lines if not _cuda_plugin_loader_line(l))
        assert "Traceback" not in text and "WARNING" not in ours, text
        # the context follows the model (the built-in model's 2,048 tokens), said once
        assert any(l.startswith("context 2048 tokens") for l in lines), text
        assert any(l.startswith("ran each bucket once") for l in lines), text
        assert "start-up took" in [l for l in lines if l.startswith("ready:")][0]
    assert len(set(answers)) == 1  # greedy: the same answer from every start


# (layout name in conftest.CHECKPOINTS): head_dim 16/32/64/128, MHA and GQA 2:1, 4:1, 7:1,
# 8:1, tied and untied embeddings
LAYOUTS = ["gqa2_untied", "gqa4_hd32", "gqa7_one_kv", "mha_hd64_tied", "gqa8_hd128"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_batch_defaults_match_transformers(layout, checkpoint, tmp_path):
    """prefill_batch.py with no engine flag: the default 2,048-token grid and context, only the
    buckets this input needs compiled; next-token and prompt log-probs as transformers'."""
    import prefill_batch
    path = checkpoint(layout)
    rng = np.random.default_rng(hash(layout) % 2**32)
    vocab = load_hf_tokenizer(path).vocab_size
    lengths = (3, 37, 150, 300, 700)
    lines = [json.dumps({"id": f"r{n}", "prompt_token_ids": rng.integers(0, vocab, n).tolist()})
             for n in lengths]
    lines.insert(2, json.dumps({"id": "chat", "messages": [
        {"role": "user", "content": "Name three colours, please."}]}))
    lines.insert(1, "")  # a blank line keeps its place
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    rc = prefill_batch.main(["--model", path, "--input", str(inp), "--output", str(out),
                             "--prompt-logprobs", "--no-progress"])
    assert rc == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) == len(lines)
    assert "blank line" in rows[1]["error"]
    model, tok = load_hf_model(path), load_hf_tokenizer(path)
    for line, row in zip(lines, rows):
        if not line:
            continue
        req = json.loads(line)
        ids = req.get("prompt_token_ids") or tok.apply_chat_template(
            req["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
        assert row["id"] == req["id"] and row["num_prompt_tokens"] == len(ids)
        best = np.argsort(-ref[-1])[:5]
        assert [t for t, _ in row["top_logprobs"]] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in row["top_logprobs"]], ref[-1][best],
                                   atol=2e-3)
        np.testing.assert_allclose(row["prompt_logprobs"][1:],
                                   ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-3)


def _serve_args(*flags: str):
    from laps_jax.server.run import build_parser
    return build_parser().parse_args(["--model", "tiny", *flags])


# --max-model-len x --max-chunk (None: the default) -> None if it starts, else a piece of the
# one-line refusal. The tiny preset's context is 4,096 tokens.
MATRIX = {(m, c): None for m in (256, 1000, 1024, 2048, 4096) for c in (None, 512)}
MATRIX[256, 512] = "--max-chunk 512 is longer than --max-model-len, 256 tokens"


@pytest.mark.parametrize("max_len,chunk", sorted(MATRIX, key=lambda k: (k[0], k[1] or 0)))
def test_startup_matrix(max_len, chunk):
    """Each combination builds an engine whose grid fits its context (no bucket longer than
    it, the chunk as asked) or is refused before anything is built. Compiling is checked on
    a few of them below: building the grid is what the settings decide."""
    eng = _matrix_engine(max_len, chunk, warmup=False)
    if eng is None:
        return
    assert eng.ecfg.max_model_len == max_len
    assert eng.grid.max_chunk == (chunk or min(2048, max_len))
    buckets = set(eng.executables.all_buckets())
    assert buckets and all(b.tokens <= max_len for b in buckets)
    assert max(b.tokens for b in buckets) >= min(eng.grid.max_chunk, max_len)


# one of each kind: a context that is not a power of two with a short chunk, the default
# context, a context that is its own chunk (every cell compiles its whole grid: ~30 s each)
@pytest.mark.slow
@pytest.mark.parametrize("max_len,chunk", [(1000, 512), (4096, None), (256, None)])
def test_startup_matrix_compiles_every_bucket(max_len, chunk):
    """A start compiles every bucket of its grid (and runs it once), none longer than the
    context."""
    eng = _matrix_engine(max_len, chunk, warmup=True)
    shapes = list(eng.runner.executables._compiled)
    assert shapes and all(b.tokens <= max_len for b in shapes)
    assert len(shapes) == len(set(eng.executables.all_buckets()))


def _matrix_engine(max_len, chunk, warmup: bool):
    """The engine serve.py --model tiny would build with these flags; None when refused (the
    refusal checked: one line, before anything is built)."""
    from laps_jax.cli import build_engine
    from laps_jax.engine.settings import SettingsError
    flags = ["--max-model-len", str(max_len)] + (["--max-chunk", str(chunk)] if chunk else [])
    args = _serve_args(*flags)
    refusal = MATRIX[max_len, chunk]
    if refusal:
        with pytest.raises(SettingsError) as e:
            build_engine(args, log=lambda m: None)
        assert refusal in str(e.value) and "\n" not in str(e.value)
        return None
    return build_engine(args, log=lambda m: None, warmup=warmup).engine


@pytest.mark.parametrize("flags,message", [
    (["--max-model-len", "8192", "--kv-cache-tokens", "4000"],
     "--max-model-len 4096 does not fit"),  # capped to the context first, then checked
    (["--max-model-len", "4096", "--kv-cache-tokens", "2048"],
     "--max-model-len 4096 does not fit the KV pool: --kv-cache-tokens 2048"),
    (["--kv-cache-tokens", "8", "--page-size", "16"], "holds no KV page"),
    (["--page-size", "0"], "--page-size must be a positive integer, got 0"),
    (["--max-decode-batch", "-1"], "--max-decode-batch must be a positive integer"),
    (["--kv-cache-tokens", "64", "--page-size", "16", "--max-prefill-batch", "2",
      "--max-decode-batch", "8"],
     "--max-decode-batch 8 needs at least 8 KV pages"),
    (["--max-chunk", "8192"], "--max-chunk 8192 is longer than the context, 4096 tokens"),
    (["--dot-tuning-tokens", "1024"], "--dot-tuning-tokens was removed"),
])
def test_settings_refused_in_one_line(flags, message):
    from laps_jax.cli import engine_config_from_args
    from laps_jax.engine.settings import SettingsError
    with pytest.raises(SettingsError) as e:
        engine_config_from_args(_serve_args(*flags))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_context_follows_the_model_and_the_pool():
    from laps_jax.cli import engine_config_from_args
    e = engine_config_from_args(_serve_args())
    assert (e.max_model_len, e.max_chunk) == (4096, 2048)  # tiny: 4,096-token context
    e = engine_config_from_args(_serve_args("--kv-cache-tokens", "1000"))
    assert (e.max_model_len, e.max_chunk) == (992, 992)  # 62 pages of 16 hold 992 tokens


@pytest.mark.parametrize("script", ["serve.py", "prefill_batch.py", "compare_modes.py"])
def test_scripts_refuse_bad_settings_without_traceback(script, tmp_path):
    extra = {"prefill_batch.py": ["--model", "tiny", "--input", os.devnull, "--output",
                                  str(tmp_path / "o.jsonl")],
             "compare_modes.py": ["--trace", os.devnull, "--trace-format", "azure",
                                  "--output-dir", str(tmp_path)]}.get(script, [])
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *extra,
                          "--max-model-len", "2048", "--max-chunk", "4096"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    err = [l for l in out.stderr.splitlines() if l.startswith("error:")]
    assert err == ["error: --max-chunk 4096 is longer than --max-model-len, 2048 tokens: no "
                   "prompt could fill it; lower --max-chunk"], out.stderr
