"""The wire plan's per-message arithmetic over whole columns (NumPy, no per-message Python).

:func:`gradtap.workload.wire_plan.build_plan` lists the sends of every call with
:meth:`CallSchedule.send_table <gradtap.workload.ring_schedule.CallSchedule.send_table>`, and
these functions turn them into RDMA writes and coverage blocks. They take and return plain
``int64`` arrays (one entry per send, write or message); ``wire_plan`` packs them into its
structured arrays. ``tests/workload/naive_plan.py`` is the per-message loop they must equal.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from gradtap.workload import nccl as N


def part_bounds(msg_bytes: np.ndarray, nparts: int) -> tuple[np.ndarray, np.ndarray]:
    """``int64[messages, nparts]`` offsets and lengths of each QP's part of each message
    (ncclIbMultiSend: parts of ``divUp(bytes, nparts)`` rounded up to 128 bytes; the last
    parts may be short or empty). The scalar form is :func:`wire_plan.send_parts`."""
    msg_bytes = np.asarray(msg_bytes, dtype=np.int64)
    part = -(-(-(-msg_bytes // nparts)) // N.QP_SPLIT_ALIGN) * N.QP_SPLIT_ALIGN
    offset = np.arange(nparts, dtype=np.int64)[None, :] * part[:, None]
    length = np.maximum(0, np.minimum(part[:, None], msg_bytes[:, None] - offset))
    return offset, length


def packet_counts(nbytes: np.ndarray, mtu: int) -> np.ndarray:
    """Packets of RDMA WRITEs of ``nbytes`` payload (a zero-length write is one packet)."""
    return np.maximum(1, -(-nbytes // mtu))


def segment_ranks(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of ``counts`` items laid end to end: each item's segment and its rank
    within it (``np.repeat`` with the running index)."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    seg = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return seg, np.arange(len(seg), dtype=np.int64) - starts[seg]


class Writes(NamedTuple):
    """The RDMA writes of a list of sends, in posting order: for each send its QP parts in
    order, each part a WRITE with immediate, or under adaptive routing a plain WRITE then a
    zero-length WRITE with immediate (``remote`` -1: no VA). Arrays of one entry per write."""

    send: np.ndarray         # index of the send the write carries
    part: np.ndarray
    qp: np.ndarray
    imm: np.ndarray
    part_offset: np.ndarray
    wire_bytes: np.ndarray
    remote_offset: np.ndarray   # from the slot's VA; -1 for the zero-length immediate


def writes(msg_bytes: np.ndarray, fifo_seq: np.ndarray, slot_va: np.ndarray, nqps: int, split: bool,
           rotates: bool, ar: np.ndarray, no_va: int) -> Writes:
    """Cut sends (``msg_bytes``, ``fifo_seq``: their receive on the connection, ``slot_va``:
    the FIFO slot's offset in the receive buffer, ``ar``: adaptive routing applies) into
    RDMA writes over ``nqps`` QPs. Split: part q of message k goes on QP q, from 2.29 on QP
    (k + q) mod nqps (``rotates``); unsplit: message k goes whole on QP k mod nqps."""
    nparts = nqps if split else 1
    offset, length = part_bounds(msg_bytes, nparts)
    parts = np.arange(nparts, dtype=np.int64)
    if split:
        first = fifo_seq % nqps if rotates else np.zeros_like(fifo_seq)
        qp = (first[:, None] + parts[None, :]) % nqps
    else:
        qp = (fifo_seq % nqps)[:, None]
    send = np.repeat(np.arange(len(msg_bytes), dtype=np.int64), nparts)
    part = np.tile(parts, len(msg_bytes))
    qp, offset, length = qp.ravel(), offset.ravel(), length.ravel()
    # Adaptive routing: each part becomes two writes (the bulk, then the zero-length immediate).
    w, sub = segment_ranks(1 + ar[send].astype(np.int64))
    bulk = ~ar[send[w]]
    imm = np.where(bulk, 1, sub)
    zero = sub == 1
    return Writes(send=send[w], part=part[w], qp=qp[w], imm=imm, part_offset=offset[w],
                  wire_bytes=np.where(zero, 0, length[w]),
                  remote_offset=np.where(zero, no_va, slot_va[send[w]] + offset[w]))


class Blocks(NamedTuple):
    """Coverage blocks (columns of ``wire_plan.BLOCK_DTYPE``) and each message's first block."""

    bucket: np.ndarray
    elem: np.ndarray
    nelem: np.ndarray
    need: np.ndarray
    first: np.ndarray        # per message given: index of its first block


def coverage_blocks(key: np.ndarray, part: np.ndarray, flat: np.ndarray, nbytes: np.ndarray, total: np.ndarray,
                    ll128: np.ndarray, per_wire: np.ndarray, elem: int, mtu: int, nparts: int,
                    slice_wire: int, slice_data: int, slice_need: int) -> Blocks:
    """The coverage blocks of allgather writes (see ``wire_plan._coverage_blocks``).

    ``key`` (``int64[messages, k]``, column 0 the bucket) groups the writes that carry the
    same send (bucket, loop, channel, chunk, slice); ``part`` is each write's QP part. Groups
    are numbered in order of first appearance, and each group's blocks come from its first
    write: ``flat`` (first element in the flat gradient), ``nbytes`` (data bytes), ``total``
    (wire bytes), ``ll128`` (one block per warp slice of ``slice_wire`` wire / ``slice_data``
    data bytes, need ``slice_need``) or else ``per_wire`` (wire bytes per data byte: one
    block per packet of each QP part, need 1). All per-write arrays are ``int64[messages]``.
    """
    m = len(key)
    if m == 0:
        empty = np.zeros(0, np.int64)
        return Blocks(empty, empty, empty, empty, empty)
    order = np.lexsort(key.T[::-1])
    sk = key[order]
    new = np.ones(m, dtype=bool)
    new[1:] = (sk[1:] != sk[:-1]).any(axis=1)
    sorted_group = np.cumsum(new) - 1
    first_of = order[new]                      # stable sort: the first write of each group
    rank = np.empty(len(first_of), np.int64)
    rank[np.argsort(first_of, kind="stable")] = np.arange(len(first_of))
    group = np.empty(m, np.int64)
    group[order] = rank[sorted_group]
    rep = np.sort(first_of)                    # the first write of each group, groups in order

    g_ll128, g_total = ll128[rep], total[rep]
    offset, length = part_bounds(g_total, nparts)
    counts = np.where(g_ll128[:, None], 0, -(-length // mtu))
    counts[:, 0] = np.where(g_ll128, -(-g_total // slice_wire), counts[:, 0])
    seg_start = (np.cumsum(counts.ravel()) - counts.ravel()).reshape(counts.shape)
    group_start = seg_start[:, 0]
    part_base = np.where(g_ll128[:, None], 0, seg_start - group_start[:, None])

    # Block k of a segment (one QP part, or all of an LL128 send) spans wire bytes
    # [origin + k·unit, origin + min((k+1)·unit, limit)), data bytes = wire bytes / per_wire;
    # for LL128 a unit is a warp slice's data, without limit.
    def per_segment(ll, other):
        return np.broadcast_to(np.where(g_ll128[:, None], ll, other), counts.shape).ravel()

    big = np.iinfo(np.int64).max // 4
    origin, limit = per_segment(0, offset), per_segment(big, length)
    unit, div = per_segment(slice_data, mtu), per_segment(1, per_wire[rep][:, None])
    cnt = counts.ravel()
    k = np.arange(cnt.sum(), dtype=np.int64) - np.repeat(seg_start.ravel(), cnt)

    def spread(per_group):
        return np.repeat(np.repeat(per_group, nparts), cnt)

    origin, unit, div = np.repeat(origin, cnt), np.repeat(unit, cnt), np.repeat(div, cnt)
    data_lo = (origin + k * unit) // div
    data_hi = (origin + np.minimum((k + 1) * unit, np.repeat(limit, cnt))) // div
    nb = spread(nbytes[rep])
    lo, hi = np.minimum(data_lo, nb) // elem, -(-np.minimum(data_hi, nb) // elem)
    return Blocks(bucket=spread(key[rep, 0]), elem=spread(flat[rep]) + lo, nelem=hi - lo,
                  need=spread(np.where(g_ll128, slice_need, 1)),
                  first=group_start[group] + part_base[group, part])
