"""Saved executables (`device_check.py --compile-only --save`, `serve.py --executables`), on the
CPU with CPU-compiled executables: a saved bucket loads and nothing compiles, and every kind of
mismatch (versions, device count, settings, a corrupt, missing or swapped file, no manifest)
compiles that bucket as usual with one line saying why, never raises, never runs a wrong one."""

from __future__ import annotations

import json

import pytest

from laps_jax.config import PRESETS
from laps_jax.engine import executable_store as store
from laps_jax.engine.buckets import Bucket
from laps_jax.engine.engine import Engine
from laps_jax.engine.sequence import SamplingParams
from laps_jax.models.qwen2 import init_params

from conftest import small_engine_config

CFG = PRESETS["tiny"]
PARAMS = init_params(CFG, seed=11)
ECFG = dict(max_chunk=16, max_prefill_batch=1, max_decode_batch=1, max_model_len=64)
STEPS = [Bucket(1, 1), Bucket(1, 16)]  # what is saved: the two step buckets of the grid


def engine(**kw) -> Engine:
    return Engine(CFG, PARAMS, small_engine_config(**{**ECFG, **kw}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("exe")
    eng = engine()
    with store.fresh_compiles():
        eng.executables.compile(STEPS)
    assert store.save(eng, d) == 2
    return d, eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].output


def load(d, eng) -> tuple[int, list[str]]:
    said = []
    return store.load(eng, d, say=said.append), said


def test_saved_buckets_load_and_nothing_compiles(saved):
    d, tokens = saved
    eng = engine()
    n, said = load(d, eng)
    assert n == 2
    # the KV copies were not saved: they compile as usual, one line for them all
    assert said == [f"saved executables {d}: 6 not saved, they compile: kv-gather-1.bin, "
                    "kv-scatter-1.bin, kv-gather-4.bin, kv-scatter-4.bin, ..."]
    eng.executables.compile(STEPS)
    assert eng.runner.executables.compile_seconds == 0.0
    assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].output == tokens


def copy_of(saved, tmp_path):
    d = tmp_path / "exe"
    d.mkdir()
    for f in saved[0].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d


def edit_manifest(d, **fields):
    man = json.loads((d / store.MANIFEST).read_text())
    man.update(fields)
    (d / store.MANIFEST).write_text(json.dumps(man))
    return man


def test_corrupt_file_compiles_that_bucket_only(saved, tmp_path):
    d = copy_of(saved, tmp_path)
    f = d / store.file_name(Bucket(1, 16))
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    f.write_bytes(bytes(blob))
    eng = engine()
    n, said = load(d, eng)
    assert n == 1 and Bucket(1, 1) in eng.runner.executables
    assert Bucket(1, 16) not in eng.runner.executables
    assert said[0] == (f"saved executables {d}: step-1x16.bin compiles: ValueError: its sha256 "
                       "differs from the manifest's (corrupt)")
    eng.executables.compile(STEPS)  # compiled as today
    assert eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].output == saved[1]


def test_a_file_of_another_bucket_is_refused(saved, tmp_path):
    """Same hash in the manifest, bytes of the decode bucket under the prefill bucket's name:
    the arguments do not match and it is not used."""
    d = copy_of(saved, tmp_path)
    dec, pre = store.file_name(Bucket(1, 1)), store.file_name(Bucket(1, 16))
    (d / pre).write_bytes((d / dec).read_bytes())
    man = json.loads((d / store.MANIFEST).read_text())
    edit_manifest(d, files={**man["files"], pre: man["files"][dec]})
    eng = engine()
    n, said = load(d, eng)
    assert n == 1 and Bucket(1, 16) not in eng.runner.executables
    assert any(f"{pre} compiles: ValueError: its arguments are not bucket" in s for s in said)


@pytest.mark.parametrize("fields, eng_kw, why", [
    ({"jax": "0.0.1"}, {}, "jax differ (saved '0.0.1'"),
    ({"device_kind": "NVIDIA H200"}, {}, "device_kind differ (saved 'NVIDIA H200'"),
    ({"devices": 8}, {}, "devices differ (saved 8, here 1)"),
    ({}, {"page_size": 16}, "model or engine settings differ"),
    ({}, {"kv_cache_tokens": 2048}, "model or engine settings differ"),
])
def test_mismatch_compiles_everything_with_one_line(saved, tmp_path, fields, eng_kw, why):
    d = copy_of(saved, tmp_path)
    edit_manifest(d, **fields)
    eng = engine(**eng_kw)
    n, said = load(d, eng)
    assert n == 0 and len(eng.runner.executables) == 0
    assert len(said) == 1 and "none loaded, every bucket compiles: " + why in said[0]


def test_no_or_bad_manifest(tmp_path):
    n, said = load(tmp_path / "nowhere", engine())
    assert n == 0 and len(said) == 1 and "cannot read manifest.json" in said[0]
    (tmp_path / store.MANIFEST).write_text("[1, 2")
    n, said = load(tmp_path, engine())
    assert n == 0 and len(said) == 1 and "cannot read manifest.json" in said[0]
