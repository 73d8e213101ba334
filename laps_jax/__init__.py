"""laps_jax: length-aware prefill serving for Qwen2.5 in JAX."""

import importlib.util as _util
import os as _os

__version__ = "0.1.0"


def _cpu_where_no_gpu() -> None:
    """With the CUDA plugin installed (the gpu-aot extra, to compile for a GPU that is not
    here) on a machine with no NVIDIA driver, JAX would try the plugin's CUDA backend at start,
    log its failure with a traceback on stderr and fall back to the CPU. Saying "cpu" up front
    gives the same devices and no traceback, and the plugin still compiles for a described GPU
    (engine/gpu_targets.py). JAX_PLATFORMS set by the user wins; a machine with a driver is
    left to JAX."""
    if "JAX_PLATFORMS" in _os.environ or _os.path.exists("/dev/nvidiactl") \
            or _os.path.exists("/proc/driver/nvidia"):
        return
    if _util.find_spec("jax_plugins") is None or \
            _util.find_spec("jax_plugins.xla_cuda12") is None:
        return
    _os.environ["JAX_PLATFORMS"] = "cpu"
    import sys
    if "jax" in sys.modules:  # imported first: its config already read the environment
        sys.modules["jax"].config.update("jax_platforms", "cpu")


_cpu_where_no_gpu()
