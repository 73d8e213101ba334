"""Failure containment for batched steps: one request's bad data fails that request alone.

A step runs many requests in one executable. When it raises, the lane cannot tell whose data
broke it (a value the packer cannot hold, a NaN, a bug that only one prompt reaches), so it
runs the batch again in halves, and halves of the halves that fail, until a failure has a
single request to its name: that request fails (its pages freed, its client told), the others
finish their step. One bad request in a batch of B costs about 2*log2(B) extra steps, once; a
failure that is not any request's (a broken device) fails each request of the batch once, and
none of them is ever retried. The halves run in the step's planned bucket, which holds them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)


async def run_contained(items: Sequence[T], step: Callable[[list[T]], Awaitable[R]],
                        on_fail: Callable[[T, Exception], Awaitable[None]],
                        passthrough: tuple[type[BaseException], ...] = ()) -> list[R]:
    """`step(items)`, or, when it raises, the results of the sub-steps that ran.

    `on_fail(item, exc)` is awaited for each item that fails on its own. Exceptions of the
    `passthrough` types from the first, whole step propagate (the caller has a better answer
    for them, e.g. out of pages before anything ran). Cancellation always propagates.
    """
    items = list(items)
    try:
        return [await step(items)]
    except asyncio.CancelledError:
        raise
    except passthrough:
        raise
    except Exception as e:  # noqa: BLE001 - whose it is, the halves will tell
        if len(items) == 1:
            await on_fail(items[0], e)
            return []
        log.warning("a step of %d requests failed (%s: %s); running it again in halves to "
                    "find the request at fault", len(items), type(e).__name__, e)
    return await _halves(items, step, on_fail)


async def _halves(items: list[T], step, on_fail) -> list:
    mid = len(items) // 2
    out = []
    for part in (items[:mid], items[mid:]):
        try:
            out.append(await step(part))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            if len(part) == 1:
                await on_fail(part[0], e)
            else:
                out.extend(await _halves(part, step, on_fail))
    return out
