"""The GPU server's programs lowered for `cuda` on a machine without a GPU.

JAX lowers for a platform the machine lacks: `jax.jit(f).trace(*shapes).lower(
lowering_platforms=("cuda",))`. This builds an engine over weights and KV pages given as shapes
(`jax.ShapeDtypeStruct`, with their tensor-parallel shardings: nothing is allocated), with the
settings a GPU server uses (bfloat16, the `scan` layer loop, the Pallas attention kernels
lowered to Triton, not interpreted), and lowers every executable its compile owner would
compile (`EngineExecutables.planned`: each prefill and decode bucket, then the KV hand-off
copies), so the list cannot drift from what the server runs. It catches what JAX checks while
tracing and lowering: Triton block shapes and dtypes, shard_map specs against the mesh, shape
errors. It cannot catch what only XLA's GPU compiler or the device would (the SPMD partitioner,
memory use, register pressure, speed): that is `scripts/device_check.py` on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from laps_jax.config import EngineConfig, ModelConfig
from laps_jax.engine.buckets import Bucket
from laps_jax.engine.engine import Engine
from laps_jax.models.qwen2 import abstract_state
from laps_jax.pallas_kernels.dispatch import INTERPRET_ENV


@dataclasses.dataclass
class LoweredProgram:
    """One executable's lowering: what it is, how long it took, and the error if it failed."""

    name: str
    shapes: str
    seconds: float
    error: str | None = None

    def format(self) -> str:
        status = "ok" if self.error is None else f"FAILED {self.error}"
        return f"{self.name:<24}{self.shapes:<44}{self.seconds:>7.2f} s  {status}"


@dataclasses.dataclass
class LoweringReport:
    platform: str
    programs: list[LoweredProgram]
    seconds: float

    @property
    def failures(self) -> list[LoweredProgram]:
        return [p for p in self.programs if p.error is not None]

    def summary(self) -> str:
        return (f"lowered {len(self.programs) - len(self.failures)} of {len(self.programs)} "
                f"executables for {self.platform} in {self.seconds:.1f} s; "
                f"{len(self.failures)} failed")


@contextlib.contextmanager
def native_pallas() -> Iterator[None]:
    """Pallas kernels lowered to Triton (as on a GPU), not interpreted, while tracing."""
    old = os.environ.get(INTERPRET_ENV)
    os.environ[INTERPRET_ENV] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(INTERPRET_ENV, None)
        else:
            os.environ[INTERPRET_ENV] = old


def gpu_settings(ecfg: EngineConfig) -> EngineConfig:
    """The settings a GPU server runs with where `ecfg` leaves them to the platform."""
    return dataclasses.replace(ecfg, attention_backend=ecfg.attention_backend or "pallas",
                               layer_loop=ecfg.layer_loop or "scan")


def abstract_engine(cfg: ModelConfig, ecfg: EngineConfig, dtype: str = "bfloat16") -> Engine:
    """An engine over weights and KV pages that are shapes only: it can lower, never run."""
    params = nnx.to_pure_dict(abstract_state(cfg, jnp.dtype(dtype)))
    return Engine(cfg, params, gpu_settings(ecfg))


def describe(engine: Engine, key) -> tuple[str, str]:
    """(name, shapes) of one planned executable: a step bucket or a KV copy."""
    r = engine.runner
    if isinstance(key, Bucket):
        kind = "decode" if key.is_decode and not key.prompt_logprobs else "prefill"
        extra = "+logprobs" if key.prompt_logprobs else ""
        return f"{kind}{extra} {key.batch}x{key.tokens}", f"tokens [{key.batch}, {key.tokens}]"
    kind, n = key
    return (f"kv {kind} {n} pages", f"K/V [{r.cfg.num_layers}, {n}, {r.page_size}, "
                                    f"{r.cfg.num_kv_heads}, {r.cfg.head_dim}]")


def lower_all(engine: Engine, platform: str = "cuda", prompt_logprobs: bool = False,
              report: Callable[[LoweredProgram], None] | None = None) -> LoweringReport:
    """Lowers every executable the engine's compile owner plans, for `platform`; a failure is
    recorded (the exception's first line) and the rest still lowered."""
    programs = []
    t0 = time.perf_counter()
    with native_pallas():
        for cache, key in engine.executables.planned(prompt_logprobs):
            name, shapes = describe(engine, key)
            t = time.perf_counter()
            error = None
            try:
                cache.lower(key, (platform,))
            except Exception as e:  # noqa: BLE001 (report every failing program, go on)
                error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            programs.append(LoweredProgram(name, shapes, time.perf_counter() - t, error))
            if report:
                report(programs[-1])
    return LoweringReport(platform, programs, time.perf_counter() - t0)


__all__ = ["LoweredProgram", "LoweringReport", "abstract_engine", "gpu_settings", "lower_all",
           "native_pallas"]
