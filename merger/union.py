"""The union of several streams' copies of one bucket, with every duplicate cross-checked.

Each stream holds its own copy of the gradient and which coverage blocks it got. For one
bucket, a block is known if at least one stream covers it. Where several cover it their
bytes must be identical (they are the same allreduce result, forwarded by different ranks);
the comparison is complete (every byte of every doubly covered block, each copy against
the first stream covering the block, by libc ``memcmp``). A disagreement is reported with
the streams and the block, and the majority copy wins when there is one.

A stream outvoted on some block of the bucket has shown wrong bytes (a flow it misplaced, a
block it assembled from the wrong packets), so where copies tie, its copies do not count:
the block takes the copy every other covering stream agrees on. A block whose copies still
tie is treated as not covered. A wrong stream thus never makes the union worse than leaving
it out would, as long as the others outvote it somewhere in the bucket.

The streams' parsers share one gradient per iteration (``parser/shared_gradient.py``), so
most copies are the same memory: a stream's copy differs from another's only where it kept
units aside (``parser/aside.py``). Copies that are the same memory are equal without reading
a byte, and :func:`merge_held` merges such streams by comparing only the blocks where one of
them kept units aside (:func:`shared_union`): no stream's copy of a bucket is built whole.
Built whole, each copy of a 154 MB bucket cost a copy and a compare of it, in every round
while the bucket was pending.

The merger asks every round whether each pending bucket is complete, so a
:class:`BucketUnion` is lazy: a bucket with a block that no stream covers answers
:attr:`BucketUnion.complete` from the coverage bitmaps alone, and the bytes are compared
once, when ``covered`` or ``mismatches`` is first read. The merged bytes are assembled when
``data`` is read, without allocating: a bucket taken whole from one copy (one stream's, or
the shared memory of several) is that copy itself, and any other is assembled in the
caller's ``scratch`` buffer (reused, so that its pages are mapped once), which every byte is
written to because the blocks tile the bucket. :func:`merge_held` asks for its buffer (a
:data:`Scratch`) only when a bucket of one shared gradient must be assembled, or when the
streams do not share one: the merger's are per iteration (``merger/arenas.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np
from numba import njit

from gradtap.core.jit import JIT
from gradtap.core.memory import compare_bytes


@njit(**JIT)
def _blocks_differ(a, b, start, nbytes, check):
    """``bool[k]``: block j is checked and ``a`` and ``b`` differ in its bytes
    ``[start[j], start[j] + nbytes[j])``. The caller checks the bounds."""
    out = np.zeros(len(start), np.bool_)
    for j in range(len(start)):
        if check[j] and nbytes[j] > 0:
            out[j] = compare_bytes(a, start[j], b, start[j], nbytes[j]) != 0
    return out


@dataclass(frozen=True)
class BlockMismatch:
    block: int                               # global coverage block index
    groups: tuple[tuple[str, ...], ...]      # streams that agree with each other, largest group first
    resolved: bool                           # a strict majority, or the streams not outvoted, decided
    distrusted: tuple[str, ...] = ()         # streams outvoted elsewhere in the bucket, not counted here


@dataclass(frozen=True)
class BucketBlocks:
    """The coverage blocks of one bucket, as byte ranges relative to the bucket's start;
    they tile the bucket in element order."""

    index: np.ndarray      # int64[k]: global block indices, in element order
    start: np.ndarray      # int64[k]: first byte within the bucket
    nbytes: np.ndarray     # int64[k]

    @classmethod
    def of(cls, blocks: np.ndarray, bucket: int, bucket_elem: int, elem: int) -> "BucketBlocks":
        mine = np.flatnonzero(blocks["bucket"] == bucket)
        mine = mine[np.argsort(blocks["elem"][mine], kind="stable")]
        return cls(mine, (blocks["elem"][mine] - bucket_elem) * elem, blocks["nelem"][mine] * elem)


class BucketUnion:
    """The merged bucket (see the module docstring for when the work is done).

    ``data``: ``uint8[bucket bytes]``, meaningful where covered; ``covered``: ``bool[k]``;
    ``mismatches``: the disagreeing blocks. The copies it was built from must not change
    before it is read (the merger reads it at once). ``data`` may be a stream's copy or the
    ``scratch`` buffer: use it before the copies change or another union sharing ``scratch``
    reads its ``data``.
    """

    def __init__(self, blocks: BucketBlocks, copies: list[tuple[str, np.ndarray, np.ndarray]], nbytes: int,
                 scratch: np.ndarray | None = None):
        self._blocks, self._copies, self._nbytes = blocks, copies, nbytes
        self._scratch = scratch

    @property
    def complete(self) -> bool:
        # A block no stream covers settles it without reading a byte.
        if not self._copies or not np.logical_or.reduce([c for _, _, c in self._copies]).all():
            return False
        return bool(self.covered.all())

    @property
    def data(self) -> np.ndarray:
        chosen, covered, _ = self._votes
        blocks, copies = self._blocks, self._copies
        if covered.all() and len(chosen) and all(_same(copies[c][1], copies[chosen[0]][1])
                                                 for c in _present(chosen, len(copies))):
            return copies[chosen[0]][1]            # whole from one copy: as it is
        if covered.all() and self._scratch is not None and self._tiles():
            data = self._scratch[:self._nbytes]    # every byte is written below
        else:
            data = np.zeros(self._nbytes, np.uint8)
        for s, (_, bucket, _) in enumerate(copies):
            # Runs of consecutive blocks taken from one stream are contiguous bytes.
            edges = np.flatnonzero(np.diff(np.r_[0, covered & (chosen == s), 0].astype(np.int8)))
            for first, stop in zip(edges[::2], edges[1::2]):
                lo, hi = blocks.start[first], blocks.start[stop - 1] + blocks.nbytes[stop - 1]
                data[lo:hi] = bucket[lo:hi]
        return data

    @property
    def covered(self) -> np.ndarray:
        return self._votes[1]

    @property
    def mismatches(self) -> tuple[BlockMismatch, ...]:
        return self._votes[2]

    def _tiles(self) -> bool:
        """The blocks cover the bucket's bytes end to end."""
        start, nbytes = self._blocks.start, self._blocks.nbytes
        return bool(len(start) and start[0] == 0 and (start[1:] == start[:-1] + nbytes[:-1]).all()
                    and start[-1] + nbytes[-1] == self._nbytes)

    @cached_property
    def _votes(self) -> tuple[np.ndarray, np.ndarray, tuple[BlockMismatch, ...]]:
        """Per block the stream whose copy is taken, whether it is covered, and the disagreements."""
        blocks, copies = self._blocks, self._copies
        k = len(blocks.index)
        if not copies:
            return np.zeros(k, np.int64), np.zeros(k, bool), ()
        cov = np.stack([c for _, _, c in copies])             # [streams, k]
        count = cov.sum(axis=0)
        chosen = np.argmax(cov, axis=0)                       # the first covering stream of each block
        disagree = np.zeros(k, bool)
        for s, (_, bucket, _) in enumerate(copies):
            for other in _present(chosen[cov[s] & (chosen != s)], len(copies)):
                if _same(bucket, copies[other][1]):
                    continue
                disagree |= _blocks_differ(bucket, copies[other][1], blocks.start, blocks.nbytes,
                                           cov[s] & (chosen == other))
        votes = {int(j): _vote(blocks, copies, cov[:, j], j) for j in np.flatnonzero(disagree)}
        outvoted = np.zeros(len(copies), bool)
        for j, (choice, mismatch) in votes.items():
            if choice is not None:     # everyone outside the winning group is wrong here
                outvoted |= cov[:, j] & np.array([name not in mismatch.groups[0] for name, _, _ in copies])
        mismatches = []
        for j, (choice, mismatch) in votes.items():
            if choice is None and outvoted.any():
                choice, mismatch = _vote(blocks, copies, cov[:, j] & ~outvoted, j, mismatch)
            mismatches.append(mismatch)
            if choice is None:
                count[j] = 0
            else:
                chosen[j] = choice
        return chosen, count > 0, tuple(mismatches)


# Where a bucket that must be assembled is: called when it must be, for ``uint8`` of at least
# the bucket's bytes.
Scratch = Callable[[], np.ndarray]


class SharedUnion:
    """The union of copies that are all one shared gradient's bytes (``shared``, the bucket's)
    except in the blocks ``at`` (positions in the bucket's blocks), where some stream kept
    units aside: :class:`BucketUnion`'s answers, for the price of those blocks. Elsewhere every
    covering copy is the shared bytes, so nothing there can disagree; the blocks ``at`` are
    merged as a bucket of their own (``sub``), which votes and distrusts as any bucket does.
    ``data`` is ``shared`` itself when every vote there kept the shared bytes, else the shared
    bytes with the winning copies laid over, assembled in ``scratch()`` when given."""

    def __init__(self, blocks: BucketBlocks, shared: np.ndarray, covered: list[np.ndarray], at: np.ndarray,
                 sub: BucketUnion | None, scratch: Scratch | None = None):
        self._blocks, self._shared, self._at, self._sub, self._scratch = blocks, shared, at, sub, scratch
        self._any_copy = bool(covered)
        self._any = np.logical_or.reduce(covered) if covered else np.zeros(len(blocks.index), bool)

    @property
    def complete(self) -> bool:
        # A block no stream covers settles it without a vote.
        return self._any_copy and bool(self._any.all()) and bool(self.covered.all())

    @cached_property
    def covered(self) -> np.ndarray:
        out = self._any.copy()
        if self._sub is not None:
            out[self._at] = self._sub.covered
        return out

    @property
    def mismatches(self) -> tuple[BlockMismatch, ...]:
        return () if self._sub is None else self._sub.mismatches

    @property
    def data(self) -> np.ndarray:
        if self._sub is None:
            return self._shared
        sub, blocks, at = self._sub.data, self._blocks, self._at
        edges = np.r_[0, np.cumsum(blocks.nbytes[at])]
        laid = [j for j in np.flatnonzero(self._sub.covered)
                if not np.array_equal(sub[edges[j]:edges[j + 1]],
                                      self._shared[blocks.start[at[j]]:blocks.start[at[j]] + blocks.nbytes[at[j]]])]
        if not laid:
            return self._shared
        n = len(self._shared)
        data = self._scratch()[:n] if self._scratch is not None else np.empty(n, np.uint8)
        data[:] = self._shared
        for j in laid:
            lo = blocks.start[at[j]]
            data[lo:lo + blocks.nbytes[at[j]]] = sub[edges[j]:edges[j + 1]]
        return data


def shared_union(blocks: BucketBlocks, shared: np.ndarray, copies: list[tuple[str, np.ndarray]], at: np.ndarray,
                 patched: list[np.ndarray], scratch: Scratch | None = None) -> SharedUnion:
    """Merge copies of a bucket that are ``shared`` (``uint8[bucket bytes]``) except in the
    blocks ``at``: ``copies`` is ``(stream, covered bool[k])`` per stream, ``patched`` each
    stream's bytes of the blocks ``at``, block after block (``parser/aside.py``)."""
    if not len(at):
        return SharedUnion(blocks, shared, [c for _, c in copies], at, None, scratch)
    nbytes = blocks.nbytes[at]
    starts = np.r_[0, np.cumsum(nbytes)[:-1]].astype(np.int64)
    sub = union(BucketBlocks(blocks.index[at], starts, nbytes), [(s, p, c[at]) for (s, c), p in zip(copies, patched)],
                int(nbytes.sum()))
    return SharedUnion(blocks, shared, [c for _, c in copies], at, sub, scratch)


def merge_held(blocks: BucketBlocks, lo: int, hi: int, need: np.ndarray, held: list, scratch: Scratch | None = None
               ) -> tuple[BucketUnion | SharedUnion, list[tuple[str, np.ndarray]]]:
    """The bucket of the gradient's bytes ``[lo, hi)`` (its blocks ``blocks``, each needing
    ``need``) merged from ``held``, ``(stream, AssembledIteration)`` per stream holding the
    iteration (``parser/stream.py``), and which blocks each stream covers. Streams that place
    into one shared gradient differ only in the blocks where they kept units aside, and only
    those are compared (:func:`shared_union`); streams that do not (one holding the
    iteration's buffer after its reuse) are merged from their whole copies (:func:`union`)."""
    if held and all(a.grad is held[0][1].grad for _, a in held):
        covers = [(s, a.covers(lo, hi, blocks.index, need)) for s, a in held]
        kept = [a.aside.blocks(lo, hi, blocks.index) for _, a in held if len(a.aside)]
        at = np.flatnonzero(np.isin(blocks.index, np.concatenate(kept))) if kept else np.zeros(0, np.int64)
        patched = [a.aside.packed(a.grad, lo, hi, blocks.index[at], blocks.start[at], blocks.nbytes[at])
                   for _, a in held] if len(at) else []
        return shared_union(blocks, held[0][1].grad[lo:hi], covers, at, patched, scratch), covers
    copies = [(s, *a.bucket(lo, hi, blocks.index, need)) for s, a in held]
    return union(blocks, copies, hi - lo, None if scratch is None else scratch()), [(s, c) for s, _, c in copies]


def _present(streams: np.ndarray, n: int) -> np.ndarray:
    """The distinct values of ``streams`` (stream indices below ``n``), ascending: ``np.unique``
    without its sort (a bucket has up to tens of thousands of blocks, and few streams)."""
    return np.flatnonzero(np.bincount(streams, minlength=n))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The two copies are the same memory (both are views of the shared gradient)."""
    return a.ctypes.data == b.ctypes.data and a.shape == b.shape


def union(blocks: BucketBlocks, copies: list[tuple[str, np.ndarray, np.ndarray]], nbytes: int,
          scratch: np.ndarray | None = None) -> BucketUnion:
    """Merge ``copies``: ``(stream, bucket bytes uint8[nbytes], covered bool[k])`` per stream;
    ``scratch``: a reusable ``uint8`` buffer of at least ``nbytes`` to assemble ``data`` in."""
    k = len(blocks.index)
    if k and (blocks.start.min() < 0 or (blocks.start + blocks.nbytes).max() > nbytes):
        raise ValueError(f"bucket blocks reach outside the bucket's {nbytes} bytes")
    for name, bucket, covered in copies:
        if bucket.dtype != np.uint8 or bucket.shape != (nbytes,) or not bucket.flags.c_contiguous \
                or covered.shape != (k,):
            raise ValueError(f"stream {name}: copy is {bucket.dtype}{bucket.shape} with coverage "
                             f"{covered.shape}; the bucket needs contiguous uint8 ({nbytes},) and ({k},)")
    if scratch is not None and (scratch.dtype != np.uint8 or scratch.ndim != 1 or scratch.size < nbytes):
        raise ValueError(f"scratch is {scratch.dtype}{scratch.shape}; the bucket needs uint8 of at least {nbytes}")
    return BucketUnion(blocks, copies, nbytes, scratch)


def _vote(blocks, copies, covering, j, tie: BlockMismatch | None = None) -> tuple[int | None, BlockMismatch]:
    """The copy of block ``j`` a strict majority of the ``covering`` streams agree on, and the
    disagreement to report. With ``tie`` (the report of a vote that tied), ``covering`` leaves
    out the outvoted streams and the value must be unanimous among the rest."""
    lo, hi = blocks.start[j], blocks.start[j] + blocks.nbytes[j]
    groups: dict[bytes, list[int]] = {}
    for s in np.flatnonzero(covering):
        groups.setdefault(copies[s][1][lo:hi].tobytes(), []).append(int(s))
    if tie is not None:
        if len(groups) != 1:
            return None, tie
        (trusted,) = groups.values()
        left = {copies[s][0] for s in trusted}
        return trusted[0], BlockMismatch(tie.block, tie.groups, True,
                                         tuple(n for g in tie.groups for n in g if n not in left))
    ranked = sorted(groups.values(), key=len, reverse=True)
    names = tuple(tuple(copies[s][0] for s in g) for g in ranked)
    majority = len(ranked[0]) * 2 > int(covering.sum())
    return (ranked[0][0] if majority else None), BlockMismatch(int(blocks.index[j]), names, majority)
