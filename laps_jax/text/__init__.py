"""Text in and out of token ids: the Hugging Face tokenizer, the checkpoint's chat template and
incremental detokenization, reproduced without transformers.

No HTTP and no JAX: the server, the offline job and the CLI all import it; it imports nothing
else of laps_jax.
"""
