"""Which node of a mirror group owns each gradient bucket (and steps its shard of the replica).

Buckets are dealt out as contiguous ranges in launch order, balanced by elements: the
largest shard is as small as contiguous ranges allow (the least cap under which filling
nodes in order, each up to the cap, needs at most the group's nodes; found by bisection).
Each node's shard is then one contiguous slice of the replica's flat state (buckets sit in
launch order there, ``updater/state.py``), which its snapshot writes as it is. A node
gets no bucket when there are fewer buckets than nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradtap.core.errors import ConfigError


@dataclass(frozen=True)
class Shards:
    """``owner[b]``: the rank of the node that owns bucket b; ``world``: the group's nodes."""

    owner: tuple[int, ...]
    world: int

    @classmethod
    def balanced(cls, bucket_numels: Sequence[int], world: int) -> "Shards":
        if world < 1:
            raise ConfigError(f"mirror group: world_size is {world}; expected 1 or more nodes")
        lo, hi = max(bucket_numels, default=0), sum(bucket_numels)
        while lo < hi:
            cap = (lo + hi) // 2
            if _fill(bucket_numels, cap)[-1:] <= [world - 1]:
                hi = cap
            else:
                lo = cap + 1
        return cls(tuple(_fill(bucket_numels, lo)), world)

    def buckets_of(self, rank: int) -> list[int]:
        return [b for b, r in enumerate(self.owner) if r == rank]


def _fill(bucket_numels: Sequence[int], cap: int) -> list[int]:
    """The node of each bucket when nodes are filled in order, each up to ``cap`` elements."""
    owner, rank, load = [], 0, 0
    for n in bucket_numels:
        if load and load + n > cap:
            rank, load = rank + 1, 0
        owner.append(rank)
        load += n
    return owner
