"""Which node of a mirror group owns each gradient bucket (and steps its shard of the replica).

A node's shard is a contiguous range of buckets in launch order, so that it is one
contiguous slice of the replica's flat state (buckets sit in launch order there,
``updater/state.py``), which its snapshot writes as it is; and a parameter's gradient is
whole on one node, which clipping needs to stay bit-exact (``updater/shard.py``). A node
gets no bucket when there are fewer buckets than nodes.

**By size** (:meth:`Shards.balanced`): the largest shard as small as contiguous ranges allow
(the least cap under which filling nodes in order, each up to the cap, needs at most the
group's nodes; found by bisection).

**By coverage** (:meth:`Shards.covering`, when the group's spec lists every node's streams,
``MirrorGroupSpec.streams``). The owner of a bucket must be sent every block of it that none
of its own streams carries: an egress stream of an N-rank ring carries N-1 of the N
allgather chunks, so one egress stream per node lacks 1/N of every bucket it owns. From the
wire plan, :func:`planned_missing` gives, per node and bucket, the bytes the node's streams do
not carry (no loss); the ranges are then chosen, nodes in rank order, to minimise the sum of
those over the owned buckets, with no shard larger than the balanced cap or
``1 + BALANCE_SLACK`` times the mean, whichever is larger; among the cheapest, the most
balanced (the least cap giving the same cost). It is a dynamic programme over bucket
prefixes and nodes, in integers, so every node computes the same owners.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradtap.core.errors import ConfigError
from gradtap.workload.spec import JobSpec, MirrorGroupSpec
from gradtap.workload.wire_plan import DATA, PHASE_AG, WirePlan

BALANCE_SLACK = 0.10       # how much larger than the mean a shard may grow to save exchange


@dataclass(frozen=True)
class Shards:
    """``owner[b]``: the rank of the node that owns bucket b; ``world``: the group's nodes;
    ``placement``: each node's streams, by rank, when ownership followed them (else empty)."""

    owner: tuple[int, ...]
    world: int
    placement: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def balanced(cls, bucket_numels: Sequence[int], world: int) -> "Shards":
        if world < 1:
            raise ConfigError(f"mirror group: world_size is {world}; expected 1 or more nodes")
        return cls(tuple(_fill(bucket_numels, _balanced_cap(bucket_numels, world))), world)

    @classmethod
    def covering(cls, job: JobSpec, plan: WirePlan, placement: Sequence[Sequence[str]]) -> "Shards":
        """Owners that minimise the blocks sent to owners (module docstring), for ``placement``:
        the job's mirror streams each node captures, by rank."""
        world = len(placement)
        if world < 1:
            raise ConfigError("mirror group: a placement of no nodes; list each node's streams")
        numels = list(plan.bucket_numels)
        missing = planned_missing(job, plan, placement)
        floor = _balanced_cap(numels, world)
        cap = max(floor, int(sum(numels) * (1 + BALANCE_SLACK) / world))
        cost, owner = _cheapest(numels, missing, cap)
        lo, hi = floor, cap                  # the least cap that still costs no more
        while lo < hi:
            mid = (lo + hi) // 2
            c, o = _cheapest(numels, missing, mid)
            if c is not None and c <= cost:
                hi, owner = mid, o
            else:
                lo = mid + 1
        return cls(tuple(owner), world, tuple(tuple(p) for p in placement))

    @classmethod
    def of_group(cls, job: JobSpec, plan: WirePlan, group: MirrorGroupSpec) -> "Shards":
        """The group's owners: by coverage when ``group.streams`` lists every node's streams,
        else by size."""
        if group.streams:
            return cls.covering(job, plan, group.streams)
        return cls.balanced(plan.bucket_numels, group.world_size)

    def buckets_of(self, rank: int) -> list[int]:
        return [b for b, r in enumerate(self.owner) if r == rank]

    @property
    def fingerprint(self) -> bytes:
        """8 bytes that differ between two different ownerships (the nodes compare them)."""
        return hashlib.blake2b(repr((self.world, self.owner)).encode(), digest_size=8).digest()


def planned_coverage(job: JobSpec, plan: WirePlan) -> dict[str, np.ndarray]:
    """Per mirror stream of ``job``, ``bool[blocks]``: the coverage blocks of ``plan`` its
    flows carry (every allgather send it sees covers the blocks of the send's elements)."""
    blocks = plan.blocks
    order = np.argsort(blocks["elem"], kind="stable")
    elems = blocks["elem"][order]
    offsets = np.asarray(plan.bucket_offsets, np.int64)
    m = plan.messages
    out = {}
    for mirror in job.mirrors:
        flows = plan.flows_of(mirror.rank, mirror.direction)
        mine = m[np.isin(m["flow"], flows) & (m["kind"] == DATA) & (m["phase"] == PHASE_AG) & (m["wire_bytes"] > 0)]
        lo = offsets[mine["bucket"]] + mine["elem_offset"]
        first = np.searchsorted(elems, lo, side="left")
        last = np.searchsorted(elems, lo + mine["nelem"], side="left")
        marks = np.zeros(len(elems) + 1, np.int64)
        np.add.at(marks, first, 1)
        np.add.at(marks, last, -1)
        covered = np.zeros(len(elems), bool)
        covered[order] = np.cumsum(marks[:-1]) > 0
        out[mirror.name] = covered
    return out


def planned_missing(job: JobSpec, plan: WirePlan, placement: Sequence[Sequence[str]]) -> np.ndarray:
    """``int64[nodes, buckets]``: the bytes of each bucket that none of node r's streams
    (``placement[r]``) carries, as planned (no loss): what its peers send it if it owns the bucket."""
    names = [m.name for m in job.mirrors]
    coverage = planned_coverage(job, plan)
    nbytes = plan.blocks["nelem"].astype(np.int64) * plan.elem_size
    out = np.zeros((len(placement), len(plan.bucket_numels)), np.int64)
    for r, streams in enumerate(placement):
        unknown = [s for s in streams if s not in coverage]
        if unknown:
            raise ConfigError(f"mirror_group.streams[{r}]: {unknown} are not streams of the job "
                              f"({', '.join(names)}); list the names under mirrors:")
        held = np.zeros(len(nbytes), bool)
        for s in streams:
            held |= coverage[s]
        out[r] = np.bincount(plan.blocks["bucket"][~held], weights=nbytes[~held],
                             minlength=len(plan.bucket_numels)).astype(np.int64)
    return out


def _cheapest(numels: Sequence[int], missing: np.ndarray, cap: int) -> tuple[int | None, list[int]]:
    """Contiguous ranges of buckets, node r taking the r-th (maybe empty), none over ``cap``
    elements: the least total ``missing[r, b]`` over owned buckets, and the owners (``None``
    cost when no such ranges exist)."""
    world, n = missing.shape
    load = np.concatenate([[0], np.cumsum(np.asarray(numels, np.int64))])
    # the first bucket a range ending before bucket j may start at, within the cap
    lo = np.searchsorted(load, load - cap, side="left")
    big = np.iinfo(np.int64).max // 4
    best = np.full(n + 1, big, np.int64)
    best[0] = 0
    choice = np.zeros((world, n + 1), np.int64)
    for r in range(world):
        prefix = np.concatenate([[0], np.cumsum(missing[r])])
        base = best - prefix                   # best[i] - prefix[i]: a range i..j costs prefix[j] - prefix[i]
        new = np.full(n + 1, big, np.int64)
        for j in range(n + 1):
            window = base[lo[j]:j + 1]
            i = int(np.argmin(window)) + int(lo[j])
            if base[i] < big // 2:
                new[j] = base[i] + prefix[j]
                choice[r, j] = i
        best = new
    if best[n] >= big // 2:
        return None, []
    owner, j = [0] * n, n
    for r in range(world - 1, -1, -1):
        i = int(choice[r, j])
        owner[i:j] = [r] * (j - i)
        j = i
    return int(best[n]), owner


def _balanced_cap(bucket_numels: Sequence[int], world: int) -> int:
    lo, hi = max(bucket_numels, default=0), sum(bucket_numels)
    while lo < hi:
        cap = (lo + hi) // 2
        if _fill(bucket_numels, cap)[-1:] <= [world - 1]:
            hi = cap
        else:
            lo = cap + 1
    return lo


def _fill(bucket_numels: Sequence[int], cap: int) -> list[int]:
    """The node of each bucket when nodes are filled in order, each up to ``cap`` elements."""
    owner, rank, load = [], 0, 0
    for n in bucket_numels:
        if load and load + n > cap:
            rank, load = rank + 1, 0
        owner.append(rank)
        load += n
    return owner
