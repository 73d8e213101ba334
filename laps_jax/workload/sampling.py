"""Keep a fraction of a trace's conversations, whole: a lighter load with the same reuse.

A time scale lowers a trace's load by stretching every gap, including the minutes between
one turn of a conversation and the next (in the Mooncake trace the median follow-up comes
123 s after its previous turn, the 10th percentile 42 s). A short replay window then holds
almost no follow-up: the first 100 Mooncake requests (33 s) reuse 3% of their blocks, the
whole trace 37%. Sampling conversations instead lowers the arrival rate and keeps each kept
conversation's turns at their own times, so a window of the same length and load holds the
trace's prefix reuse, which is what a cache-aware router is for.

A conversation is what the trace says it is: a sessions trace's session, an Azure request
(the trace has no links), and for Mooncake a chain of requests each of which starts with its
predecessor's prompt. Mooncake links requests only through ``hash_ids``, so a request joins
the conversation of the shortest earlier request that holds the last block of its longest
leading run of known blocks, when that run is at least two blocks and at least half of that
request's blocks; a shorter shared run is a common system prompt, not a conversation (every
request of the conversation trace starts with block 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Hashable


def is_fraction(fraction: float) -> bool:
    """A fraction of conversations one may keep: in (0, 1]."""
    return 0 < fraction <= 1 and math.isfinite(fraction)


def check_fraction(fraction: float) -> float:
    if not is_fraction(fraction):
        raise ValueError(f"the fraction of conversations to keep must be in (0, 1], "
                         f"got {fraction}")
    return fraction


def keeps(conversation: Hashable, fraction: float, seed: int = 0) -> bool:
    """Whether a conversation is in the sample: a stable hash (not Python's salted ``hash``)
    of the seed and its id, below ``fraction``; the same seed keeps the same conversations,
    and a larger fraction keeps a superset."""
    if fraction >= 1:
        return True
    digest = hashlib.blake2b(f"{seed}\x1f{conversation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2 ** 64


@dataclasses.dataclass
class PrefixConversations:
    """Assigns Mooncake-style requests (lists of block hashes, in trace order) to conversations.

    ``assign`` must see every request of the file in order, kept or not: a dropped request
    still names the blocks its follow-ups start with.
    """

    min_blocks: int = 2
    holder: dict[int, int] = dataclasses.field(default_factory=dict)  # block -> shortest holder
    root: list[int] = dataclasses.field(default_factory=list)         # request -> conversation
    n_blocks: list[int] = dataclasses.field(default_factory=list)

    def assign(self, hash_ids: tuple[int, ...]) -> int:
        """The conversation id (the index of its first request) of the next request."""
        index = len(self.root)
        run, last = 0, None
        for h in hash_ids:
            if h not in self.holder:
                break
            run, last = run + 1, self.holder[h]
        joined = last is not None and run >= self.min_blocks and 2 * run >= self.n_blocks[last]
        self.root.append(self.root[last] if joined else index)
        self.n_blocks.append(len(hash_ids))
        for h in hash_ids:  # the shortest request holding a block is the one a longer
            # prompt continues when it stops inside the blocks of a later, longer branch
            if h not in self.holder or self.n_blocks[self.holder[h]] >= len(hash_ids):
                self.holder[h] = index
        return self.root[index]
