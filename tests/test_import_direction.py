"""Dependencies point one way: server -> scheduler -> engine -> models -> kernels, with bench,
sim and workload on the side (bench -> sim: the harness runs and validates against the
simulator). Read from the source (every import, function-level ones included), so a lazy import
counts as much as a top-level one."""

from __future__ import annotations

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "laps_jax")

# package -> laps_jax packages it must never import (top-level modules such as config.py,
# config_fields.py, timing.py and cli.py are not packages and are checked apart)
FORBIDDEN = {
    "pallas_kernels": {"models", "engine", "scheduler", "server", "bench", "sim", "workload",
                       "text", "cluster"},
    "models": {"engine", "scheduler", "server", "bench", "sim", "workload", "text", "cluster"},
    "engine": {"scheduler", "server", "bench", "sim", "workload", "text", "cluster", "offline"},
    "scheduler": {"server", "workload", "bench", "models", "sim", "text", "cluster", "offline"},
    "sim": {"pallas_kernels", "models", "server", "text", "bench"},
    "text": {"pallas_kernels", "models", "engine", "scheduler", "server", "bench", "sim",
             "workload"},
    "workload": {"pallas_kernels", "models", "engine", "scheduler", "server", "bench", "sim",
                 "text"},
    "server": {"bench", "sim", "workload", "offline"},
    "offline": {"server", "bench", "sim", "workload", "cluster"},
    "cluster": {"pallas_kernels", "models", "bench", "sim", "workload"},
}
# the network router (a front end like the server) reuses the server's HTTP error handling and
# the instances' tokenizer; the rest of cluster (the policy the simulator runs) must not
CLUSTER_FRONT_END = {"http_router.py", "proxy.py", "router_cli.py", "pd_router.py",
                     "failover.py"}


def _imports(path: str) -> set[str]:
    """The laps_jax modules a file imports, anywhere in it."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("laps_jax")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("laps_jax"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level > 1:  # (level 1: same package)
            raise AssertionError(f"{path}: a relative import out of its package")
    return out


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return parts[1] if os.path.isdir(os.path.join(PKG, parts[1])) else None


def _graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the files that import it."""
    graph: dict[str, dict[str, set[str]]] = {}
    for pkg in sorted(os.listdir(PKG)):
        root = os.path.join(PKG, pkg)
        if not os.path.isdir(root) or pkg.startswith("_") or pkg == "builtin_model":
            continue
        edges = graph.setdefault(pkg, {})
        for dirpath, _, files in os.walk(root):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    for m in _imports(path):
                        dep = _package_of(m)
                        if dep and dep != pkg:
                            edges.setdefault(dep, set()).add(os.path.relpath(path, PKG))
    return graph


@pytest.mark.parametrize("pkg", sorted(FORBIDDEN))
def test_no_package_imports_against_the_direction(pkg):
    bad = {dep: sorted(files) for dep, files in _graph()[pkg].items() if dep in FORBIDDEN[pkg]}
    assert not bad, f"laps_jax.{pkg} imports {bad}"


def test_cluster_policy_stays_off_the_server():
    root = os.path.join(PKG, "cluster")
    for f in sorted(os.listdir(root)):
        if f.endswith(".py") and f not in CLUSTER_FRONT_END:
            bad = {m for m in _imports(os.path.join(root, f))
                   if _package_of(m) in ("server", "text")}
            assert not bad, f"laps_jax/cluster/{f} imports {sorted(bad)}"


def test_no_cycle_between_packages():
    graph = {p: set(e) for p, e in _graph().items()}
    state: dict[str, int] = {}

    def visit(p: str, path: list[str]) -> None:
        state[p] = 1
        for q in sorted(graph.get(p, ())):
            if state.get(q) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [p, q]))
            if not state.get(q):
                visit(q, path + [p])
        state[p] = 2

    for p in sorted(graph):
        if not state.get(p):
            visit(p, [])


# import circles between modules of one package that are known and not yet broken (package ->
# the modules of the circle); empty: every package's modules import one way
CIRCLES_ALLOWED: dict[str, set[str]] = {}


def _module_graph(root: str, pkg: str) -> dict[str, set[str]]:
    """module -> the modules of its own package it imports (anywhere in it: a function-level
    or TYPE_CHECKING import counts), for the package `pkg` at `root`. Importing a name from the
    package itself (its __init__) is no edge: __init__ only gathers names."""
    names = {f[:-3] for f in os.listdir(root) if f.endswith(".py") and f != "__init__.py"}
    graph = {}
    for name in sorted(names):
        deps = set()
        tree = ast.parse(open(os.path.join(root, name + ".py"), encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                mods = [f"{pkg}.{node.module}"] if node.module else \
                    [f"{pkg}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for m in mods:
                rest = m[len(pkg) + 1:].split(".")[0] if m.startswith(pkg + ".") else None
                if rest in names and rest != name:
                    deps.add(rest)
        graph[name] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _packages() -> list[str]:
    return sorted(os.path.relpath(d, PKG) for d, _, files in os.walk(PKG)
                  if "__init__.py" in files and d != PKG and "__pycache__" not in d)


@pytest.mark.parametrize("pkg", _packages())
def test_no_import_circle_inside_a_package(pkg):
    dotted = "laps_jax." + pkg.replace(os.sep, ".")
    found = _circles(_module_graph(os.path.join(PKG, pkg), dotted))
    allowed = CIRCLES_ALLOWED.get(pkg, set())
    bad = [sorted(c) for c in found if not c <= allowed]
    assert not bad, f"laps_jax/{pkg}: modules import each other in a circle: {bad}"


def test_a_circle_is_seen(tmp_path):
    """A circle closed only by a TYPE_CHECKING import and a function-level one is still one."""
    root = tmp_path / "laps_jax" / "p"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from laps_jax.p.b import B\n")
    (root / "b.py").write_text("def f():\n    from . import c\n")
    (root / "c.py").write_text("import laps_jax.p.a\n")
    (root / "d.py").write_text("from laps_jax.p.a import x\n")  # into the circle, not in it
    graph = _module_graph(str(root), "laps_jax.p")
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [{"a", "b", "c"}]
    assert _circles({**graph, "c": set()}) == []


def test_the_rules_can_fail(tmp_path):
    """The reader sees a function-level import (what a lazy import would hide)."""
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from laps_jax.server.app import create_app\n")
    assert "laps_jax.server.app" in _imports(str(f))
