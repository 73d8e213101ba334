"""`serve.py --dry-run`: the plan of a server, from shapes alone, before anything is allocated.

Prints the memory plan (weights and KV bytes per token on each device, KV tokens that fit), the
bucket grid the engine would compile and the LAPS short/long threshold of the H200 roofline,
then exits: 0 when the settings fit the device, 1 (with the numbers) when they do not. Nothing
is loaded, allocated or compiled, so a Qwen2.5-32B plan for 8 H200s runs on a laptop.

With `--compile` (the `gpu-aot` extra) every executable of the plan is compiled by XLA's GPU
compiler for --device (engine/aot.py) and the largest temp buffer of any of them takes the place
of the flat 10% kept for activations (models/plan.py): minutes on a CPU for Qwen2.5-32B.
"""

from __future__ import annotations

import sys

from laps_jax.builder import describe_settings
from laps_jax.config import resolve_model
from laps_jax.engine import settings
from laps_jax.engine.buckets import BucketGrid
from laps_jax.models.plan import GB, MemoryPlan, device_gb, memory_plan
from laps_jax.scheduler.latency_model import H200, LatencyModel

CACHED = (0, 2048, 8192)  # cached-history lengths the threshold is shown at


def add_args(g) -> None:
    g.add_argument("--dry-run", action="store_true",
                   help="print the memory plan, the bucket grid and the LAPS threshold for "
                        "--device, then exit (non-zero if it does not fit); nothing is loaded")
    g.add_argument("--device", default="h200",
                   help="with --dry-run: the device planned for (h200, h100, a100-80g, "
                        "a100-40g, or its memory in GB) (default: h200)")
    g.add_argument("--compile", action="store_true",
                   help="with --dry-run: compile every executable for --device (h200 or h100; "
                        "needs the gpu-aot extra) and plan with the compiler's temp bytes")


def does_not_fit(plan: MemoryPlan, pool_tokens: int) -> str | None:
    """Why the plan cannot run (one line with the numbers), or None."""
    tp = f" at --tensor-parallel {plan.tensor_parallel}" if plan.tensor_parallel > 1 else ""
    if plan.free_bytes <= 0:
        temps = f" and {plan.temp_bytes / GB:.2f} GB of temps" if plan.temp_source else ""
        return (f"the weights do not fit{tp}: {plan.weight_bytes / GB:.2f} GB per device"
                f"{temps}, {(plan.device_bytes - plan.reserved_bytes) / GB:.2f} GB usable "
                f"({plan.device_bytes / GB:.1f} GB less the reserve)")
    if pool_tokens > plan.kv_tokens:
        need = pool_tokens * plan.kv_bytes_per_token / GB
        return (f"--kv-cache-tokens {pool_tokens} does not fit{tp}: {need:.2f} GB of KV per "
                f"device, {plan.free_bytes / GB:.2f} GB left after the weights "
                f"({plan.kv_tokens:,} tokens); lower --kv-cache-tokens or raise "
                "--tensor-parallel")
    return None


def compiled_temp(cfg, ecfg, dtype: str, device: str, progress=None) -> tuple[int, str]:
    """(largest temp bytes of any planned executable, which one and for what), from XLA's GPU
    compiler for `device`; ValueError when an executable does not compile or no plugin."""
    from laps_jax.engine.gpu_targets import compile_devices, plugin_installed, INSTALL_HINT
    if not plugin_installed():
        raise ValueError(INSTALL_HINT)
    from laps_jax.engine.aot import abstract_engine, compile_all
    devices = compile_devices(device, ecfg.tensor_parallel)
    report = compile_all(abstract_engine(cfg, ecfg, dtype, devices), True, progress,
                         device=device)
    if report.failures:
        bad = report.failures[0]
        raise ValueError(f"{len(report.failures)} executable(s) do not compile for {device}: "
                         f"{bad.name}: {bad.error}")
    big = report.largest_temp
    return big.temp_bytes, (f"largest of {len(report.programs)} executables, {big.name}, "
                            f"compiled for {devices[0].device_kind}")


def dry_run(args, out=print) -> int:
    """The plan for the flags in `args` (serve.py's); 0 fits, 1 does not. Raises ValueError
    (ConfigError, SettingsError) for a bad model, device or settings."""
    cfg = resolve_model(args.model)[0]
    ecfg = settings.resolve(settings.from_args(args), cfg)
    dtype = args.dtype or "bfloat16"  # planned for a GPU
    gb = device_gb(args.device)
    temp, source = 0, ""
    if getattr(args, "compile", False):
        from laps_jax.engine.gpu_targets import device_memory_bytes
        gb = device_memory_bytes(args.device) / GB  # what the driver reports: JAX's share is of it
        print(f"compiling every executable for {args.device} (minutes for a large model)",
              file=sys.stderr, flush=True)
        temp, source = compiled_temp(cfg, ecfg, dtype, args.device,
                                     lambda p: print(p.format(), file=sys.stderr, flush=True))
    plan = memory_plan(cfg, dtype, gb, tensor_parallel=ecfg.tensor_parallel, temp_bytes=temp,
                       temp_source=source)
    what = "compiled, nothing loaded or allocated" if source else \
        "nothing loaded, allocated or compiled"
    out(f"dry run: {args.model} on {args.device} ({what})")
    out(plan.format())
    out("engine           " + describe_settings(ecfg, BucketGrid.of_settings(ecfg)))
    # per device, a TP split divides FLOPs and bytes alike: the crossover is the same
    lm = LatencyModel(cfg, 2 if dtype == "bfloat16" else 4, H200)
    out("LAPS threshold   " + ", ".join(f"{lm.threshold(c)} new tokens over {c} cached"
                                         for c in CACHED)
        + f" (H200 roofline: {H200.peak_flops / 1e12:.0f} TFLOP/s, "
          f"{H200.mem_bandwidth / 1e12:.1f} TB/s)")
    pool = (ecfg.num_pages - 1) * ecfg.page_size
    why = does_not_fit(plan, pool)
    if why:
        out(f"refused: {why}")
        return 1
    out(f"fits: KV pool {pool:,} tokens of {plan.kv_tokens:,} that fit")
    return 0


__all__ = ["add_args", "compiled_temp", "does_not_fit", "dry_run"]
