"""What a prefill/decode KV hand-off costs: a pull between two processes with JAX's transfer
server against an in-process `device_put` of the same pages (scripts/bench_kv_transfer.py).

A child process plays the prefill instance: it starts a transfer server on loopback and offers
K and V arrays of a model's page shape ([layers, pages, page_size, kv_heads, head_dim], the
copy bucket `KVTransfer` pads to) for each prompt length, once per repetition. This process
pulls each offer (connection kept, as `RemoteKV` keeps it) and times it; the baseline is
`jax.device_put` of the same arrays from host memory. Bytes per token follow from the shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

_CHILD = r"""
import json, sys, numpy as np, jax, jax.numpy as jnp
from jax.experimental import transfer as t
spec = json.loads(sys.argv[1])
s = t.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
keep = []
for i, shape in enumerate(spec["shapes"]):
    x = jnp.asarray(np.random.default_rng(i).standard_normal(shape, dtype=np.float32)
                    ).astype(spec["dtype"])
    for r in range(spec["reps"]):
        s.await_pull(1000 * i + r, [x, x])
    keep.append(x)
print(s.address(), flush=True)
sys.stdin.read()
"""


@dataclasses.dataclass
class Row:
    tokens: int
    pages: int
    bytes: int
    pull_ms: float
    device_put_ms: float
    prefill_ms: float | None = None

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / self.tokens

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["bytes_per_token"] = self.bytes_per_token
        if self.prefill_ms is not None:
            d["transfer_share_of_ttft"] = self.pull_ms / (self.prefill_ms + self.pull_ms)
        return d


def bucket_pages(pages: int, max_pages: int) -> int:
    """The copy bucket (powers of 4, capped at the sequence's page limit), as KVTransfer."""
    n = 1
    while n < pages and n < max_pages:
        n *= 4
    return min(n, max_pages)


def run(layers: int, kv_heads: int, head_dim: int, page_size: int, lengths: list[int],
        reps: int = 5, dtype: str = "float32", max_model_len: int = 4096) -> list[Row]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer
    max_pages = -(-max_model_len // page_size)
    shapes = [[layers, bucket_pages(-(-n // page_size), max_pages), page_size, kv_heads,
               head_dim] for n in lengths]
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps({"shapes": shapes, "reps": reps,
                                                   "dtype": dtype})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
    try:
        address = child.stdout.readline().strip()
        if not address:
            raise RuntimeError("the offering process did not start")
        server = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0",
                                                ["127.0.0.1:0"])
        conn = server.connect(address)
        dev = jax.devices()[0]
        rows = []
        for i, (n, shape) in enumerate(zip(lengths, shapes)):
            spec = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype),
                                        sharding=jax.sharding.SingleDeviceSharding(dev))
            pulls, puts = [], []
            host = np.zeros(shape, dtype=jnp.dtype(dtype))
            for r in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(conn.pull(1000 * i + r, [spec, spec]))
                pulls.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                jax.block_until_ready(jax.device_put([host, host], dev))
                puts.append(time.perf_counter() - t0)
            nbytes = 2 * int(np.prod(shape)) * jnp.dtype(dtype).itemsize
            rows.append(Row(n, shape[1], nbytes, statistics.median(pulls) * 1e3,
                            statistics.median(puts) * 1e3))
        return rows
    finally:
        child.stdin.close()
        child.wait(30)


def table(rows: list[Row]) -> str:
    out = ["| tokens | pages (bucket) | MB moved | bytes/token | pull ms | device_put ms | "
           "prefill ms | transfer share of TTFT |", "|---" * 8 + "|"]
    for r in rows:
        d = r.to_dict()
        share = d.get("transfer_share_of_ttft")
        out.append(f"| {r.tokens} | {r.pages} | {r.bytes / 1e6:.2f} | {r.bytes_per_token:,.0f} | "
                   f"{r.pull_ms:.2f} | {r.device_put_ms:.2f} | "
                   f"{'-' if r.prefill_ms is None else f'{r.prefill_ms:.1f}'} | "
                   f"{'-' if share is None else f'{share:.1%}'} |")
    return "\n".join(out)
