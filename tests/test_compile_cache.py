"""An unreadable persistent-cache entry is replaced by the compile that follows it, so the next
start loads it again; the counts behind the start-up log say which happened. Each start is a
fresh process (the cache is read once per executable per process)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from laps_jax.engine import compile_cache
from laps_jax.engine.executables import enable_persistent_cache
enable_persistent_cache(sys.argv[1])
def laps_probe(x):
    return jnp.sin(x) * 3 + 1
jax.block_until_ready(jax.jit(laps_probe)(np.arange(4, dtype=np.float32)))
print(json.dumps(compile_cache.stats().__dict__))
"""


def start(cache_dir: str) -> dict:
    """One process that compiles the probe with the cache on: its CacheStats."""
    r = subprocess.run([sys.executable, "-c", PROBE, cache_dir], capture_output=True,
                       text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


CORRUPTIONS = {
    "truncated": lambda data: data[: len(data) // 3],  # fails to decompress
    # decompresses, but the executable inside is cut short (fails to deserialize)
    "bad_payload": lambda data: zlib.compress(zlib.decompress(data)[:200]),
}


@pytest.fixture(scope="module")
def entry(tmp_path_factory) -> tuple[str, str]:
    """A cache directory after one cold start, and the probe's entry in it. The key depends on
    the directory, so each case corrupts this entry in place (and leaves it healthy)."""
    d = str(tmp_path_factory.mktemp("xla"))
    assert start(d) == {"requests": 1, "hits": 0, "replaced": 0}
    (path,) = glob.glob(os.path.join(d, "jit_laps_probe-*-cache"))
    return d, path


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_entry_is_replaced_and_later_starts_hit(entry, kind):
    d, path = entry
    with open(path, "rb") as f:
        good = f.read()
    try:
        bad = CORRUPTIONS[kind](good)
    except zlib.error:  # the entry is not zlib (zstandard installed): garble it instead
        bad = good[:8] + bytes(200)
    with open(path, "wb") as f:
        f.write(bad)
    assert start(d) == {"requests": 1, "hits": 0, "replaced": 1}
    with open(path, "rb") as f:
        rewritten = f.read()
    assert rewritten != bad and len(rewritten) > len(good) // 2
    assert start(d) == {"requests": 1, "hits": 1, "replaced": 0}


def test_describe_reports_what_the_cache_served():
    from laps_jax.engine.compile_cache import CacheStats
    assert CacheStats(14, 12).describe() == "12 of 14 executables loaded from it, 2 compiled"
    assert "1 unreadable entries replaced" in CacheStats(3, 0, 1).describe()
    assert CacheStats().describe().startswith("not used")
    assert CacheStats(5, 4, 1) - CacheStats(2, 2, 0) == CacheStats(3, 2, 1)
