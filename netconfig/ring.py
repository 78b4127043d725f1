"""Which allgather chunks a mirrored stream carries, from NCCL's ring step order.

NCCL's ring allreduce (``runRing`` in ``src/device/all_reduce.h``, NCCL v2.19.3-1) splits
each loop into N chunks for N ranks. ``ring->index`` is the rank's ring position r
(its ring distance from rank 0, ``setupChannel`` in ``src/init.cc``). In the allgather
half, position r first sends its own fully-reduced chunk r, then forwards chunks
r-1, r-2, ..., r-(N-2) (mod N); it never sends chunk r+1, which it only receives.

So the link ("hop") from position h to h+1 carries every chunk except (h+1) mod N:

- the **egress** stream of position r (frames its NIC transmits) is hop r and misses
  chunk r+1;
- the **ingress** stream of position r is hop r-1 and misses chunk r;
- a **both** mirror of a port carries the two hops, i.e. every chunk (most of them twice).

Every hop misses a different chunk, so M mirrored hops leave each chunk on at least M-1
of them: with M >= 3 every chunk is carried at least twice. Mirroring the two ends of one
link (egress of r and ingress of r+1) repeats the same gap and buys less.
"""

from __future__ import annotations

from collections.abc import Iterable

from gradtap.netconfig.topology import Direction


def stream_hops(position: int, direction: Direction, n_ranks: int) -> tuple[int, ...]:
    """Ring hops (h = the sending position of link h -> h+1) a mirror of this port carries."""
    egress, ingress = position % n_ranks, (position - 1) % n_ranks
    return {"egress": (egress,), "ingress": (ingress,), "both": (egress, ingress)}[direction]


def missing_chunk(hop: int, n_ranks: int) -> int:
    """The one allgather chunk hop ``hop`` never carries."""
    return (hop + 1) % n_ranks


def chunk_coverage(n_ranks: int, hops: Iterable[int]) -> list[int]:
    """c_k for k = 0..N-1: how many of the mirrored ``hops`` carry allgather chunk k."""
    hops = list(hops)
    coverage = [len(hops)] * n_ranks
    for hop in hops:
        coverage[missing_chunk(hop, n_ranks)] -= 1
    return coverage
