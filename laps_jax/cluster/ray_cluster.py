"""serve.py instances placed on a Ray cluster, with the network router following them.

    spec = ClusterSpec(instances=2, cpus_per_instance=1, serve_args=["--model", "builtin"])
    connect(None, object_store_mb=128)      # or an address: a cluster of several machines
    slots = place(spec)                     # one Ray actor per instance, each ready
    ... router_cli.serve(router_args, log, on_app=lambda app: attach(app, slots))

Ray places the instances (one per `gpus_per_instance` GPUs, or per `cpus_per_instance` CPUs)
and restarts a dead one (`max_restarts`: the actor's process exits when its serve.py dies, see
`ray_instance.py`). The router is our own process, `http_router.HTTPRouter`, and the
`Follower` keeps it pointed at the addresses Ray's actors report: a restarted instance comes
back on a new port (perhaps another node) and takes its old slot, and so its group. Why this
and not Ray Serve's request router: docs/ARCHITECTURE.md, "Cluster".

Ray is imported inside the functions: the cluster package imports without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sys
import time

from aiohttp import web

from laps_jax.cluster.http_router import ROUTER, HTTPRouter

FOLLOW_INTERVAL_S = 1.0
ROLES = ("both", "prefill", "decode")
# Ray's switch between "this machine only" and "a cluster other machines may join": off, its
# node IP is 127.0.0.1, and GCS, raylet, object manager, workers and agents bind to it alone
# (on, they bind every interface). Read by Ray when it is imported, and inherited by the
# processes it starts.
RAY_MULTI_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass
class ClusterSpec:
    """What to place: N instances, the resources each holds, serve.py's flags for all."""
    instances: int | None = None            # None: as many as the cluster's resources hold
    cpus_per_instance: float | None = None  # CPU instances (tests, CPU-only clusters)
    gpus_per_instance: float = 1.0          # otherwise: GPU instances
    roles: tuple[str, ...] = ()             # one per instance, or one for all; () = "both"
    serve_args: tuple[str, ...] = ()
    host: str | None = None                 # what instances bind; None: their node's IP
                                            # (127.0.0.1 on a Ray instance started here)
    max_restarts: int = -1                  # per instance; -1: always restart
    ready_timeout_s: float = 600.0

    def resources(self) -> dict:
        if self.cpus_per_instance is not None:
            return {"num_cpus": self.cpus_per_instance, "num_gpus": 0}
        return {"num_gpus": self.gpus_per_instance}

    def count(self, cluster: dict) -> int:
        """The number of instances, checked against the cluster's resources (one line naming
        the numbers when they do not fit: Ray would wait for them forever)."""
        kind, each = (("CPU", self.cpus_per_instance) if self.cpus_per_instance is not None
                      else ("GPU", self.gpus_per_instance))
        if each <= 0:
            raise ValueError(f"--{kind.lower()}s-per-instance must be positive, not {each}")
        have = cluster.get(kind, 0.0)
        fits = math.floor(have / each + 1e-9)
        n = fits if self.instances is None else self.instances
        if n < 1 or n > fits:
            hint = "" if kind == "CPU" else " (no GPUs? give --cpus-per-instance)"
            raise ValueError(f"{n} instances of {each:g} {kind} need {n * each:g} {kind}; the "
                             f"Ray cluster has {have:g}{hint}")
        return n

    def role_list(self, n: int) -> list[str]:
        roles = list(self.roles) or ["both"]
        if len(roles) == 1:
            roles *= n
        if len(roles) != n or any(r not in ROLES for r in roles):
            raise ValueError(f"--roles needs one of {'/'.join(ROLES)} per instance ({n}) or one "
                             f"for all; got {','.join(self.roles)}")
        return roles


@dataclasses.dataclass(eq=False)
class Slot:
    """One placed instance as the launcher sees it: its actor and what it last reported."""
    index: int
    role: str
    actor: object
    info: dict
    restarts: int = 0
    state: str = "ok"          # ok | waiting (no answer from the actor yet) | dead
    error: str | None = None
    pending: object = None     # the info() call in flight (at most one per slot)
    asked: float = 0.0         # when it was sent
    router_index: int = -1     # its place in the router's list (-1: `index`)

    def status(self) -> dict:
        return {**self.info, "role": self.role, "restarts": self.restarts, "state": self.state,
                "error": self.error}


def connect(address: str | None, object_store_mb: int = 128) -> None:
    """Joins the Ray cluster at `address` ('auto': the one `ray start` runs on this machine),
    or starts one on this machine (address None): small (a launcher passes only addresses
    through the object store), no dashboard, and on the loopback only (`loopback_only`)."""
    if not address:
        loopback_only()
    import ray
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 object_store_memory=object_store_mb << 20)


def loopback_only() -> None:
    """Makes a Ray instance started from this process single-machine: its node IP is
    127.0.0.1, so every Ray process binds the loopback alone, and so do the instances, which
    bind their node's IP. Nothing on another machine needs to reach a Ray that only this
    machine's launcher uses. Set before Ray starts; if Ray is imported already, its constant
    is set too (it is read once, at import)."""
    os.environ[RAY_MULTI_NODE_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def is_loopback(host: str | None) -> bool:
    return host is not None and (host in LOOPBACK or host.startswith("127."))


def place(spec: ClusterSpec) -> list[Slot]:
    """Starts one actor per instance and returns when every instance is ready; an instance
    that fails to start raises with its own log's tail (and the others are killed)."""
    import ray
    from laps_jax.cluster.ray_instance import InstanceProcess
    n = spec.count(ray.cluster_resources())
    roles = spec.role_list(n)
    remote = ray.remote(InstanceProcess).options(
        max_restarts=spec.max_restarts, max_task_retries=0, scheduling_strategy="SPREAD",
        **spec.resources())
    actors = []
    for k, role in enumerate(roles):
        args = list(spec.serve_args) + ([] if role == "both" else ["--role", role])
        actors.append(remote.remote(k, args, spec.host, spec.ready_timeout_s))
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=spec.ready_timeout_s + 60)
    except Exception:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise
    return [Slot(k, r, a, i) for k, (r, a, i) in enumerate(zip(roles, actors, infos))]


class Follower:
    """Asks each actor where its instance answers, every `interval` s, and moves the router's
    slot when the answer changes (Ray restarted it). At most one question per actor is in
    flight: while an actor restarts (serve.py compiling) its answer waits in Ray's queue."""

    def __init__(self, slots: list[Slot], router: HTTPRouter, log=None,
                 interval: float = FOLLOW_INTERVAL_S):
        self.slots, self.router, self.interval = slots, router, interval
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def check(self) -> None:
        for s in self.slots:
            if s.state == "dead":
                continue
            if s.pending is None:
                s.pending = asyncio.wrap_future(s.actor.info.remote().future())
                s.asked = time.monotonic()
            if not s.pending.done():
                if time.monotonic() - s.asked > 3 * self.interval:
                    s.state = "waiting"
                continue
            fut, s.pending = s.pending, None
            self._answered(s, fut)

    def _answered(self, s: Slot, fut) -> None:
        import ray
        err = fut.exception()
        if err is None:
            info = fut.result()
            s.state, s.error = "ok", None
            if info["url"] != s.info["url"]:
                s.restarts += 1
                self.log(f"instance {s.index} restarted by Ray: {s.info['url']} -> "
                         f"{info['url']} (pid {info['pid']} on {info['node_ip']})")
                k = s.index if s.router_index < 0 else s.router_index
                self.router.replace_instance(k, info["url"])
            s.info = info
        elif isinstance(err, ray.exceptions.ActorDiedError):  # restarts used up, or killed
            s.state, s.error = "dead", str(err).splitlines()[0]
            self.log(f"instance {s.index} is gone for good: {s.error}")
        else:  # died while the call ran, unavailable for a moment: ask again
            s.state, s.error = "waiting", f"{type(err).__name__}"

    async def run(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(self.interval)


CLUSTER = web.AppKey("cluster", list)


async def cluster_status(request: web.Request) -> web.Response:
    return web.json_response({"instances": [s.status() for s in request.app[CLUSTER]]})


def attach(app: web.Application, slots: list[Slot], log=None) -> None:
    """Adds the follower (started and stopped with the router's app) and GET /cluster/status
    (each instance's actor: URL, pid, node, role, restarts) to the router's app."""
    app[CLUSTER] = slots
    task: list[asyncio.Task] = []

    async def start(app_) -> None:
        task.append(asyncio.create_task(Follower(slots, app_[ROUTER], log).run()))

    async def stop(_app) -> None:
        for t in task:
            t.cancel()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/cluster/status", cluster_status)


def stop_all(slots: list[Slot], timeout_s: float = 60.0) -> None:
    """Stops every instance (serve.py finishes what is in flight) and its actor for good."""
    import ray
    refs = [s.actor.stop.remote(timeout_s) for s in slots if s.state != "dead"]
    try:
        ray.get(refs, timeout=timeout_s + 10)
    except Exception:  # noqa: BLE001 (an actor already gone: killed below all the same)
        pass
    for s in slots:
        ray.kill(s.actor, no_restart=True)
