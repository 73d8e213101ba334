"""Which matmul library each long-prefill executable uses on the CPU, chosen by timing both.

XLA CPU hands its dots to YNNPACK. In the blocked attention loop of a long prefill every score
and value product is a small dot that waits on the one before it, and there YNNPACK's per-call
cost (its thread pool's hand-offs) is high: the same executable with each dot a oneDNN primitive
(`ONEDNN_DOTS`) ran the bench-cpu 2048-token prefill 1.15x faster (attention 32 -> 26 ms a
layer, the dense products level). That is not a rule. On Qwen2.5-0.5B shapes at 1,024 tokens
oneDNN was 0.87x (it runs the gate and up products one after the other where YNNPACK runs them
side by side, one core each), below ~512 tokens 0.9x, and a batch-1 decode step 0.45x. So the
engine does not guess: at warm-up each prefill bucket of at least `min_tokens` tokens per row is
also compiled with oneDNN, both run alternately on the bucket's warm-up batch, and oneDNN stays
only where it is clearly faster (`DotChoice.library`).

oneDNN executables cannot go into JAX's persistent compilation cache (XLA has no serializer for
their thunks), so that second compile happens at every start; the default one is cached.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Callable

from laps_jax.engine.executables import Bucket, ExecutableCache
from laps_jax.timing import paired_times

log = logging.getLogger(__name__)

ONEDNN_DOTS = {"xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
# (Not LIBRARY_FUSION_TYPE_DOT: that one also fuses elementwise epilogues into oneDNN graphs,
# and on a plain SwiGLU block it aborted the process at the first run, "partition compile
# failed".)
MARGIN = 0.97  # oneDNN must take at most this fraction of the default's time to be kept
TIMED_TURNS = 7  # each a step of each build, alternately...
BUDGET_SECONDS = 4.0  # ...but no new turn after this long (a 0.5B model's 2,048-token step: 10 s)


@dataclasses.dataclass
class DotChoice:
    """One bucket's timing: median seconds per step with each library."""

    bucket: Bucket
    xla_seconds: float
    onednn_seconds: float
    ratio: float  # median over turns of oneDNN's time / the default's

    @property
    def library(self) -> str:
        """oneDNN only where both the per-turn ratios and the median times say it is faster
        (with few turns on a noisy machine the two can disagree)."""
        faster = self.ratio <= MARGIN and self.onednn_seconds < self.xla_seconds
        return "onednn" if faster else "xla"

    def describe(self) -> str:
        b = self.bucket
        return (f"bucket {b.batch}x{b.tokens}: oneDNN dots {1000 * self.onednn_seconds:.0f} ms, "
                f"XLA's {1000 * self.xla_seconds:.0f} ms a step (median ratio {self.ratio:.2f}) "
                f"-> {self.library}")


def tunable(bucket: Bucket, min_tokens: int, platform: str) -> bool:
    return platform == "cpu" and min_tokens > 0 and not bucket.is_decode \
        and bucket.tokens >= min_tokens


def compile_onednn(cache: ExecutableCache, bucket: Bucket, options: dict | None = None):
    """The bucket compiled with oneDNN dots; None where this jaxlib cannot (no oneDNN on this
    architecture, or an option it does not know) or where no dot went to oneDNN."""
    with warnings.catch_warnings():  # "Error writing persistent compilation cache entry"
        warnings.filterwarnings("ignore", message=".*persistent compilation cache.*")
        try:
            exe = cache.compile_variant(bucket, options or ONEDNN_DOTS)
        except Exception as e:  # noqa: BLE001 - any compile failure means: keep the default
            log.info("no oneDNN build of bucket %s: %s", bucket, str(e).splitlines()[0][:200])
            return None
    return exe if "__onednn_fusion" in exe.as_text() else None


def choose_dots(cache: ExecutableCache, bucket: Bucket, call: Callable[[object], None],
                turns: int = TIMED_TURNS, options: dict | None = None) -> DotChoice | None:
    """Times the bucket's executable against its oneDNN build, alternately (`call(exe)` runs
    one step and waits for it), and keeps the faster in the cache. None: no oneDNN build.
    The decision is the median over turns of the per-turn ratio, so a slow moment of a noisy
    machine hits both builds alike."""
    alt = compile_onednn(cache, bucket, options)
    if alt is None:
        return None
    base = cache.get(bucket)
    # both run once untimed first: a program's first run is slow (runner.prime)
    choice = DotChoice(bucket, *paired_times(lambda: call(base), lambda: call(alt), turns,
                                             budget_s=BUDGET_SECONDS))
    if choice.library == "onednn":
        cache.replace(bucket, alt)
    log.info("%s", choice.describe())
    return choice
