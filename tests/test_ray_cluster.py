"""serve.py instances on Ray behind the router (scripts/serve_cluster.py, cluster/ray_*.py).

Fast tests: the placement arithmetic, the router's slot moving to a new address, and the
follower's reading of actor answers, without Ray running. Slow test: scripts/serve_cluster.py
starts a local Ray instance with two CPU instances of the built-in model; a request through the
front door, then one instance's serve.py SIGKILLed, restarted by Ray, and followed by the
router."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from laps_jax.cluster.http_router import HTTPRouter
from laps_jax.cluster.ray_cluster import ClusterSpec, Follower, Slot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the smallest grid serve.py accepts: one prefill bucket (16 tokens), one decode bucket
TINY_GRID = ["--model", "builtin", "--max-chunk", "16", "--max-prefill-batch", "1",
             "--max-decode-batch", "1", "--max-model-len", "256", "--kv-cache-tokens", "2048",
             "--page-size", "8"]

# -- fast ------------------------------------------------------------------------------------


def test_placement_counts_against_the_cluster_resources():
    cpu = ClusterSpec(cpus_per_instance=1.0)
    assert cpu.count({"CPU": 2.0}) == 2
    assert ClusterSpec(instances=1, cpus_per_instance=0.5).count({"CPU": 2.0}) == 1
    assert ClusterSpec(gpus_per_instance=2).count({"CPU": 64, "GPU": 8.0}) == 4
    assert cpu.resources() == {"num_cpus": 1.0, "num_gpus": 0}
    with pytest.raises(ValueError, match="3 instances of 1 CPU need 3 CPU; the Ray cluster has 2"):
        ClusterSpec(instances=3, cpus_per_instance=1).count({"CPU": 2.0})
    with pytest.raises(ValueError, match="has 0 .*--cpus-per-instance"):
        ClusterSpec().count({"CPU": 16.0})
    with pytest.raises(ValueError, match="must be positive"):
        ClusterSpec(cpus_per_instance=0).count({"CPU": 2.0})
    assert ClusterSpec(roles=("both",)).role_list(3) == ["both"] * 3
    assert ClusterSpec(roles=("prefill", "decode")).role_list(2) == ["prefill", "decode"]
    with pytest.raises(ValueError, match="--roles"):
        ClusterSpec(roles=("prefill", "decode")).role_list(3)
    with pytest.raises(ValueError, match="--roles"):
        ClusterSpec(roles=("bogus",)).role_list(1)


def test_instances_other_machines_reach_need_a_key_which_the_router_gets(capsys):
    from laps_jax.cluster.cluster_cli import build_parser, instance_key, main
    assert main(["--address", "10.1.2.3:6379", "--", "--model", "builtin"]) == 2
    err = capsys.readouterr().err
    assert "--address 10.1.2.3:6379" in err and "--api-key KEY" in err
    assert main(["--instance-host", "0.0.0.0", "--", "--model", "builtin"]) == 2
    assert "--instance-host 0.0.0.0" in capsys.readouterr().err
    parse = lambda argv: build_parser().parse_known_args(argv)[0]
    # a joined cluster kept on each node's loopback needs no key; a key goes to the router
    assert instance_key(parse(["--address", "auto", "--instance-host", "127.0.0.1"]), [], []) == []
    assert instance_key(parse(["--address", "auto"]), ["--api-key=s3"], []) == \
        ["--instance-api-key", "s3"]
    assert instance_key(parse([]), ["--api-key", "k"], ["--instance-api-key", "other"]) == []


def test_launcher_refuses_bad_flags_before_starting_ray(capsys):
    from laps_jax.cluster.cluster_cli import main
    assert main(["--instances", "2", "--cpus-per-instance", "1", "--", "--port", "9"]) == 2
    assert "--port after '--': the launcher sets" in capsys.readouterr().err
    assert main(["--instances", "2", "--roles", "prefill,both"]) == 2
    assert "needs at least one prefill and one decode instance" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a router flag that does not exist: argparse's message
        main(["--instances", "1", "--policy", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


class FakeActor:
    """An actor handle whose info() answers come from a list (a dict, or an exception)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.info = self

    def remote(self):
        fut = concurrent.futures.Future()
        a = self.answers.pop(0) if self.answers else None
        if a is None:
            return _Ref(fut)  # never answered: the actor is restarting
        fut.set_exception(a) if isinstance(a, BaseException) else fut.set_result(a)
        return _Ref(fut)


class _Ref:
    def __init__(self, fut):
        self._fut = fut

    def future(self):
        return self._fut


def test_roles_become_the_routers_prefill_and_decode_lists():
    from laps_jax.cluster.cluster_cli import router_args, router_order
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    args = router_args([], urls, ["decode", "prefill", "decode"])
    assert (args.prefill, args.decode, args.instance) == (["http://b:2"], ["http://a:1", "http://c:3"], [])
    # the router lists prefill then decode: instance 0 (decode) is the router's second
    assert router_order(["decode", "prefill", "decode"]) == [1, 0, 2]
    assert router_order(["both", "both"]) == [0, 1]
    assert router_args([], urls[:2], ["both", "both"]).instance == urls[:2]
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        router_order(["prefill", "prefill"])


async def test_follower_moves_the_router_slot_when_ray_restarts_an_instance():
    import ray
    urls = ["http://10.0.0.1:1000", "http://10.0.0.2:2000"]
    router = HTTPRouter(urls)
    info = lambda url, pid: {"url": url, "pid": pid, "node_ip": "10.0.0.1"}
    restarted = info("http://10.0.0.3:3000", 7)
    a = FakeActor([info(urls[0], 1), None])  # the second question waits (restarting) ...
    b = FakeActor([ray.exceptions.ActorDiedError()])
    slots = [Slot(0, "both", a, info(urls[0], 1)), Slot(1, "both", b, info(urls[1], 2))]
    logs = []
    f = Follower(slots, router, logs.append, interval=0.01)
    f.check()
    await asyncio.sleep(0.01)  # (a wrapped future takes its result on the loop's next turn)
    f.check()  # answers read: 0 unchanged, 1 gone for good
    assert [s.state for s in slots] == ["ok", "dead"] and slots[0].restarts == 0
    assert router.instances[0].url == urls[0]
    f.check()  # 0 asked again: no answer while it restarts
    await asyncio.sleep(0.05)
    f.check()
    assert slots[0].state == "waiting"
    slots[0].pending.set_result(restarted)  # ... and back at a new address
    f.check()
    assert slots[0].state == "ok" and slots[0].restarts == 1 and slots[0].info["pid"] == 7
    assert router.instances[0].url == "http://10.0.0.3:3000"
    assert router.instances[1].url == urls[1]  # a dead slot keeps its last address (down)
    assert "restarted by Ray" in logs[-1] and any("gone for good" in m for m in logs)
    # a split: the slot at the router's place for that instance moves, not the launcher's index
    c = FakeActor([info("http://10.0.0.9:9", 9)])
    slots = [Slot(0, "decode", c, info(urls[1], 2), router_index=1)]
    f = Follower(slots, router, logs.append, interval=0.01)
    f.check()
    await asyncio.sleep(0.01)
    f.check()
    assert router.instances[1].url == "http://10.0.0.9:9" and router.instances[0].url != urls[1]


# -- slow: a local Ray cluster ---------------------------------------------------------------


def get(url: str, path: str, timeout: float = 10):
    with urllib.request.urlopen(url + path, timeout=timeout) as r:
        return json.loads(r.read())


def complete(url: str, prompt: str, max_tokens: int = 6) -> str:
    req = urllib.request.Request(
        url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def wait_for(what: str, cond, timeout: float, proc: subprocess.Popen, log):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve_cluster.py exited ({proc.returncode}):\n{log()}")
        try:
            v = cond()
            if v:
                return v
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not after {timeout} s:\n{log()}")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """scripts/serve_cluster.py with two CPU instances on a Ray instance it starts."""
    from laps_jax.workload.http_compare import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logf = open(tmp_path_factory.mktemp("ray") / "serve_cluster.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "serve_cluster.py"), "--instances", "2",
         "--cpus-per-instance", "1", "--object-store-mb", "80",
         "--policy", "round-robin", "--port", str(port), "--", *TINY_GRID],
        stdout=logf, stderr=subprocess.STDOUT)

    def log() -> str:
        logf.flush()
        logf.seek(0)
        return logf.read()[-6000:]

    logs = set()  # the instances' own logs (in the temp dir of their node): removed at the end
    try:
        wait_for("both instances healthy", lambda: get(url, "/router/status")["healthy"] == 2,
                 400, proc, log)
        logs |= {i["log"] for i in get(url, "/cluster/status")["instances"]}
        yield url, proc, log
    finally:
        pids = []
        try:
            now = get(url, "/cluster/status")["instances"]
            pids, logs = [i["pid"] for i in now], logs | {i["log"] for i in now}
        except OSError:
            pass
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        logf.close()
        assert code == 0
        for pid in pids:  # serve.py processes ended with the launcher
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        for f in logs:
            os.remove(f)


def listeners(pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of pid and its
    descendants: the launcher, Ray's processes it started, the serve.py instances."""
    import psutil
    found = []
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:  # gone meanwhile
            continue
        found += [(name, c.laddr.ip, c.laddr.port) for c in conns
                  if c.status == psutil.CONN_LISTEN]
    return found


@pytest.mark.slow
def test_a_local_cluster_listens_on_the_loopback_only(ray_cluster):
    """No flag says otherwise: Ray's GCS, raylet, workers and agents, the instances (default
    --instance-host) and the router bind 127.0.0.1, nothing another machine can reach."""
    url, proc, log = ray_cluster
    found = listeners(proc.pid)
    names = {n for n, _, _ in found}
    assert {"gcs_server", "raylet"} <= names, found  # Ray's own processes were seen
    ports = {port for _, _, port in found}
    for inst in get(url, "/cluster/status")["instances"]:
        assert inst["url"].startswith("http://127.0.0.1:"), inst
        assert int(inst["url"].rsplit(":", 1)[1]) in ports  # the instances were seen too
    loopback = lambda ip: ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1")
    beyond = [(n, ip, port) for n, ip, port in found if not loopback(ip)]
    assert not beyond, f"listening beyond the loopback: {beyond}"


@pytest.mark.slow
def test_an_instance_killed_is_restarted_by_ray_and_the_router_follows(ray_cluster):
    url, proc, log = ray_cluster
    before = get(url, "/cluster/status")["instances"]
    assert [i["state"] for i in before] == ["ok", "ok"]
    # served through the front door, as the instance itself answers (greedy)
    text = complete(url, "The quick brown fox")
    assert text and text == complete(before[0]["url"], "The quick brown fox")

    os.kill(before[0]["pid"], signal.SIGKILL)
    t = time.monotonic()
    after = wait_for("instance 0 restarted",
                     lambda: (lambda s: s if s[0]["restarts"] == 1 and s[0]["state"] == "ok"
                              else None)(get(url, "/cluster/status")["instances"]),
                     300, proc, log)
    restart_s = time.monotonic() - t
    assert after[0]["url"] != before[0]["url"] and after[0]["pid"] != before[0]["pid"]
    assert after[1] == {**before[1], "state": "ok"}  # the other one untouched
    status = wait_for("the router polls the new address healthy",
                      lambda: (lambda s: s if s["healthy"] == 2 else None)(
                          get(url, "/router/status")), 30, proc, log)
    assert [i["url"] for i in status["instances"]] == [after[0]["url"], after[1]["url"]]
    routed = [i["routed"] for i in status["instances"]]
    for _ in range(2):  # round-robin: one request each, the restarted one included
        assert complete(url, "The quick brown fox") == text
    routed_after = [i["routed"] for i in get(url, "/router/status")["instances"]]
    assert routed_after[0] > routed[0] and routed_after[1] > routed[1]
    print(f"instance restarted by Ray and followed in {restart_s:.1f} s")
