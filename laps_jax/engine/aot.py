"""The GPU server's executables compiled for a GPU this machine does not have.

This builds an engine over weights and KV pages given as shapes (`jax.ShapeDtypeStruct` placed
on compile-only devices, engine/gpu_targets.py: nothing is allocated) with the settings a GPU
server uses (bfloat16, the `scan` layer loop, the Pallas attention kernels lowered to Triton,
not interpreted), and compiles every executable its compile owner plans
(`EngineExecutables.planned`: each prefill and decode bucket, the prompt log-prob buckets, the
KV hand-off copies that laps-spatial and the prefill/decode split move pages with), so the list
cannot drift from what the server runs. XLA's GPU compiler runs for real: the SPMD partitioner
over N devices, Triton's shared memory and registers for the kernels, buffer assignment (each
executable's argument, output and temp bytes). What it cannot show is numerics and speed on
the device: that is `scripts/device_check.py` on a GPU.
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
from laps_jax.engine.executable_store import fresh_compiles
from laps_jax.models.qwen2 import abstract_state
from laps_jax.pallas_kernels.dispatch import INTERPRET_ENV

MiB = 2**20


@dataclasses.dataclass
class CompiledProgram:
    """One executable's compile: what it is, how long it took, its buffers, or its error."""

    name: str
    shapes: str
    seconds: float             # wall clock
    cpu_seconds: float = 0.0   # this process's CPU time (all its threads): less sensitive to
                               # other work on a shared machine than `seconds`
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    error: str | None = None

    def format(self) -> str:
        if self.error is not None:
            return f"{self.name:<26}{self.seconds:>7.2f} s  FAILED {self.error}"
        return (f"{self.name:<26}{self.seconds:>7.2f} s ({self.cpu_seconds:6.1f} s CPU)  args "
                f"{self.argument_bytes / MiB:9.1f} MiB  out {self.output_bytes / MiB:8.1f} MiB  temp "
                f"{self.temp_bytes / MiB:8.1f} MiB")


@dataclasses.dataclass
class CompileReport:
    platform: str
    device: str
    tensor_parallel: int
    programs: list[CompiledProgram]
    seconds: float

    @property
    def failures(self) -> list[CompiledProgram]:
        return [p for p in self.programs if p.error is not None]

    @property
    def largest_temp(self) -> CompiledProgram | None:
        ok = [p for p in self.programs if p.error is None]
        return max(ok, key=lambda p: p.temp_bytes) if ok else None

    def summary(self) -> str:
        big = self.largest_temp
        most = f"; largest temp {big.temp_bytes / MiB:.1f} MiB ({big.name})" if big else ""
        return (f"compiled {len(self.programs) - len(self.failures)} of {len(self.programs)} "
                f"executables for {self.device} x{self.tensor_parallel} in {self.seconds:.1f} s; "
                f"{len(self.failures)} failed{most}")

    def to_json(self) -> dict:
        return {"platform": self.platform, "device": self.device,
                "tensor_parallel": self.tensor_parallel, "seconds": round(self.seconds, 2),
                "programs": [dataclasses.asdict(p) for p in self.programs]}


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


def abstract_engine(cfg: ModelConfig, ecfg: EngineConfig, dtype: str = "bfloat16",
                    devices=None) -> Engine:
    """An engine over weights and KV pages that are shapes only, on `devices` (compile-only
    GPUs; default this process's): it can compile, never run."""
    params = nnx.to_pure_dict(abstract_state(cfg, jnp.dtype(dtype)))
    if devices is not None and ecfg.tensor_parallel == 1:
        one = jax.sharding.SingleDeviceSharding(devices[0])
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                              params)
    return Engine(cfg, params, gpu_settings(ecfg), devices=devices)


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


def first_line(e: BaseException) -> str:
    """The compiler's (or tracer's) first line of an error, with its type."""
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:300]}"


def compile_program(name: str, shapes: str, build: Callable[[], object]) -> CompiledProgram:
    """Runs `build` (returns a `jax.stages.Compiled`) and records its seconds and buffers, or
    the first line of its error: one failing program must not hide the rest."""
    t, c = time.perf_counter(), time.process_time()
    try:
        stats = build().memory_analysis()
        p = CompiledProgram(name, shapes, 0.0, 0.0, stats.argument_size_in_bytes,
                            stats.output_size_in_bytes, stats.temp_size_in_bytes)
    except Exception as e:  # noqa: BLE001 (report every failing program, go on)
        p = CompiledProgram(name, shapes, 0.0, error=first_line(e))
    p.seconds, p.cpu_seconds = time.perf_counter() - t, time.process_time() - c
    return p


def compile_all(engine: Engine, prompt_logprobs: bool = False,
                report: Callable[[CompiledProgram], None] | None = None,
                device: str = "", platform: str = "cuda",
                only: Callable[[object], bool] | None = None) -> CompileReport:
    """Compiles every executable the engine's compile owner plans (or those `only` keeps),
    kept in its caches for `executable_store.save`; a failure is recorded with its first
    line and the rest still compiled. The persistent compilation cache stays out of it: a
    compile-only client cannot read its entries back, a cached executable would not save
    (engine/executable_store.py), and the seconds are a compile's."""
    programs = []
    t0 = time.perf_counter()
    with native_pallas(), fresh_compiles():
        for cache, key in engine.executables.planned(prompt_logprobs):
            if only is not None and not only(key):
                continue
            programs.append(compile_program(*describe(engine, key),
                                            lambda: cache.compile(key)))
            if report:
                report(programs[-1])
    return CompileReport(platform, device, engine.ecfg.tensor_parallel, programs,
                         time.perf_counter() - t0)


__all__ = ["CompileReport", "CompiledProgram", "abstract_engine", "compile_all",
           "compile_program", "describe",
           "first_line", "gpu_settings", "native_pallas"]
