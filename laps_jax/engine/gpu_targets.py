"""NVIDIA GPUs this machine can compile for without having one: XLA's `GpuTargetConfig` text
protos and the compile-only devices (`jax.experimental.topologies`) built from them.

With `jax-cuda12-plugin` and `jax-cuda12-pjrt` installed (the `gpu-aot` extra), no driver and
no CUDA libraries needed, `get_topology_desc(platform="cuda", target_config=..., topology=
"1x1xN")` gives N compile-only devices of the described kind; arguments sharded over them make
`jax.jit(f).lower(...).compile()` run XLA's GPU compiler (SPMD partitioner, Triton for the
Pallas kernels, buffer assignment) as it would on the machine itself.

Where each number comes from (the field names are XLA's `GpuDeviceInfoProto`, as in its
`xla/tools/hlo_opt/gpu_specs/*.txtpb`):
- compute capability 9.0, 132 SMs (SXM5 parts), 1,024 threads a block and 2,048 an SM, warps of
  32, 65,536 32-bit registers an SM and a block, 128 FP32 lanes an SM, shared memory 228 KiB an
  SM (233,472 B) of which 227 KiB (232,448 B) a block can opt into, 48 KiB (49,152 B) without:
  NVIDIA's Hopper tuning guide and the CUDA C++ Programming Guide's table of technical
  specifications per compute capability (9.0); grid limits 2^31-1 x 65,535 x 65,535 likewise.
- L2 50 MiB, boost clock 1.98 GHz: NVIDIA H100 Tensor Core GPU architecture whitepaper (H200 is
  the same GH100 die and clocks with HBM3e).
- memory: H200 SXM 141 GB HBM3e at 4.8 TB/s, H100 SXM 80 GB HBM3 at 3.35 TB/s (NVIDIA H200 and
  H100 datasheets); `device_memory_size` is what the driver reports as total, 143,771 MiB for
  an H200 and 81,559 MiB for an H100 SXM (nvidia-smi).
- cuDNN 9.8 and CUDA runtime 12.8: what jax-cuda12-plugin 0.10.2 is built against; they only
  label the target (no library is loaded).
"""

from __future__ import annotations

import importlib.util

MiB = 2**20

# per-part numbers; the rest of the proto is Hopper's and shared
_PARTS = {
    "h200": dict(name="NVIDIA H200", memory=143771 * MiB, bandwidth=4_800_000_000_000),
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=81559 * MiB,
                 bandwidth=3_350_000_000_000),
}

_HOPPER = """gpu_device_info {{
  cuda_compute_capability {{ major: 9 minor: 0 }}
  core_count: 132
  fpus_per_core: 128
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  threads_per_warp: 32
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {memory}
  memory_bandwidth: {bandwidth}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{name}"
"""

DEVICES = tuple(_PARTS)
INSTALL_HINT = ('compiling for a GPU without one needs the CUDA plugin: '
                'pip install -e ".[gpu-aot]" (jax-cuda12-plugin and jax-cuda12-pjrt, '
                'the version of jaxlib)')


def target_config(device: str) -> str:
    """The GpuTargetConfig text proto of `device` (one of DEVICES); ValueError otherwise."""
    if device not in _PARTS:
        raise ValueError(f"--device: cannot compile for {device!r}; known: {', '.join(DEVICES)}")
    return _HOPPER.format(**_PARTS[device])


def device_memory_bytes(device: str) -> int:
    """The total the driver reports (JAX's allocator takes its share of this); ValueError for
    a device not in DEVICES."""
    target_config(device)
    return _PARTS[device]["memory"]


def plugin_installed() -> bool:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def compile_devices(device: str, n: int) -> list:
    """`n` compile-only devices of kind `device`; RuntimeError(INSTALL_HINT) without the
    plugin."""
    config = target_config(device)
    if not plugin_installed():
        raise RuntimeError(INSTALL_HINT)
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=config,
                                        topology=f"1x1x{n}")
    return list(topo.devices)


__all__ = ["DEVICES", "INSTALL_HINT", "compile_devices", "device_memory_bytes",
           "plugin_installed", "target_config"]
