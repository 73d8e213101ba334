"""Each request's own TTFT target, as the simulator sets it: `scale` x its isolated TTFT.

A fixed TTFT target (say 1 s) says nothing about routing on a trace whose long prompts take
more than that to prefill alone: they miss it under every router, and the short requests a
router can actually protect are a minority of the violations. The simulator (`sim/driver.py`)
gives each request `5 x` its isolated predicted prefill instead; the live benchmark does the
same with a *measured* isolated TTFT: one request at a time on an idle instance, for a ladder
of prompt lengths, the median of a few tries, interpolated linearly in new tokens.

The target uses the request's new tokens as the trace implies them (`RequestRecord.new_tokens`:
a follow-up turn's history counts as cached), not what a router made of them, so a router that
loses a cache hit does not earn a looser target. The cached history's own cost (attention over
it) is left out of the isolated time: for the small CPU model that is a few percent.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import random
import statistics
import time
import urllib.request


@dataclasses.dataclass(frozen=True)
class IsolatedTTFT:
    """Measured isolated TTFT (ms) at a ladder of new-token counts."""

    tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def __call__(self, new_tokens: int) -> float:
        """Linear between the measured points, flat past the ends."""
        n, xs, ys = max(int(new_tokens), 1), self.tokens, self.ms
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1]
        k = bisect.bisect_right(xs, n)
        f = (n - xs[k - 1]) / (xs[k] - xs[k - 1])
        return ys[k - 1] + f * (ys[k] - ys[k - 1])

    def to_json(self) -> dict:
        return {"tokens": list(self.tokens), "ms": [round(m, 2) for m in self.ms]}

    @classmethod
    def from_json(cls, d: dict) -> "IsolatedTTFT":
        return cls(tuple(d["tokens"]), tuple(d["ms"]))


def ladder(max_tokens: int) -> list[int]:
    """Prompt lengths to time: doubling from 8, then halfway steps, up to `max_tokens`."""
    out, n = [], 8
    while n < max_tokens:
        out.append(n)
        n = n * 2 if n < 256 else n + n // 2
    return sorted(set(out + [max_tokens]))


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def time_request(url: str, model: str, ids: list[int], timeout: float = 120.0) -> float:
    """Wall time (ms) of one non-streamed 1-token completion: its TTFT, alone."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    return (time.perf_counter() - t0) * 1000.0


def measure(url: str, vocab_size: int, max_tokens: int, tries: int = 3, seed: int = 0
            ) -> IsolatedTTFT:
    """Times fresh random prompts (no cache hits) of each `ladder` length on the idle instance
    at `url`, one at a time; the median of `tries` per length (after one warm-up request)."""
    rng = random.Random(seed)
    model = served_model(url)
    draw = lambda n: [rng.randrange(10, vocab_size - 10) for _ in range(n)]  # noqa: E731
    time_request(url, model, draw(16))
    lengths = ladder(max_tokens)
    ms = [statistics.median(time_request(url, model, draw(n)) for _ in range(tries))
          for n in lengths]
    for k in range(1, len(ms)):  # a longer prompt never takes less (noise on a shared machine)
        ms[k] = max(ms[k], ms[k - 1])
    return IsolatedTTFT(tuple(lengths), tuple(ms))
