"""laps_jax: length-aware prefill serving for Qwen2.5 in JAX."""

__version__ = "0.1.0"
