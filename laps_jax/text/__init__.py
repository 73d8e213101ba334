"""Text in and out of token ids: the Hugging Face tokenizer, the checkpoint's chat template and
incremental detokenization, reproduced without transformers; and `prompts.py`, which reads a
request's prompt or chat messages into token ids for the server and the offline job alike.

No HTTP and no JAX: the server, the offline job and the CLI all import it; it imports nothing
else of laps_jax.
"""
