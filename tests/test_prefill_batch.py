"""scripts/prefill_batch.py end to end: output against transformers, bad lines, shared prefixes,
and the pallas attention backend (interpret mode) giving the same log-probs as xla."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_fixtures import load_hf_model, load_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--max-chunk", "64", "--max-prefill-batch", "2", "--max-decode-batch", "1",
         "--max-model-len", "256", "--kv-cache-tokens", "4096", "--page-size", "8",
         "--no-progress"]


def run_job(model, lines, tmp_path, *extra, name="out"):
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prefill_batch
    rc = prefill_batch.main(["--model", model, "--input", str(inp), "--output", str(out),
                             *SMALL, *extra])
    assert rc == 0
    return [json.loads(l) for l in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def job(checkpoint, tmp_path_factory):
    path = checkpoint("gqa2_untied")
    shared = "In the beginning the Universe was created. This has made a lot of people very angry"
    lines = [
        json.dumps({"id": "a", "prompt": shared + " and been widely regarded as a bad move."}),
        "{broken json",
        json.dumps({"id": "b", "prompt": shared + ", said the guide."}),
        json.dumps({"id": "c", "messages": [{"role": "user", "content": "What is a list?"}]}),
        json.dumps({"id": "d", "prompt_token_ids": [3, 99999]}),
        json.dumps({"id": "e", "prompt": ""}),
        json.dumps({"id": "f", "prompt_token_ids": list(range(10, 300))}),  # > max-model-len
        json.dumps({"id": "g", "prompt_token_ids": [17, 4, 250, 9, 33]}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"id": "h", "messages": [{"role": "user"}]}),
    ]
    tmp = tmp_path_factory.mktemp("job")
    return path, lines, run_job(path, lines, tmp, "--top-logprobs", "5", "--prompt-logprobs")


def test_output_order_and_errors_on_their_own_lines(job):
    _, lines, rows = job
    assert len(rows) == len(lines)
    ids = [r.get("id") for r in rows]
    assert ids[0] == "a" and ids[2] == "b" and ids[3] == "c" and ids[7] == "g"
    assert "invalid JSON" in rows[1]["error"] and "line 2" in rows[1]["error"]
    assert "outside the vocabulary" in rows[4]["error"]
    assert "empty" in rows[5]["error"]
    assert "256" in rows[6]["error"]  # the limit is named
    assert "JSON object" in rows[8]["error"]
    assert "messages[0].content must be a string" in rows[9]["error"]  # as the server says
    for i in (0, 2, 3, 7):
        assert "error" not in rows[i]


def test_logprobs_match_transformers(job):
    path, lines, rows = job
    model, tok = load_hf_model(path), load_hf_tokenizer(path)
    for i in (0, 2, 3, 7):
        req = json.loads(lines[i])
        if "prompt" in req:
            ids = tok(req["prompt"])["input_ids"]
        elif "messages" in req:
            ids = tok.apply_chat_template(req["messages"], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            ids = req["prompt_token_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
        row = rows[i]
        assert row["num_prompt_tokens"] == len(ids)
        order = np.argsort(-ref[-1])[:5]
        assert [t for t, _ in row["top_logprobs"]] == order.tolist()
        np.testing.assert_allclose([lp for _, lp in row["top_logprobs"]], ref[-1][order], atol=1e-3)
        plp = row["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        np.testing.assert_allclose(plp[1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-3)


def test_shared_prefix_is_reused(job):
    _, _, rows = job
    assert rows[0]["num_cached_tokens"] > 0 and rows[2]["num_cached_tokens"] > 0


def test_pallas_backend_matches_xla(checkpoint, tmp_path):
    path = checkpoint("gqa4_hd32")
    lines = [json.dumps({"id": i, "prompt_token_ids": np.random.default_rng(i).integers(
        0, 1000, n).tolist()}) for i, n in enumerate((5, 30, 70))]
    a = run_job(path, lines, tmp_path, "--prompt-logprobs", "--attention-backend", "xla", name="x")
    b = run_job(path, lines, tmp_path, "--prompt-logprobs", "--attention-backend", "pallas",
                name="p")
    for ra, rb in zip(a, b):
        np.testing.assert_allclose(ra["prompt_logprobs"][1:], rb["prompt_logprobs"][1:], atol=1e-4)
        np.testing.assert_allclose([x[1] for x in ra["top_logprobs"]],
                                   [x[1] for x in rb["top_logprobs"]], atol=1e-4)


def test_cli_help_and_bad_args():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prefill_batch.py"),
                          "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--prompt-logprobs" in out.stdout
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prefill_batch.py"),
                          "--model", "tiny", "--input", "x", "--output", "y",
                          "--top-logprobs", "50"], capture_output=True, text=True)
    assert out.returncode == 2 and "between 0 and 20" in out.stderr


def test_every_input_line_gets_its_line_in_order(checkpoint, tmp_path, monkeypatch):
    """Broken bytes, blank lines, deep nesting, a 5,000-digit number and a line whose prefill
    fails sit among good lines: each gets its own line, in order, and the good ones their
    results (the same as when run alone)."""
    path = checkpoint("gqa2_untied")
    good = [json.dumps({"id": f"g{i}", "prompt_token_ids": list(range(5 + i, 40 + 3 * i))})
            for i in range(4)]
    boom = json.dumps({"id": "boom", "prompt_token_ids": [7] * 21})
    raw = [good[0].encode(), b"\xff\xfe not utf-8", b"", good[1].encode(), b"[" * 100000,
           b'{"id": "big", "prompt_token_ids": [' + b"9" * 5000 + b"]}", boom.encode(),
           b"   ", good[2].encode(), good[3].encode()]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join(raw) + b"\n")
    from laps_jax.engine import runner as runner_mod
    pack = runner_mod.ModelRunner.pack

    def failing_pack(self, seqs, bucket):  # the row of 21 sevens breaks any step it is in
        if any(len(s.new_tokens) == 21 and set(s.new_tokens) == {7} for s in seqs):
            raise RuntimeError("injected failure")
        return pack(self, seqs, bucket)
    monkeypatch.setattr(runner_mod.ModelRunner, "pack", failing_pack)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prefill_batch
    assert prefill_batch.main(["--model", path, "--input", str(inp), "--output", str(out),
                               *SMALL, "--window", "4"]) == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) == len(raw)
    assert [r.get("id") for r in rows] == ["g0", None, None, "g1", None, None, "boom", None,
                                           "g2", "g3"]
    assert "UTF-8" in rows[1]["error"] and "line 2" in rows[1]["error"]
    assert "blank" in rows[2]["error"] and "blank" in rows[7]["error"]
    assert "nested too deeply" in rows[4]["error"]
    assert "line 6" in rows[5]["error"]
    assert "injected failure" in rows[6]["error"]
    monkeypatch.setattr(runner_mod.ModelRunner, "pack", pack)
    alone = run_job(path, good, tmp_path, name="alone")
    for r, a in zip([rows[i] for i in (0, 3, 8, 9)], alone):
        np.testing.assert_allclose(r["top_logprobs"], a["top_logprobs"], atol=1e-5)


def test_resume_carries_on_after_an_interrupted_run(checkpoint, tmp_path):
    path = checkpoint("gqa2_untied")
    lines = [json.dumps({"id": i, "prompt_token_ids": list(range(3, 10 + i))}) for i in range(6)]
    full = run_job(path, lines, tmp_path, name="full")
    inp, out = tmp_path / "r.in.jsonl", tmp_path / "r.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    text = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    out.write_text("".join(text[:2]) + text[2][:15])  # two lines, then a cut-off write
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prefill_batch
    assert prefill_batch.main(["--model", path, "--input", str(inp), "--output", str(out),
                               *SMALL, "--resume"]) == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(6))
    for r, f in zip(rows, full):
        np.testing.assert_allclose(r["top_logprobs"], f["top_logprobs"], atol=1e-5)
    other = tmp_path / "other.jsonl"  # not this input's output: refused, nothing appended
    other.write_text(json.dumps({"id": "zzz"}) + "\n")
    assert prefill_batch.main(["--model", path, "--input", str(inp), "--output", str(other),
                               *SMALL, "--resume"]) == 2
    assert other.read_text() == json.dumps({"id": "zzz"}) + "\n"
