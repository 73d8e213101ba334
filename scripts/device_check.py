"""One command for a GPU session: native kernel tests, then attention timings against rooflines.

On a GPU it runs tests/test_kernels.py with LAPS_PALLAS_INTERPRET=0 (Pallas lowered to Triton),
measures copy bandwidth (big array copy) and the bf16 matmul rate (8192^3), and times prefill
attention at (new, cached) = (128,0), (128,4096), (2048,0), (8192,0) and decode at 64 x 4096
with the Qwen2.5-32B head layout (40 q / 8 kv heads, head_dim 128) for the pallas and xla
backends. Each time is the median of several block_until_ready runs after warm-up. The table
comes last. `--quick` shrinks everything so it runs on CPU (interpreted Pallas) in a minute.

Then it builds a Qwen2.5-32B-shaped server engine with random bfloat16 weights (--model), loads
the executables `--compile-only --save` wrote (--executables DIR; what does not match compiles,
one line says why), and times every prefill bucket (full rows, nothing cached) and every decode
bucket (over 1,024 cached tokens). Everything goes to one JSON file: --json, or
$OUT/device_check.json when $OUT is set.

    python scripts/device_check.py --executables exe-tp1   # on the H200 (under 10 minutes)
    python scripts/device_check.py --quick    # anywhere, to check the script works

`--compile-only` needs no GPU, only the CUDA plugin (`pip install -e ".[gpu-aot]"`): XLA's GPU
compiler builds, for an H200 or H100 this machine does not have, every executable the GPU server
would compile (each prefill and decode bucket, the prompt log-prob buckets, the KV hand-off
copies; scan layer loop, bfloat16, Pallas kernels as Triton), one line each with its compile
seconds and argument, output and temp bytes, and exits 1 if any fails (laps_jax/engine/aot.py).
The engine flags set the grid; `--tensor-parallel N` compiles over N such devices. `--save DIR`
writes the executables for `serve.py --executables DIR`:

    python scripts/device_check.py --compile-only --model qwen2.5-32b --tensor-parallel 8 \
        --report tp8.json --save exe-tp8
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compile_parser() -> argparse.ArgumentParser:
    from laps_jax.cli import add_engine_args
    from laps_jax.engine.gpu_targets import DEVICES
    ap = argparse.ArgumentParser(description="compile the GPU server's executables for a GPU "
                                             "this machine does not have (nothing allocated)")
    ap.add_argument("--compile-only", action="store_true", required=True)
    ap.add_argument("--device", choices=DEVICES, default="h200",
                    help="the GPU compiled for (default h200)")
    ap.add_argument("--no-prompt-logprobs", dest="prompt_logprobs", action="store_false",
                    help="skip the prompt log-prob buckets (prefill_batch.py's)")
    ap.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    ap.add_argument("--save", type=Path, default=None, metavar="DIR",
                    help="also write the executables and a manifest to DIR (serve.py "
                         "--executables DIR loads them on that GPU and compiles nothing)")
    add_engine_args(ap, default_model="qwen2.5-32b")
    ap.set_defaults(dtype="bfloat16")
    return ap


def compile_only(argv: list[str]) -> int:
    """--compile-only: one line per executable, a summary; 1 if any failed, 2 for bad settings
    or no CUDA plugin."""
    args = compile_parser().parse_args(argv)
    from laps_jax.cli import engine_config_from_args
    from laps_jax.config import ConfigError, resolve_model
    from laps_jax.engine.gpu_targets import INSTALL_HINT, compile_devices, plugin_installed
    if not plugin_installed():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from laps_jax.engine.aot import abstract_engine, compile_all
    try:
        cfg = resolve_model(args.model)[0]
        devices = compile_devices(args.device, args.tensor_parallel)
        engine = abstract_engine(cfg, engine_config_from_args(args), args.dtype, devices)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    e = engine.ecfg
    print(f"{cfg.name} {args.dtype}, tensor parallel {args.tensor_parallel}, "
          f"{e.attention_backend} attention, {e.layer_loop} layer loop, compiling for "
          f"{devices[0].device_kind} x{len(devices)}", flush=True)
    report = compile_all(engine, args.prompt_logprobs, lambda p: print(p.format(), flush=True),
                         device=args.device)
    print(report.summary())
    if args.save:
        from laps_jax.engine import executable_store
        from laps_jax.engine.aot import native_pallas
        with native_pallas():  # recorded as the GPU server will run them: Triton, not interpreted
            n = executable_store.save(engine, args.save)
        print(f"saved {n} executables and {executable_store.MANIFEST} to {args.save}")
    if args.report:
        args.report.write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__" and "--compile-only" in sys.argv[1:]:
    sys.exit(compile_only(sys.argv[1:]))  # without the GPU timing's setup below
# The pytest child shares the GPU with this process: neither may grab 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from laps_jax.pallas_kernels import paged_attention  # noqa: E402


def timeit(fn, *args, runs: int) -> float:
    """Median milliseconds of fn(*args) over `runs` calls after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_tests(quick: bool, native: bool) -> int:
    """pytest on the kernel tests in a subprocess (natively when on GPU)."""
    env = dict(os.environ, LAPS_PALLAS_INTERPRET="0" if native else "1")
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests/test_kernels.py"), "-q", "-x"]
    if quick:
        cmd += ["-k", "single_g1 or decode_g1"]
    print("$ LAPS_PALLAS_INTERPRET=" + env["LAPS_PALLAS_INTERPRET"], shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def measure_peaks(copy_mib: int, mm: int, runs: int) -> tuple[float, float]:
    """(GB/s of a big array copy counting read + write, TFLOP/s of a bf16 mm^3 matmul)."""
    n = copy_mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    ms = timeit(jax.jit(lambda a: a + 1.0), x, runs=runs)  # a copy XLA cannot elide
    gbs = 2 * x.nbytes / ms / 1e6
    a = jax.random.normal(jax.random.key(0), (mm, mm), jnp.bfloat16)
    ms = timeit(jax.jit(lambda a, b: a @ b), a, a, runs=runs)
    return gbs, 2 * mm**3 / ms / 1e9


def attention_case(B: int, new: int, cached: int, nq: int, kvh: int, hd: int, page_size: int,
                   dtype, seed: int = 0):
    """Random inputs for B sequences of `new` tokens over `cached` ones, shuffled pages."""
    kv = new + cached
    P = -(-kv // page_size)
    num_pages = B * P
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, new, nq, hd), dtype)
    k = jax.random.normal(ks[1], (1, num_pages, page_size, kvh, hd), dtype)
    v = jax.random.normal(ks[2], (1, num_pages, page_size, kvh, hd), dtype)
    table = jnp.asarray(np.random.default_rng(seed).permutation(num_pages).reshape(B, P),
                        jnp.int32)
    q_lens = jnp.full((B,), new, jnp.int32)
    cached_lens = jnp.full((B,), cached, jnp.int32)
    return q, k, v, jnp.int32(0), q_lens, cached_lens, table


def attention_cost(B: int, new: int, cached: int, nq: int, kvh: int, hd: int,
                   itemsize: int) -> tuple[float, float]:
    """(causal FLOPs, minimal HBM bytes: q, out, and each needed K/V row read once)."""
    keys_seen = new * cached + new * (new + 1) / 2  # sum over queries of visible keys
    flops = 4 * B * nq * hd * keys_seen
    nbytes = B * itemsize * hd * (2 * new * nq + 2 * (new + cached) * kvh)
    return flops, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke check)")
    ap.add_argument("--skip-tests", action="store_true", help="only time, no pytest")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per case (median)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None,
                    help="write everything here (default $OUT/device_check.json if $OUT is set)")
    ap.add_argument("--model", default=None,
                    help="the engine timed (default qwen2.5-32b; tiny with --quick)")
    ap.add_argument("--executables", default=None, metavar="DIR",
                    help="saved executables to load (device_check.py --compile-only --save)")
    ap.add_argument("--skip-engine", action="store_true", help="no engine bucket timings")
    args = ap.parse_args()
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "device_check.json"
    native = jax.default_backend() == "gpu"
    runs = args.runs or (3 if args.quick else 10)
    print(f"backend={jax.default_backend()} devices={jax.devices()} "
          f"pallas={'native (Triton)' if native else 'interpreted'}", flush=True)

    rc = 0 if args.skip_tests else run_tests(args.quick, native)
    t0 = time.perf_counter()
    gbs, tflops = measure_peaks(64 if args.quick else 4096, 512 if args.quick else 8192, runs)
    print(f"peaks: copy {gbs:.0f} GB/s, bf16 matmul {tflops:.1f} TFLOP/s", flush=True)

    if args.quick:
        nq, kvh, hd, dtype = 10, 2, 64, jnp.float32
        prefill = [(32, 0), (32, 64), (64, 0)]
        decode_batch, decode_cached = 4, 64
    else:
        nq, kvh, hd, dtype = 40, 8, 128, jnp.bfloat16
        prefill = [(128, 0), (128, 4096), (2048, 0), (8192, 0)]
        decode_batch, decode_cached = 64, 4096
    cases = [("prefill", 1, n, c) for n, c in prefill]
    cases.append(("decode", decode_batch, 1, decode_cached))
    rows = []
    for kind, B, new, cached in cases:
        inputs = attention_case(B, new, cached, nq, kvh, hd, args.page_size, dtype)
        flops, nbytes = attention_cost(B, new, cached, nq, kvh, hd, jnp.dtype(dtype).itemsize)
        for backend in ("pallas", "xla"):
            fn = jax.jit(lambda *a, backend=backend: paged_attention(
                *a, scale=hd ** -0.5, backend=backend))
            try:
                ms = timeit(fn, *inputs, runs=runs)
            except Exception as e:  # report and go on: one failing lowering must not hide the rest
                print(f"{kind} B={B} new={new} cached={cached} {backend}: FAILED {e!r}"[:400])
                ms = float("nan")
            row = dict(kind=kind, batch=B, new=new, cached=cached, backend=backend, ms=ms,
                       tflops=flops / ms / 1e9, gbs=nbytes / ms / 1e6)
            row.update(pct_matmul=100 * row["tflops"] / tflops, pct_copy=100 * row["gbs"] / gbs)
            rows.append(row)
            print(f"{kind} B={B} new={new} cached={cached} {backend}: {ms:.3f} ms", flush=True)
        del inputs

    print(f"\nattention, {nq}q/{kvh}kv heads, head_dim {hd}, {jnp.dtype(dtype).name}, "
          f"page {args.page_size}; peaks: copy {gbs:.0f} GB/s, matmul {tflops:.1f} TFLOP/s; "
          f"timing took {time.perf_counter() - t0:.0f} s; kernel tests rc={rc}")
    print(f"{'case':<26}{'backend':<8}{'ms':>10}{'TFLOP/s':>10}{'%mm':>7}{'GB/s':>9}{'%copy':>7}")
    for r in rows:
        name = f"{r['kind']} {r['batch']}x{r['new']}+{r['cached']}"
        print(f"{name:<26}{r['backend']:<8}{r['ms']:>10.3f}{r['tflops']:>10.2f}"
              f"{r['pct_matmul']:>7.1f}{r['gbs']:>9.0f}{r['pct_copy']:>7.1f}")
    result = dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, copy_gbs=gbs, matmul_tflops=tflops, tests_rc=rc,
                  rows=rows)
    if not args.skip_engine:
        result["engine"] = engine_timings(args, runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    sys.exit(rc)


def engine_timings(args, runs: int) -> dict:
    """A server engine (random weights) built as serve.py builds it, its saved executables
    loaded, then every bucket timed (laps_jax/bench/bucket_timing.py)."""
    from laps_jax import builder
    from laps_jax.bench.bucket_timing import time_buckets
    from laps_jax.config import EngineConfig
    model = args.model or ("tiny" if args.quick else "qwen2.5-32b")
    ecfg = EngineConfig(max_chunk=64, max_prefill_batch=2, max_decode_batch=2,
                        kv_cache_tokens=4096) if args.quick else EngineConfig()
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    lines = []
    say = lambda m: (print(m, flush=True), lines.append(m))
    try:
        built = builder.build(builder.EngineBuild(model, ecfg, dtype=dtype,
                                                  executables=args.executables), log=say)
        timings = time_buckets(built.engine, min(runs, 5), say=say)
    except Exception as e:  # noqa: BLE001 (the rest of the JSON still gets written)
        say(f"engine timing FAILED {type(e).__name__}: {str(e).strip()[:400]}")
        return dict(model=model, error=f"{type(e).__name__}: {e}"[:2000], log=lines)
    return dict(model=model, dtype=dtype, load_s=built.load_seconds,
                start_s=built.compile_seconds, log=lines, **timings)


if __name__ == "__main__":
    main()
