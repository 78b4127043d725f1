"""Slow twin of netconfig.ring: replay NCCL's runRing loop literally and record what each rank sends.

The step list mirrors ``runRing`` in ``src/device/all_reduce.h`` (NCCL v2.19.3-1), with the
rank's ring index ``ringIx``; "sends" are the primitives that push to the next rank.
"""

from __future__ import annotations


def run_ring_steps(ring_ix: int, nranks: int) -> list[tuple[str, str, int]]:
    """(phase, primitive, chunk) for every step of one loop, in order."""
    mod = lambda r: r - (nranks if r >= nranks else 0)  # noqa: E731  (NCCL's modRanks)
    steps = [("reduce-scatter", "send", mod(ring_ix + nranks - 1))]
    for j in range(2, nranks):
        steps.append(("reduce-scatter", "recvReduceSend", mod(ring_ix + nranks - j)))
    steps.append(("allgather", "directRecvReduceCopySend", ring_ix))
    for j in range(1, nranks - 1):
        steps.append(("allgather", "directRecvCopySend", mod(ring_ix + nranks - j)))
    steps.append(("allgather", "directRecv", mod(ring_ix + 1)))
    return steps


SENDING = {"send", "recvReduceSend", "directRecvReduceCopySend", "directRecvCopySend"}


def allgather_chunks_sent(ring_ix: int, nranks: int) -> set[int]:
    """Fully reduced chunks that ring position ``ring_ix`` transmits to position ``ring_ix + 1``."""
    return {chunk for phase, prim, chunk in run_ring_steps(ring_ix, nranks)
            if phase == "allgather" and prim in SENDING}


def coverage_by_replay(nranks: int, hops: list[int]) -> list[int]:
    return [sum(k in allgather_chunks_sent(h, nranks) for h in hops) for k in range(nranks)]
