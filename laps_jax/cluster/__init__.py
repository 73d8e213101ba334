"""Several instances behind one entry: where a request goes.

`policy.RoutingPolicy` decides from plain numbers (each instance's cached prefix of the prompt
and its pending prefill work) and so serves any front end; `inprocess.Router` puts it in front
of dispatchers in one process (the simulator's multi-instance runs); `http_router.HTTPRouter`
puts it in front of serve.py instances over HTTP (`scripts/router.py`), fed from the instances'
/metrics (`instances.py`, `upstream.py`; the request pass-through in `proxy.py`, sent again or
resumed elsewhere when its instance fails in `failover.py`);
`ray_cluster.py` places serve.py instances on a Ray cluster (`ray_instance.py`: one actor each)
and keeps that router pointed at them (`scripts/serve_cluster.py`, `cluster_cli.py`). Ray is
imported lazily there: the package imports without it.

May import: scheduler, engine (host-side pieces: block hashes, sampling parameters); the network
router's front end (http_router.py, proxy.py, failover.py, router_cli.py) also server (its
HTTP error handling, the resume protocol) and text (the instances' tokenizer). Never bench,
sim, workload, models or pallas_kernels; no JAX.
"""
