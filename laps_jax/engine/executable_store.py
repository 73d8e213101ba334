"""Executables saved to a directory and loaded at start, so a server compiles nothing.

`save` writes each compiled executable of an engine (`jax.experimental.serialize_executable`)
and a manifest: the jax, jaxlib and CUDA plugin versions, the devices (kind, platform, count),
a hash of everything that shapes the programs (model config, pages, context, attention backend
and layer loop, dtypes, Pallas interpreted or not) and each file's sha256. `load` puts into the
engine's caches every executable whose manifest and file match this engine and process; every
other one is left to be compiled as usual, with one log line saying why. A mismatch never
crashes and never loads a wrong executable: the manifest is checked before any file is read,
and each file's hash before it is unpickled.

Compile what is saved under `fresh_compiles()`: on jax 0.10.2's CPU an executable that came
out of the persistent compilation cache serializes without its code (loaded again it fails at
its first run with `NOT_FOUND: Function ..._fusion not found`).

Loading unpickles (JAX's format): a directory of executables is trusted like a checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import pickle
from importlib import metadata
from pathlib import Path
from typing import Callable

import jax
from jax.experimental import serialize_executable

from laps_jax.engine.buckets import Bucket

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
FORMAT = 1


@contextlib.contextmanager
def fresh_compiles():
    """The persistent compilation cache off: every executable compiled anew (see above). JAX
    decides once per process whether the cache is on, so the decision is reset both ways."""
    from jax._src import compilation_cache
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def file_name(key) -> str:
    """A file name per planned key: a step bucket or a KV copy."""
    if isinstance(key, Bucket):
        return f"step-{key.batch}x{key.tokens}{'-logprobs' if key.prompt_logprobs else ''}.bin"
    kind, n = key
    return f"kv-{kind}-{n}.bin"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(devices) -> dict:
    """What an executable was built with and for: versions and the devices."""
    return {"jax": jax.__version__, "jaxlib": _version("jaxlib"),
            "cuda_plugin": _version("jax-cuda12-plugin"), "platform": devices[0].platform,
            "device_kind": devices[0].device_kind, "devices": len(devices)}


def engine_devices(engine) -> list:
    r = engine.runner
    if r.mesh is not None:
        return list(r.mesh.devices.flat)
    leaf = jax.tree.leaves(r.params)[0]
    sharding = getattr(leaf, "sharding", None)
    return sorted(sharding.device_set, key=lambda d: d.id) if sharding else jax.devices()[:1]


def settings_hash(engine) -> str:
    """sha256 of everything that shapes an engine's programs, beyond the bucket itself."""
    from laps_jax.pallas_kernels.dispatch import use_interpret
    r = engine.runner
    what = {"model": engine.cfg.to_hf_dict(), "page_size": r.page_size,
            "num_pages": r.num_pages, "pages_per_seq": r.pages_per_seq,
            "attention": r.attention_backend, "layer_loop": r.layer_loop,
            "kv_dtype": str(r.kv_dtype), "param_dtype": str(jax.tree.leaves(r.params)[0].dtype),
            "tensor_parallel": engine.ecfg.tensor_parallel,
            "pallas_interpret": use_interpret()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def manifest(engine) -> dict:
    return {"format": FORMAT, **environment(engine_devices(engine)),
            "settings": settings_hash(engine), "files": {}}


def save(engine, directory: str | Path) -> int:
    """Writes every compiled executable of `engine`'s caches and the manifest; the count."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    man = manifest(engine)
    for cache, key in engine.executables.planned(True):
        if key not in cache:
            continue
        payload, in_tree, out_tree = serialize_executable.serialize(cache.get(key))
        blob = pickle.dumps((payload, in_tree, out_tree))
        name = file_name(key)
        (d / name).write_bytes(blob)
        man["files"][name] = hashlib.sha256(blob).hexdigest()
    (d / MANIFEST).write_text(json.dumps(man, indent=1))
    return len(man["files"])


def _mismatch(saved: dict, here: dict) -> str | None:
    for field in ("format", "jax", "jaxlib", "cuda_plugin", "platform", "device_kind",
                  "devices", "settings"):
        if saved.get(field) != here.get(field):
            what = "model or engine settings" if field == "settings" else field
            return f"{what} differ (saved {saved.get(field)!r}, here {here.get(field)!r})"
    return None


def load(engine, directory: str | Path, prompt_logprobs: bool = False,
         say: Callable[[str], None] = log.warning) -> int:
    """Puts every matching saved executable into `engine`'s caches; the count loaded. A file
    that does not load gets one `say` line (why), those never saved one line together;
    nothing raises."""
    d = Path(directory)
    planned = engine.executables.planned(prompt_logprobs)
    try:
        saved = json.loads((d / MANIFEST).read_text())
        if not isinstance(saved, dict) or not isinstance(saved.get("files"), dict):
            raise ValueError("not a manifest")
    except (OSError, ValueError) as e:
        say(f"saved executables {d}: none loaded, every bucket compiles: cannot read "
            f"{MANIFEST}: {e}")
        return 0
    devices = engine_devices(engine)
    why = _mismatch(saved, manifest(engine))
    if why:
        say(f"saved executables {d}: none loaded, every bucket compiles: {why}")
        return 0
    loaded, missing = 0, []
    for cache, key in planned:
        name = file_name(key)
        want = saved["files"].get(name)
        if want is None:
            missing.append(name)
            continue
        try:
            blob = (d / name).read_bytes()
            if hashlib.sha256(blob).hexdigest() != want:
                raise ValueError("its sha256 differs from the manifest's (corrupt)")
            payload, in_tree, out_tree = pickle.loads(blob)
            exe = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client,
                execution_devices=devices)
            cache.put(key, exe)
        except Exception as e:  # noqa: BLE001 (any failure: compile this one as usual)
            say(f"saved executables {d}: {name} compiles: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}")
            continue
        loaded += 1
    if missing:
        say(f"saved executables {d}: {len(missing)} not saved, they compile: "
            f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
    return loaded


__all__ = ["MANIFEST", "environment", "file_name", "fresh_compiles", "load", "manifest", "save", "settings_hash"]
