"""Qwen2 in Flax NNX over a paged KV cache, its weights and its sharding."""
