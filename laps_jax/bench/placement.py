"""Where a router put a replay's work: each instance's requests, prompt tokens computed and
tokens decoded, from the instance each answer names (`RequestRecord.served_by`: our router's
`X-Laps-Routed-Instance`, the instance's place in its list; smg's `x-smg-routed-worker-id`, the
instance's URL).

Two routers can miss as many SLOs and still load the instances differently: a closed-loop
trace's throughput follows the session that ends last, and its decoding runs as fast as the
prefill beside it allows (a laps instance runs a decode step before each prefill step). The
per-round figures say whether one router piled the work on one instance; the records, which
keep `served_by`, say where any one request went.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def instance_index(served_by: str | None, urls: Sequence[str]) -> int | None:
    """The place in `urls` of the instance `served_by` names: a place itself (digits) or
    one of the URLs; None when it names none of them."""
    if not served_by:
        return None
    if served_by.isdigit():
        k = int(served_by)
        return k if k < len(urls) else None
    want = served_by.rstrip("/")
    return next((k for k, u in enumerate(urls) if u.rstrip("/") == want), None)


def placement(records: Iterable, urls: Sequence[str]) -> list[dict] | None:
    """Per instance of `urls`: the answered requests that named it, the prompt tokens it
    computed for them (prompt less cached) and the tokens it decoded; plus, for requests
    that named none, an extra last row `unnamed` when there are any. None when no record
    names an instance (a router that does not say, or a direct replay)."""
    rows = [{"requests": 0, "computed_tokens": 0, "output_tokens": 0} for _ in urls]
    unnamed = 0
    for r in records:
        if not r.ok:
            continue
        k = instance_index(r.served_by, urls)
        if k is None:
            unnamed += 1
            continue
        rows[k]["requests"] += 1
        rows[k]["computed_tokens"] += max(r.prompt_tokens - r.cached_tokens, 0)
        rows[k]["output_tokens"] += r.output_tokens
    if not any(row["requests"] for row in rows):
        return None
    return rows + ([{"unnamed": unnamed}] if unnamed else [])


def busiest_share(rows: list[dict] | None, key: str = "computed_tokens") -> float | None:
    """The largest instance's share of `key` over the instances (1 / n: even)."""
    if not rows:
        return None
    xs = [row[key] for row in rows if key in row]
    total = sum(xs)
    return max(xs) / total if total else None
