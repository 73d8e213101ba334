"""The offline batch-prefill job behind `scripts/prefill_batch.py`: JSONL prompts in, next-token
(and prompt) log-probs out, one output line per input line.

It plans its steps with the packing the dispatcher uses (`engine/packing.py`) and reads prompts
with the parser the HTTP server uses (`text/prompts.py`), so both refuse the same input alike.
May import the scheduler, the engine, the text package, the models and the top-level config;
never the server, nor the side packages (bench, sim, workload).
"""
