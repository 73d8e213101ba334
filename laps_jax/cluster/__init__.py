"""Several instances behind one entry: where a request goes.

`policy.RoutingPolicy` decides from plain numbers (each instance's cached prefix of the prompt
and its pending prefill work) and so serves any front end; `inprocess.Router` puts it in front
of dispatchers in one process (the simulator's multi-instance runs).

May import: scheduler, engine (host-side pieces: block hashes, sampling parameters). Never
server, bench, sim, workload, models, pallas_kernels or text; no JAX.
"""
