"""Discrete-event simulation of LAPS serving at H200 scale, validated against this machine.

The scheduler's own dispatcher, pools, waiting window and bucket choice, and the cluster's
router, run on virtual
time (`scheduler.clock.run_simulated`); only the device is simulated, by a latency model (a
roofline from device figures, or a CPU profile). See docs/SIMULATION.md.

    from laps_jax.sim import hardware, workload, RunSpec, InstanceSpec, simulate, summarize
    src = hardware.roofline("qwen2.5-32b")                      # H200 figures, bf16
    w = workload.load("azure", "../shared/traces/azure_llm_2023_conv.csv", max_requests=800)
    spec = RunSpec(InstanceSpec("laps", kv_cache_tokens=hardware.kv_capacity_tokens(
        src.cfg, src.hardware)), rate=8.0)
    print(summarize(simulate(spec, src, w), spec, src))

Modules: hardware (device figures, latency-model sources, physical limit), engine (the stand-in
engine and its `StepExecutor`), executor (simulated steps, shared device), instance (one
dispatcher over simulated executors), workload (traces and sessions at a rate), driver (one
run), summary (its numbers), sweep / study / tables / plots (the study), cli (options of
scripts/simulate.py). Validation against a real compare_modes run is the harness's
(bench/validate.py).

May import: scheduler, cluster, engine (its plain-Python modules), workload; never bench (the
harness imports the simulator: compare_modes --simulate, validation), server, models or
pallas_kernels, and no JAX.
"""

from laps_jax.sim.driver import RunResult, RunSpec, simulate  # noqa: F401
from laps_jax.sim.instance import GridSpec, InstanceSpec  # noqa: F401
from laps_jax.sim.summary import summarize  # noqa: F401
