"""Prefill latency as a roofline, and the short/long threshold that falls out of it.

A prefill step runs two kinds of kernels, each bound by its compute or its memory traffic:

    t = overhead + max(gemm_flops / peak_flops, weight_bytes / bandwidth)
                 + max(attn_flops / attn_flops_rate, kv_bytes / kv_bandwidth)

On a GPU the attention kernel overlaps its K/V reads with its math (the max above); XLA's CPU
loops do not, and its two CPU attention paths differ in efficiency (the ragged path's items are
small matmuls: about half the FLOP rate of the blocked path's query blocks), so a device may say
`attn_overlap=False` (the two attention terms add) and give the ragged path its own rate. Fitted
to a bench-cpu CPU profile that halves the median error (12% -> 6%), and removes its bias:
single 512-token chunks had been predicted 26-36% slow and batched short re-prefills over long
histories 21-37% fast.

`gemm_flops` is 2 x (layer + lm_head) params x computed tokens and `weight_bytes` the weights
read once per step plus the activations each matmul writes and reads back; `attn_flops` is the
attention over cached + new keys and `kv_bytes` the cached K/V read plus the new K/V written. A
`DeviceSpec` holds the rates; for a real machine they are fitted (non-negative least squares on
relative error) to timings of the engine's own executables (`scripts/profile_latency.py`), for a
GPU they come from its datasheet or measured ceilings. The simulator reuses the same model.

The threshold is the smallest number of new tokens for which a prefill's compute time reaches
its memory time: below it a prefill is memory-bound (extra tokens are almost free, so batching
short requests pays), above it compute-bound (tokens cost their FLOPs: chunk and order them).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from laps_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A device described by numbers: what the simulator and the threshold need."""

    name: str
    peak_flops: float            # attainable dense matmul FLOP/s
    mem_bandwidth: float         # attainable bytes/s
    step_overhead_s: float       # fixed cost of one step (launch, host work, sampling)
    attn_flops: float | None = None    # attention FLOP/s (default: peak_flops)
    kv_bandwidth: float | None = None  # K/V bytes/s of attention (default: mem_bandwidth)
    ragged_attn_flops: float | None = None  # CPU ragged attention FLOP/s (default: attn_flops)
    attn_overlap: bool = True          # attention's compute and K/V traffic overlap (max) or add

    @property
    def attn_rate(self) -> float:
        return self.attn_flops or self.peak_flops

    @property
    def ragged_rate(self) -> float:
        return self.ragged_attn_flops or self.attn_rate

    @property
    def kv_rate(self) -> float:
        return self.kv_bandwidth or self.mem_bandwidth

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceSpec":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# Datasheet H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e.
H200 = DeviceSpec("h200", 989e12, 4.8e12, 40e-6)
# Ceilings measured on this workplace's H200 (its device notes): 788 TFLOP/s bf16 GEMM on random
# data, 4.3 TB/s device-to-device copy.
H200_MEASURED = DeviceSpec("h200-measured", 788e12, 4.3e12, 40e-6)
DEVICES = {d.name: d for d in (H200, H200_MEASURED)}


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One prefill step: each sequence's new and cached tokens, and the computed (padded) shape."""

    new: tuple[int, ...]
    cached: tuple[int, ...]
    batch: int   # rows the executable computes (>= len(new))
    tokens: int  # tokens per row it computes (>= max(new))

    @classmethod
    def exact(cls, new: Sequence[int], cached: Sequence[int] | None = None) -> "StepShape":
        cached = tuple(cached) if cached is not None else (0,) * len(new)
        return cls(tuple(new), cached, len(new), max(new))

    @classmethod
    def bucketed(cls, new: Sequence[int], cached: Sequence[int], batch: int,
                 tokens: int) -> "StepShape":
        return cls(tuple(new), tuple(cached), batch, tokens)


@dataclasses.dataclass(frozen=True)
class StepCost:
    gemm_flops: float
    weight_bytes: float  # weights + activations
    attn_flops: float
    kv_bytes: float      # cached K/V read + new K/V written
    ragged: bool = False  # attention runs on the CPU's ragged path (several short rows)


def _layer_linear_params(cfg: ModelConfig) -> int:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return cfg.num_layers * (h * cfg.q_size + 2 * h * cfg.kv_size + cfg.q_size * h + 3 * h * i)


def step_cost(cfg: ModelConfig, itemsize: int, shape: StepShape, kv_block: int = 1,
              q_block: int = 256) -> StepCost:
    """FLOPs and bytes of a step. kv_block > 1: the CPU XLA path, in blocks of kv_block keys:
    one sequence, or rows longer than a query block (`q_block`), walk every row to the batch's
    longest context; several shorter rows (decode, short re-prefills) run their (sequence,
    block) items `batch` at a time (ragged: as far as the mean context). kv_block 1: exact per
    sequence. Both blocks are the engine's (`pallas_kernels.attention_blocks`), stored with a
    fitted model, so the scheduler and the simulator import no kernel and no JAX."""
    lin = _layer_linear_params(cfg)
    h, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    rows_tokens = shape.batch * shape.tokens
    gemm = 2.0 * lin * rows_tokens + 2.0 * h * V * shape.batch
    kvb = cfg.kv_bytes_per_token(itemsize)
    per_qk = 4.0 * L * cfg.num_heads * cfg.head_dim  # QK^T and PV, per query per key
    ragged = kv_block > 1 and shape.batch > 1 and shape.tokens <= q_block
    if kv_block > 1:
        blocks = [-(-(c + n) // kv_block) for n, c in zip(shape.new, shape.cached)]
        if ragged:
            kv = -(-sum(blocks) // shape.batch) * kv_block
        else:
            kv = max(blocks) * kv_block
        attn = per_qk * rows_tokens * kv
        kv_read = shape.batch * kv * kvb
        kv_write = rows_tokens * kvb
    else:
        attn = sum(per_qk * n * (c + (n + 1) / 2) for n, c in zip(shape.new, shape.cached))
        kv_read = sum(c + n for n, c in zip(shape.new, shape.cached)) * kvb
        kv_write = sum(shape.new) * kvb
    weights = itemsize * (lin + L * 2 * h + h + V * h)  # layers, norms, lm_head (embed: gather)
    act_per_token = L * itemsize * (5 * h + 2 * cfg.q_size + 2 * cfg.kv_size
                                    + 3 * cfg.intermediate_size)
    return StepCost(gemm, weights + act_per_token * rows_tokens, attn, kv_read + kv_write, ragged)


@dataclasses.dataclass
class LatencyModel:
    """Predicts step latency for one model on one device; finds the short/long threshold."""

    cfg: ModelConfig
    itemsize: int
    device: DeviceSpec
    kv_block: int = 1
    q_block: int = 256  # the engine's ragged cut (only read when kv_block > 1)

    def kernel_times(self, shape: StepShape) -> tuple[float, float, float, float]:
        """(gemm compute, weight memory, attention compute, K/V memory) seconds."""
        c = step_cost(self.cfg, self.itemsize, shape, self.kv_block, self.q_block)
        d = self.device
        return (c.gemm_flops / d.peak_flops, c.weight_bytes / d.mem_bandwidth,
                c.attn_flops / (d.ragged_rate if c.ragged else d.attn_rate),
                c.kv_bytes / d.kv_rate)

    def terms(self, shape: StepShape) -> tuple[float, float]:
        """(compute seconds, memory seconds) of a step, overhead excluded."""
        g, w, a, k = self.kernel_times(shape)
        return g + a, w + k

    def predict(self, shape: StepShape) -> float:
        g, w, a, k = self.kernel_times(shape)
        return self.device.step_overhead_s + max(g, w) + (
            max(a, k) if self.device.attn_overlap else a + k)

    def predict_prefill(self, new: int, cached: int = 0, grid=None) -> float:
        """Isolated prefill of `new` tokens over `cached`: chunks of the grid's largest bucket,
        each padded to its smallest bucket (exact shapes without a grid)."""
        total, done = 0.0, 0
        chunk = grid.max_chunk if grid is not None else max(new, 1)
        while done < new:
            n = min(chunk, new - done)
            if grid is not None:
                b = grid.fit_prefill(1, n)
                shape = StepShape.bucketed((n,), (cached + done,), b.batch, b.tokens)
            else:
                shape = StepShape.exact((n,), (cached + done,))
            total += self.predict(shape)
            done += n
        return total

    def threshold(self, cached: int = 0, limit: int = 1 << 20) -> int:
        """Smallest new-token count whose single-sequence prefill over `cached` tokens is
        compute-bound (compute term >= memory term)."""
        def bound(n: int) -> bool:
            comp, mem = self.terms(StepShape.exact((n,), (cached,)))
            return comp >= mem
        hi = 1
        while not bound(hi):
            hi *= 2
            if hi > limit:
                return limit
        lo = hi // 2 + 1 if hi > 1 else 1
        while lo < hi:
            mid = (lo + hi) // 2
            if bound(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def scaled(self, f: float) -> "LatencyModel":
        """The same model on a device f times slower (every predicted step x f)."""
        d = self.device
        dev = dataclasses.replace(d, name=f"{d.name}x{f:.3f}", peak_flops=d.peak_flops / f,
                                  mem_bandwidth=d.mem_bandwidth / f,
                                  step_overhead_s=d.step_overhead_s * f,
                                  attn_flops=d.attn_rate / f, kv_bandwidth=d.kv_rate / f,
                                  ragged_attn_flops=d.ragged_rate / f)
        return dataclasses.replace(self, device=dev)

    def to_dict(self) -> dict:
        return {"model": self.cfg.name, "itemsize": self.itemsize, "kv_block": self.kv_block,
                "q_block": self.q_block, "device": self.device.to_dict()}

    @classmethod
    def from_dict(cls, d: dict, cfg: ModelConfig) -> "LatencyModel":
        return cls(cfg, int(d["itemsize"]), DeviceSpec.from_dict(d["device"]),
                   int(d.get("kv_block", 1)), int(d.get("q_block", 256)))

    @classmethod
    def load(cls, path: str, cfg: ModelConfig) -> "LatencyModel":
        with open(path) as f:
            return cls.from_dict(json.load(f)["latency_model"], cfg)

    @classmethod
    def fit(cls, cfg: ModelConfig, itemsize: int, shapes: Sequence[StepShape],
            seconds: Sequence[float], blocks: tuple[int, int] = (1, 256),
            name: str = "fitted") -> "LatencyModel":
        """Fits overhead and the rates to measured step times (see `fit_roofline`); `blocks`
        is the engine's (kv_block, q_block)."""
        costs = [step_cost(cfg, itemsize, s, *blocks) for s in shapes]
        f = fit_roofline(costs, seconds)
        inv = lambda c: 1.0 / c if c > 0 else 1e30  # a rate never limiting stays "infinite"
        ragged = inv(f.s_ragged_flop) if any(c.ragged for c in costs) else None
        dev = DeviceSpec(name, inv(f.s_gemm_flop), inv(f.s_weight_byte), f.overhead,
                         inv(f.s_attn_flop), inv(f.s_kv_byte), ragged, f.overlap)
        return cls(cfg, itemsize, dev, *blocks)


def _nnls_small(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of unknowns: best feasible active set
    (for each subset of columns the unconstrained solution; keep the best all-non-negative)."""
    k = A.shape[1]
    best, best_res = np.zeros(k), float(np.sum(b * b))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((A[:, cols] @ x - b) ** 2))
            if res < best_res:
                best_res, best = res, np.zeros(k)
                best[list(cols)] = x
    return best


class Roofline(NamedTuple):
    """Fitted seconds per unit of each cost (0: never limiting) and the attention form."""

    overhead: float
    s_gemm_flop: float
    s_weight_byte: float
    s_attn_flop: float
    s_ragged_flop: float
    s_kv_byte: float
    overlap: bool  # attention = max(compute, K/V) (True) or their sum


def fit_roofline(costs: Sequence[StepCost], seconds: Sequence[float]) -> Roofline:
    """Non-negative coefficients minimising the relative squared error of
    overhead + max(gemm, weights) + attention, attention being max(compute, K/V) or their sum
    (both forms are fitted; the better one is kept). Attention compute has two rates: blocked
    and (CPU) ragged.

    Given which side of its ridge each max() term sits on in every sample, the model is linear;
    the ridge is a cut in the order of arithmetic intensity, so start from cuts at every decile of
    both intensities, solve each by NNLS, reassign regimes from the solution until stable, and
    keep the best.
    """
    t = np.asarray(seconds, float)
    X = np.array([[c.gemm_flops, c.weight_bytes, c.attn_flops * (not c.ragged),
                   c.attn_flops * c.ragged, c.kv_bytes] for c in costs], float)
    scale = np.concatenate([[1.0], np.maximum(X.max(0), 1.0)])

    def solve(mem_g: np.ndarray, mem_a: np.ndarray, overlap: bool) -> np.ndarray:
        A = np.zeros((len(t), 6))
        A[:, 0] = 1.0
        A[~mem_g, 1], A[mem_g, 2] = X[~mem_g, 0], X[mem_g, 1]
        comp = ~mem_a if overlap else np.ones(len(t), bool)
        mem = mem_a if overlap else np.ones(len(t), bool)
        A[comp, 3], A[comp, 4], A[mem, 5] = X[comp, 2], X[comp, 3], X[mem, 4]
        A = A / scale / t[:, None]
        return _nnls_small(A, np.ones(len(t))) / scale

    def attention(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (compute, K/V) seconds
        return X[:, 2] * x[3] + X[:, 3] * x[4], X[:, 4] * x[5]

    def predict(x: np.ndarray, overlap: bool) -> np.ndarray:
        a, k = attention(x)
        return (x[0] + np.maximum(X[:, 0] * x[1], X[:, 1] * x[2])
                + (np.maximum(a, k) if overlap else a + k))

    def cuts(intensity: np.ndarray) -> list[np.ndarray]:
        qs = np.quantile(intensity, np.linspace(0, 1, 11))
        return [intensity <= q for q in qs] + [np.zeros(len(t), bool)]

    gi = X[:, 0] / np.maximum(X[:, 1], 1.0)
    ai = (X[:, 2] + X[:, 3]) / np.maximum(X[:, 4], 1.0)
    none = np.zeros(len(t), bool)
    best, best_err, tried = None, math.inf, set()
    for overlap in (True, False):
        for mg in cuts(gi):
            for ma in (cuts(ai) if overlap else [none]):
                for _ in range(20):
                    key = (overlap, mg.tobytes(), ma.tobytes())
                    if key in tried:
                        break
                    tried.add(key)
                    x = solve(mg, ma, overlap)
                    err = float(np.sum(((predict(x, overlap) - t) / t) ** 2))
                    if err < best_err:
                        best, best_err = Roofline(*(float(v) for v in x), overlap), err
                    a, k = attention(x)
                    mg = X[:, 1] * x[2] > X[:, 0] * x[1]
                    ma = k > a if overlap else none
    return best


def relative_errors(model: LatencyModel, shapes: Iterable[StepShape],
                    seconds: Iterable[float]) -> list[float]:
    return [abs(model.predict(s) - t) / t for s, t in zip(shapes, seconds)]
