"""One serve.py instance as a Ray actor: the unit Ray places, and restarts when it dies.

`InstanceProcess` is a plain class; `ray_cluster.py` wraps it with `ray.remote` (so this module,
like the rest of the cluster package, imports without Ray). Its constructor runs on the node
Ray chose: it picks a free port there, starts `serve.py` as a child process (with the GPUs Ray
gave the actor: Ray sets CUDA_VISIBLE_DEVICES, the child inherits it) and returns once the
child's /health answers 200, so a caller that has the actor's `info()` has a ready instance.

Why a child process and not serve.py inside the actor: serve.py owns its event loop, signal
handlers and JAX runtime, exactly as when it runs alone; the actor only keeps it alive. The two
live and die together, which is what makes Ray's restart the instance's restart:

- the child dies (crash, OOM, SIGKILL): a watchdog thread sees it and exits the actor's process
  (`os._exit`), Ray counts an actor failure and, within `max_restarts`, runs the constructor
  again: a new serve.py on a new port (maybe on another node), found by the launcher's follower;
- the actor's process dies (node lost, `ray.kill`): the child gets SIGKILL from the kernel
  (PR_SET_PDEATHSIG), so no orphan keeps the port or the accelerator.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

SERVE_MAIN = "import sys; from laps_jax.server.run import main; sys.exit(main())"
PR_SET_PDEATHSIG = 1
LOG_TAIL_CHARS = 3000


def _death_signal():
    """A function for the child to run before exec: SIGKILL when the thread that started it
    (the actor's main thread) goes. libc is loaded here, in the parent: a child forked from a
    threaded process should call nothing that takes locks. None where there is no prctl (not
    Linux: the child may outlive a killed actor)."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _port_on(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class InstanceProcess:
    """A serve.py child process kept alive by a Ray actor (see the module docstring)."""

    def __init__(self, index: int, serve_args: list[str], host: str | None = None,
                 ready_timeout_s: float = 600.0):
        import ray  # on the worker, where the actor runs
        self.index = index
        self.host = host or ray.util.get_node_ip_address()
        self.port = _port_on(self.host)
        self.url = f"http://{self.host}:{self.port}"
        self.started = time.time()
        self.stopping = False
        self.log_path = os.path.join(tempfile.gettempdir(),
                                     f"laps_instance{index}_{self.port}.log")
        self._log = open(self.log_path, "w+")
        # a prefill/decode instance's transfer server listens where its HTTP does (a decode
        # peer on another node pulls from it), unless the serve.py flags say where
        transfer = ([] if "--role" not in serve_args or any(
            a.startswith("--transfer-address") for a in serve_args)
            else ["--transfer-address", f"{self.host}:0"])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE_MAIN, *serve_args, "--host", self.host,
             "--port", str(self.port), *transfer],
            stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_death_signal())
        self._await_health(ready_timeout_s)
        threading.Thread(target=self._watch, name="instance-watchdog", daemon=True).start()

    def _await_health(self, timeout_s: float) -> None:
        """Returns when /health answers 200; raises (the actor's creation fails, with the
        instance's own words) if the child exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise TimeoutError(f"instance {self.index} at {self.url} not ready after "
                                   f"{timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"instance {self.index} (serve.py) exited with code "
                           f"{self.proc.returncode} before it was ready:\n{self.log_tail()}")

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self.stopping:  # died on its own: end the actor so Ray restarts it
            print(f"instance {self.index}: serve.py exited with code {code}; exiting the actor "
                  f"for Ray to restart it", file=sys.stderr, flush=True)
            os._exit(1)

    def log_tail(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-LOG_TAIL_CHARS:]

    def info(self) -> dict:
        """Where this instance answers, and which process and node it is (the launcher's
        follower compares the URL to see a restart)."""
        import ray
        return {"index": self.index, "url": self.url, "pid": self.proc.pid,
                "node_ip": ray.util.get_node_ip_address(), "started": self.started,
                "log": self.log_path}

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM to serve.py (it finishes requests in flight, then exits), SIGKILL after
        `timeout_s`; the watchdog lets it go. Returns its exit code."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
