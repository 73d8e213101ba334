"""The scheduler and the simulator run without JAX: the serving core speaks to an executor
protocol and plain-Python bucket geometry, never to the engine's arrays."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a meta-path finder that makes jax, jaxlib and flax unimportable, then runs the given code
NO_JAX = """
import sys
class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):
            raise ImportError('jax is not importable in this test: ' + name)
sys.meta_path.insert(0, NoJax())
"""


def run_without_jax(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_JAX + code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_the_blocker_blocks():
    out = run_without_jax("import jax")
    assert out.returncode != 0 and "not importable" in out.stderr


def test_scheduler_and_simulator_import_and_run_without_jax(tmp_path):
    """Importing the serving core and the simulator, and a whole simulated replay of the Azure
    trace through the real dispatcher, with JAX made unimportable."""
    result = tmp_path / "sim.json"
    code = f"""
import laps_jax.scheduler, laps_jax.sim, laps_jax.bench.validate, laps_jax.bench.compare
assert not any(m.split('.')[0] == 'jax' for m in sys.modules)
sys.argv = ['simulate.py', 'run', '--workload', 'azure', '--mode', 'laps', '--load', '0.7',
            '--requests', '60', '--output', {str(result)!r}]
sys.path.insert(0, 'scripts')
import runpy
runpy.run_path('scripts/simulate.py', run_name='__main__')
"""
    out = run_without_jax(code)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(result.read_text())["summary"]
    assert summary["completed"] == 60 and summary["failed"] == 0
    assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p90"]
