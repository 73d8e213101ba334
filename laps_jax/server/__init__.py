"""The OpenAI-compatible HTTP server over the dispatcher (aiohttp): request validation, the
app, streaming output, metrics, start-up and shutdown (the offline batch-prefill job is
`laps_jax/offline/`).

May import the scheduler, the engine (to build one at start-up), the text package and the
top-level config and CLI helpers; nothing imports the server but scripts.
"""
