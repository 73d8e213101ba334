"""Shared pieces of the simulator tests: a tiny model on a toy device, whose steps can be
checked by hand, and a replay of (time, prompt length) arrivals through the real dispatcher."""

from __future__ import annotations

import dataclasses

import pytest

from laps_jax.config import PRESETS
from laps_jax.engine.sequence import SamplingParams
from laps_jax.scheduler.clock import SimClock, run_simulated
from laps_jax.scheduler.latency_model import DeviceSpec, LatencyModel, StepShape
from laps_jax.scheduler.policy import SchedulerConfig
from laps_jax.scheduler.window import WindowConfig
from laps_jax.sim.instance import GridSpec, InstanceSpec, build_dispatcher

CFG = PRESETS["tiny"]
MODEL = LatencyModel(CFG, 4, DeviceSpec("toy", 1e9, 1e12, 0.010))  # compute-bound past ~1 token
GRID = GridSpec(max_chunk=256, min_chunk=16, max_prefill_batch=8, max_decode_batch=8)


def step(rows: list[int], width: int) -> float:
    """Predicted latency of one prefill step in the (rows, width) bucket."""
    b = 1 << (len(rows) - 1).bit_length()
    return MODEL.predict(StepShape.bucketed(tuple(rows), (0,) * len(rows), b, width))


def spec(mode: str, threshold: int = 64, window: WindowConfig | None = None,
         long_chunk_ratio: float | None = None) -> InstanceSpec:
    """(Long chunks are the full budget unless a ratio is given: hand-checkable steps.)"""
    return InstanceSpec(mode, GRID, kv_cache_tokens=8192, max_model_len=2048,
                        scheduler=SchedulerConfig(threshold=threshold,
                                                  window=window or WindowConfig(mode="off"),
                                                  long_chunk_ratio=long_chunk_ratio))


def replay(inst: InstanceSpec, arrivals: list[tuple[float, int]]) -> list:
    """Submits (time, prompt length) requests with one output token; their stats in order."""
    async def main():
        clock = SimClock()
        d = build_dispatcher(inst, CFG, MODEL, clock)
        await d.start()
        handles = []
        for i, (t, n) in enumerate(arrivals):
            await clock.sleep(t - clock.now())
            handles.append(d.submit([10 + (i * 131 + j) % 400 for j in range(n)],
                                    SamplingParams(max_tokens=1), request_id=f"r{i}"))
        stats = [await h.result() for h in handles]
        await d.stop()
        return stats
    return run_simulated(main())


def simulated_compare(tmp_path, logs: list[str] | None = None, **changes) -> dict:
    """compare_modes --simulate --repeats 2 over 60 Azure requests into tmp_path."""
    from pathlib import Path

    from laps_jax.config import EngineConfig
    from laps_jax.bench.compare import CompareOptions, run_comparison
    repo = Path(__file__).resolve().parents[1]
    trace = next((p for p in (repo.parent / "shared" / "traces" / "azure_llm_2023_conv.csv",
                              Path("/work/shared/traces/azure_llm_2023_conv.csv")) if p.exists()),
                 None)
    if trace is None:
        pytest.skip("azure_llm_2023_conv.csv not found")
    o = CompareOptions(model="bench-cpu", trace=str(trace), trace_format="azure",
                       output_dir=str(tmp_path), modes=("mixed", "laps"),
                       ecfg=EngineConfig(max_chunk=512, max_decode_batch=16,
                                         kv_cache_tokens=32768),
                       max_requests=60, length_scale=0.1, threshold=26, time_scale=0.3,
                       profile=str(repo / "docs" / "data" / "profile_bench_cpu.json"),
                       simulate=True, repeats=2)
    o = dataclasses.replace(o, **changes)
    return run_comparison(o, (logs if logs is not None else []).append)
