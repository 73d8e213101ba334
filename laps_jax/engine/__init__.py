"""KV pages, prefix cache, compiled executables, the model runner and sampling.

May import the models, the kernels and the top-level config; never the scheduler, the server,
or the side packages (bench, sim, workload). `buckets.py`, `packing.py`, `paged.py`,
`kv_cache.py`, `sequence.py` and `settings.py` import no JAX: the scheduler and the simulator
use them.
"""
