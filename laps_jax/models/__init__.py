"""Qwen2 in Flax NNX over a paged KV cache, its weights and its sharding.

May import the kernels and the top-level config, nothing else of laps_jax.
"""
