"""What the instances did during one router's replay: device seconds by kind, prefill and decode
steps, and their batch sizes, from the counters in their /metrics (read before and after).

Why: two routers can send the same requests to the same instances and leave them different
work. A router that spreads decoding sequences thin makes more decode steps of one row each;
one that splits short requests into separate steps pays a step's fixed cost more often. The
CPU per request alone says that the instances worked more, not where; these counters say which
kind of step it was (bench_routers.py prints them per router).
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("laps_lane_seconds",        # seconds by kind: prefill, decode, host
            "laps_prefill_batches",     # steps by batch size
            "laps_decode_batches",
            "laps_filled_long_tokens")  # long-chunk tokens in short batches' empty rows


def summed(texts: list[str] | None) -> dict[str, float] | None:
    """`counters` summed over several instances' /metrics texts (routers.metrics_texts);
    None when they could not be read."""
    if texts is None:
        return None
    out: dict[str, float] = {}
    for text in texts:
        for k, v in counters(text).items():
            out[k] = out.get(k, 0.0) + v
    return out


def counters(text: str) -> dict[str, float]:
    """From one /metrics text: `<kind>_s` for lane seconds, `prefill_steps`/`prefill_rows` and
    `decode_steps`/`decode_rows` (rows: the steps' batch sizes summed), `filled_long_tokens`."""
    out: dict[str, float] = {}
    add = lambda k, v: out.__setitem__(k, out.get(k, 0.0) + v)  # noqa: E731
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:  # (matched by sample name: how the parser groups them varies)
            name = s.name[:-len("_total")] if s.name.endswith("_total") else None
            if name not in COUNTERS:
                continue
            if name == "laps_lane_seconds":
                add(f"{s.labels.get('kind', '?')}_s", s.value)
            elif name == "laps_filled_long_tokens":
                add("filled_long_tokens", s.value)
            else:
                kind = name.split("_")[1]  # prefill, decode
                add(f"{kind}_steps", s.value)
                add(f"{kind}_rows", s.value * float(s.labels.get("size", "1")))
    return out


def per_request(before: dict[str, float] | None, after: dict[str, float] | None,
                requests: int) -> dict[str, float]:
    """The counters' growth per request (device seconds as ms), and the mean batch sizes;
    empty when either reading is missing."""
    if before is None or after is None:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = max(requests, 1)
    out = {f"instances_{k[:-2]}_ms_per_request": 1000 * v / n
           for k, v in d.items() if k.endswith("_s")}
    for kind in ("prefill", "decode"):
        steps = d.get(f"{kind}_steps", 0.0)
        out[f"{kind}_steps_per_request"] = steps / n
        if steps:
            out[f"{kind}_batch_mean"] = d.get(f"{kind}_rows", 0.0) / steps
    return out
