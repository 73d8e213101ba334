"""`scripts/serve_cluster.py`: serve.py instances on a Ray cluster behind the router.

    python scripts/serve_cluster.py [launcher flags] [router flags] -- [serve.py flags]

The launcher's own flags are below; every other flag before `--` is the router's
(`scripts/router.py --help`, all but --instance, which the launcher fills in); the flags after
`--` go to every serve.py (all but --host and --port, which each instance's actor sets).
"""

from __future__ import annotations

import argparse
import sys

from laps_jax.cluster import router_cli
from laps_jax.cluster.ray_cluster import ClusterSpec, is_loopback

SET_BY_LAUNCHER = ("--host", "--port", "--role")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Places serve.py instances on a Ray cluster (one per GPU, or per CPU group "
                    "with --cpus-per-instance), puts the length-aware router in front "
                    "(scripts/router.py's API, plus GET /cluster/status), and keeps it pointed "
                    "at them: Ray restarts an instance whose serve.py dies, and the router "
                    "follows it to its new address.",
        epilog="Other flags before '--' go to the router (see scripts/router.py --help; "
               "--instance is filled in); flags after '--' go to each serve.py (--host and "
               "--port are set per instance). Example, two CPU instances on this machine: "
               "python scripts/serve_cluster.py --instances 2 --cpus-per-instance 1 --port "
               "8100 -- --model builtin")
    ap.add_argument("--address", default=None,
                    help="Ray cluster to join (host:port, 'auto' for the one `ray start` runs "
                         "on this machine, ray://...); default: start a Ray instance here that "
                         "listens on 127.0.0.1 only, as do its instances")
    ap.add_argument("--instances", type=int, default=None,
                    help="instances to place (default: as many as the cluster's GPUs, or CPUs "
                         "with --cpus-per-instance, hold)")
    ap.add_argument("--cpus-per-instance", type=float, default=None,
                    help="CPU instances, each holding this many of Ray's CPUs (no GPU)")
    ap.add_argument("--gpus-per-instance", type=float, default=1.0,
                    help="GPUs each instance holds (default 1; Ray sets CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--roles", default="both",
                    help="serve.py --role of each instance, comma-separated, or one for all "
                         "(default both; e.g. prefill,decode: each request is prefilled on a "
                         "prefill instance and decoded on a decode one, its KV pulled across)")
    ap.add_argument("--instance-host", default=None,
                    help="address each serve.py binds (default: its node's IP as Ray knows it: "
                         "127.0.0.1 on a Ray instance started here; with --address, an IP the "
                         "router reaches from another machine, and then the instances need an "
                         "--api-key after '--', which the router is given too)")
    ap.add_argument("--max-restarts", type=int, default=-1,
                    help="times Ray restarts each instance (default -1: always)")
    ap.add_argument("--ready-timeout", type=float, default=600.0,
                    help="seconds an instance may take to start (compiling) (default 600)")
    ap.add_argument("--object-store-mb", type=int, default=128,
                    help="object store of a Ray instance started here (default 128 MiB: only "
                         "addresses pass through it)")
    return ap


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1:]
    return argv, []


def router_order(roles: list[str]) -> list[int]:
    """Instance i's place in the router's list: as given when every role is `both`; with a
    prefill/decode split the router lists the prefill instances first, then the decode ones
    (router_cli: --prefill URL... --decode URL...). A split needs at least one of each and no
    `both` beside them."""
    if all(r == "both" for r in roles):
        return list(range(len(roles)))
    if "both" in roles or "prefill" not in roles or "decode" not in roles:
        raise ValueError(f"--roles {','.join(roles)}: a prefill/decode split needs at least one "
                         f"prefill and one decode instance and no 'both' beside them")
    order = [i for i, r in enumerate(roles) if r == "prefill"] + \
        [i for i, r in enumerate(roles) if r == "decode"]
    return [order.index(i) for i in range(len(roles))]


def router_args(flags: list[str], urls: list[str], roles: list[str]) -> argparse.Namespace:
    """The router's flags with the instances filled in (by role: --instance, or --prefill and
    --decode); exits with argparse's message on a bad flag, as scripts/router.py would."""
    router_order(roles)  # refuses a split that cannot work
    flag = {"both": "--instance", "prefill": "--prefill", "decode": "--decode"}
    inst = [a for u, r in zip(urls, roles) for a in (flag[r], u)]
    return router_cli.build_parser().parse_args(flags + inst)


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of `name` in argv (`--name V` or `--name=V`; the last one wins), or None."""
    value = None
    for k, a in enumerate(argv):
        if a == name and k + 1 < len(argv):
            value = argv[k + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


def instance_key(args, serve_args: list[str], rflags: list[str]) -> list[str]:
    """The router flags that let it reach the instances. Instances that other machines can
    reach (a joined cluster, a non-loopback --instance-host) must have an --api-key: refused
    without one, in one line. The key reaches the router as --instance-api-key unless given."""
    key = flag_value(serve_args, "--api-key")
    open_to_network = (args.address or args.instance_host) and not is_loopback(args.instance_host)
    if open_to_network and not key:
        where = (f"--instance-host {args.instance_host}" if args.instance_host
                 else f"--address {args.address}")
        raise ValueError(f"{where}: the instances listen where other machines reach them; "
                         f"give them a key after '--' (--api-key KEY), or keep them on this "
                         f"machine with --instance-host 127.0.0.1")
    if key and flag_value(rflags, "--instance-api-key") is None:
        return ["--instance-api-key", key]
    return []


def main(argv: list[str] | None = None) -> int:
    ours, serve_args = split_argv(sys.argv[1:] if argv is None else argv)
    args, rflags = build_parser().parse_known_args(ours)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    bad = [a for a in serve_args if a.split("=")[0] in SET_BY_LAUNCHER]
    if bad:
        log(f"error: {', '.join(bad)} after '--': the launcher sets these for each instance "
            f"(see --instance-host, --roles)")
        return 2
    spec = ClusterSpec(args.instances, args.cpus_per_instance, args.gpus_per_instance,
                       tuple(args.roles.split(",")), tuple(serve_args), args.instance_host,
                       args.max_restarts, args.ready_timeout)
    n = args.instances or 1
    try:  # the router's flags, the roles and the instances' key, checked before anything starts
        rflags = rflags + instance_key(args, serve_args, rflags)
        router_args(rflags, ["http://127.0.0.1:1"] * n, spec.role_list(n))
    except ValueError as e:
        log(f"error: {e}")
        return 2
    if set(spec.role_list(n)) != {"both"}:
        router_cli.share_pd_secret(serve_args, args.address, log)
    return run(spec, args, rflags, log)


def run(spec: ClusterSpec, args, rflags: list[str], log) -> int:
    from laps_jax.cluster.ray_cluster import attach, connect, loopback_only, place, stop_all
    if not args.address:
        loopback_only()  # before Ray is imported: it reads the switch once
    try:
        import ray
    except ImportError:
        log("error: serve_cluster.py needs Ray: pip install 'laps_jax[cluster]' (ray 2.60)")
        return 2
    connect(args.address, args.object_store_mb)
    slots = []
    try:
        log(f"Ray cluster: {ray.cluster_resources()}; placing instances")
        slots = place(spec)
        for s, k in zip(slots, router_order([s.role for s in slots])):
            s.router_index = k  # where the follower moves the router's slot on a restart
        for s in slots:
            log(f"instance {s.index} ({s.role}) ready at {s.info['url']} "
                f"(pid {s.info['pid']} on {s.info['node_ip']}, log {s.info['log']})")
        rargs = router_args(rflags, [s.info["url"] for s in slots], [s.role for s in slots])
        return router_cli.run_on_loop(rargs.event_loop, lambda: router_cli.serve(
            rargs, log, lambda app: attach(app, slots, log)))
    except (ValueError, OSError, ray.exceptions.RayError) as e:
        log(f"error: {e}")
        return 2
    finally:
        stop_all(slots)
        ray.shutdown()
