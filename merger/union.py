"""The union of several streams' copies of one bucket, with every duplicate cross-checked.

Each stream holds its own copy of the gradient and which coverage blocks it got. For one
bucket, a block is known if at least one stream covers it. Where several cover it their
bytes must be identical (they are the same allreduce result, forwarded by different ranks);
the comparison is complete (every byte of every doubly covered block) and vectorised. A
disagreement is reported with the streams and the block, and the majority copy wins when
there is one; a block whose copies tie is treated as not covered.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockMismatch:
    block: int                               # global coverage block index
    groups: tuple[tuple[str, ...], ...]      # streams that agree with each other, largest group first
    resolved: bool                           # a strict majority decided the value


@dataclass(frozen=True)
class BucketUnion:
    data: np.ndarray          # uint8[bucket bytes]: the merged bucket (meaningful where covered)
    covered: np.ndarray       # bool[blocks of the bucket]
    mismatches: tuple[BlockMismatch, ...]

    @property
    def complete(self) -> bool:
        return bool(self.covered.all())


@dataclass(frozen=True)
class BucketBlocks:
    """The coverage blocks of one bucket, as byte ranges relative to the bucket's start."""

    index: np.ndarray      # int64[k]: global block indices, in element order
    start: np.ndarray      # int64[k]: first byte within the bucket
    nbytes: np.ndarray     # int64[k]

    @classmethod
    def of(cls, blocks: np.ndarray, bucket: int, bucket_elem: int, elem: int) -> "BucketBlocks":
        mine = np.flatnonzero(blocks["bucket"] == bucket)
        mine = mine[np.argsort(blocks["elem"][mine], kind="stable")]
        return cls(mine, (blocks["elem"][mine] - bucket_elem) * elem, blocks["nelem"][mine] * elem)


def union(blocks: BucketBlocks, copies: list[tuple[str, np.ndarray, np.ndarray]], nbytes: int) -> BucketUnion:
    """Merge ``copies``: ``(stream, bucket bytes uint8[nbytes], covered bool[k])`` per stream."""
    k = len(blocks.index)
    data = np.zeros(nbytes, np.uint8)
    if not copies:
        return BucketUnion(data, np.zeros(k, bool), ())
    cov = np.stack([c for _, _, c in copies])             # [streams, k]
    count = cov.sum(axis=0)
    chosen = np.argmax(cov, axis=0)                       # the first covering stream of each block
    disagree = np.zeros(k, bool)
    for s, (_, bucket, _) in enumerate(copies):
        for other in np.unique(chosen[cov[s] & (chosen != s)]):
            both = cov[s] & (chosen == other)
            # Blocks tile the bucket in order, so a per-block sum of byte differences is one reduceat.
            differ = np.add.reduceat(bucket != copies[other][1], blocks.start) > 0
            disagree |= both & differ
    mismatches = []
    for j in np.flatnonzero(disagree):
        choice, mismatch = _vote(blocks, copies, cov[:, j], j)
        mismatches.append(mismatch)
        if choice is None:
            count[j] = 0
        else:
            chosen[j] = choice
    covered = count > 0
    for s, (_, bucket, _) in enumerate(copies):
        take = covered & (chosen == s)
        if take.any():
            np.copyto(data, bucket, where=np.repeat(take, blocks.nbytes))
    return BucketUnion(data, covered, tuple(mismatches))


def _vote(blocks, copies, covering, j) -> tuple[int | None, BlockMismatch]:
    lo, hi = blocks.start[j], blocks.start[j] + blocks.nbytes[j]
    groups: dict[bytes, list[int]] = {}
    for s in np.flatnonzero(covering):
        groups.setdefault(copies[s][1][lo:hi].tobytes(), []).append(int(s))
    ranked = sorted(groups.values(), key=len, reverse=True)
    names = tuple(tuple(copies[s][0] for s in g) for g in ranked)
    majority = len(ranked[0]) * 2 > int(covering.sum())
    return (ranked[0][0] if majority else None), BlockMismatch(int(blocks.index[j]), names, majority)
