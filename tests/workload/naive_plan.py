"""The wire plan as it was built message by message: the slow, obviously correct twin of
:func:`gradtap.workload.wire_plan.build_plan` (STYLE.md: every fast path has a slow twin in
``tests/``).

This is the per-message loop the production builder replaced, unchanged in behaviour: one
dict of fields per message, one :class:`_FlowBuilder` per flow counting PSNs, the QP parts of
each send written one by one, and the coverage blocks cut message by message. It imports
only the plan's dtypes, the NCCL geometry, the per-flow QPN and UDP port helpers and
``CallSchedule.sends``; ``tests/workload/test_plan_fast.py`` holds the fast builder equal to
it, and ``benchmarks/plan.py`` times the two.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gradtap.core.errors import PlanError
from gradtap.wire.ll import LL_LINE_BYTES, LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_SLICE_DATA_BYTES, LL128_SLICE_WIRE_BYTES
from gradtap.wire.protocol import Protocol
from gradtap.workload import nccl as N
from gradtap.workload.ring_schedule import CallSchedule, step_phase
from gradtap.workload.spec import WIRE_DTYPE_BYTES, JobSpec
from gradtap.workload.wire_plan import (BLOCK_DTYPE, CTS, DATA, FLOW_DTYPE, LL128_SLICE_LINES_MASK, MESSAGE_DTYPE,
                                        NO_VA, PHASE_AG, PHASE_OTHER, WirePlan, qpn, senders, udp_sport)

_MESSAGE_FIELDS = MESSAGE_DTYPE.names


def packets(nbytes: int, mtu: int) -> int:
    """Packets of one RDMA WRITE of ``nbytes`` payload (a zero-length write is one packet)."""
    return max(1, -(-nbytes // mtu))


class _FlowBuilder:
    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.psn = 0

    def add(self, mtu: int, **fields) -> None:
        npkts = packets(fields["wire_bytes"], mtu)
        fields.update(npkts=npkts, psn_offset=self.psn)
        self.psn += npkts
        self.rows.append(tuple([fields.get(name, 0) for name in _MESSAGE_FIELDS]))


def naive_plan(job: JobSpec, bucket_numels: Sequence[int]) -> WirePlan:
    """Derive the wire plan of one iteration from the job and its DDP bucket sizes (elements)."""
    n, nq, mtu = job.world_size, job.nccl.qps_per_connection, job.nccl.mtu
    elem = WIRE_DTYPE_BYTES[job.ddp.grad_dtype]
    protocols = N.bucket_protocols(job.nccl, len(bucket_numels))
    by_protocol = {p: N.geometry(job.nccl, n, p) for p in set(protocols)}
    geometries = tuple(by_protocol[p] for p in protocols)
    era = N.era_supported(job.nccl, n)
    split = N.split_data_on_qps(job.nccl)
    nch = job.nccl.channels

    # One builder per flow: data flows (channel, sender, qp) and CTS flows (channel, receiver).
    data = {(c, p, q): _FlowBuilder() for c in range(nch) for p in range(n) for q in range(nq)}
    cts = {(c, p): _FlowBuilder() for c in range(nch) for p in range(n)}
    steps = np.zeros((nch, n), dtype=np.int64)     # per connection (channel, sender position)
    calls: dict[tuple[int, int], list[tuple]] = {}  # per connection: (bucket, chunk steps, first step, end)
    fifo = np.zeros((nch, n), dtype=np.int64)
    qp_index = np.zeros((nch, n), dtype=np.int64)  # round robin of unsplit messages

    for bucket, count in enumerate(bucket_numels):
        # Each call runs in its bucket's protocol. A connection has one step counter for all
        # protocols (ncclConnInfo.step; the proxy's resources->step) and one buffer per
        # protocol (buffs[p]), so slots and LL flags continue across calls of different
        # protocols (docs/wire-format.md, "Protocols per call").
        geo = geometries[bucket]
        sched = CallSchedule(count, elem, n, nch, geo, era)
        for c in sched.channels:
            for p in range(n):
                # A call rounds the step counter up to a whole chunk of its protocol (net.cc:
                # sub->base = ROUNDUP(resources->step, args->chunkSteps)): Simple's 4 steps.
                steps[c, p] = -(-steps[c, p] // geo.chunk_steps) * geo.chunk_steps
                first = int(steps[c, p])
                for send in sched.sends(p, c):
                    msg_bytes = geo.wire_bytes(send.nelem, elem)
                    slot = int(steps[c, p]) % N.NCCL_STEPS
                    common = dict(kind=DATA, protocol=int(geo.protocol), phase=step_phase(send.ring_step, n),
                                  slice=send.slice,
                                  bucket=bucket, channel=c, ring_step=send.ring_step, loop=send.loop,
                                  chunk=send.chunk, step=steps[c, p], fifo_seq=fifo[c, p],
                                  elem_offset=send.elem_offset, nelem=send.nelem, msg_bytes=msg_bytes)
                    cts[c, (p + 1) % n].add(mtu, **dict(common, kind=CTS, phase=PHASE_OTHER, imm=0,
                                                        wire_bytes=era.cts_bytes, part_offset=0,
                                                        remote_offset=(fifo[c, p] % N.CTS_SLOTS) * era.cts_slot_stride))
                    # 2.29+: the parts of message k start at QP k mod nqps (GetQpForRequest(fifoHead)).
                    first_qp = int(fifo[c, p] % nq) if split and era.split_qp_rotates else 0
                    _add_writes(data, c, p, send_parts(msg_bytes, nq if split else 1), qp_index, split, nq,
                                slot * geo.step_bytes, job, common, first_qp)
                    steps[c, p] += send.steps
                    fifo[c, p] += 1
                calls.setdefault((c, p), []).append((bucket, geo.chunk_steps, first, int(steps[c, p])))

    rotating = not split or era.split_qp_rotates
    if rotating and nq > 1 and (fifo % nq).any():
        # Messages rotate over the QPs across iterations (unsplit ones, or from 2.29 the first
        # part of split ones); a plan of one iteration then depends on the iteration, which
        # the parser cannot anchor.
        what = ("nccl.split_data_on_qps false" if not split else
                f"nccl.era {job.nccl.era} (split parts start at QP message-index mod nqps)")
        fix = "Enable split_data_on_qps or use 1 QP" if not split else "Use 1 QP per connection"
        raise PlanError(f"with {what}, each connection must post a multiple of qps_per_connection ({nq}) "
                        f"messages per iteration; this job posts {sorted(set(int(x) for x in fifo.ravel()))}. "
                        f"{fix}.")
    return _assemble(job, geometries, elem, bucket_numels, data, cts, steps, fifo, calls)


def _phases(messages: np.ndarray, flows: np.ndarray, steps_per_iteration: np.ndarray, chunk_steps: set[int],
            calls: dict[tuple[int, int], list[tuple]]) -> tuple[np.ndarray, np.ndarray]:
    """The steps of every message, and the FIFO steps of every connection's iteration, for each
    phase of the connection's step counter at the iteration's start.

    A connection's step counter is absolute (it counts from the connection's setup), and each
    call starts it at the next multiple of its protocol's chunk steps (net.cc ``sub->base =
    ROUNDUP(resources->step, args->chunkSteps)``; prims_simple.h ``roundUp(step,
    SlicePerChunk*StepPerSlice)``). When Simple calls (4 steps per chunk) follow LL or LL128
    calls (1 step) on a connection, where the iteration's steps fall depends on the counter
    modulo 4 when it starts, and that changes from one iteration to the next. Row ``phi`` is
    the plan for a counter of ``phi`` modulo :attr:`WirePlan.step_phases` at the iteration's
    start, relative to that start; row 0 is ``messages["step"]``.

    With one chunk size for every call (one protocol, or LL with LL128) every call leaves the
    counter at a whole chunk, and there is one phase.
    """
    q = int(np.lcm.reduce(sorted(chunk_steps))) if len(chunk_steps) > 1 else 1
    m = messages
    steps = np.repeat(m["step"][None, :], q, axis=0)
    period = np.repeat(steps_per_iteration[None], q, axis=0)
    if q == 1:
        return steps, period
    sender = senders(m, flows)
    for (c, p), mine in calls.items():
        rows = np.flatnonzero((m["channel"] == c) & (sender == p))
        for phi in range(1, q):
            at = phi
            for bucket, chunk_steps, first, end in mine:
                start = -(-at // chunk_steps) * chunk_steps
                call = rows[m["bucket"][rows] == bucket]
                steps[phi, call] = m["step"][call] - first + start - phi
                at = start + end - first
            period[phi, c, p] = at - phi
    return steps, period



def send_parts(msg_bytes: int, nparts: int) -> list[tuple[int, int]]:
    """(offset, length) of each QP's part of a message (ncclIbMultiSend, 128-byte aligned)."""
    part = -(-(-(-msg_bytes // nparts)) // N.QP_SPLIT_ALIGN) * N.QP_SPLIT_ALIGN
    return [(q * part, max(0, min(part, msg_bytes - q * part))) for q in range(nparts)]


def _add_writes(data, c, p, parts, qp_index, split, nq, slot_va, job, common, first_qp=0) -> None:
    ar = job.nccl.adaptive_routing and common["msg_bytes"] > job.nccl.ar_threshold
    for part, (off, length) in enumerate(parts):
        q = (first_qp + part) % nq if split else int(qp_index[c, p] % nq)
        flow = data[c, p, q]
        fields = dict(common, qp=q, part=part, part_offset=off, wire_bytes=length, remote_offset=slot_va + off)
        if ar:
            # Adaptive routing: the bulk goes as a plain WRITE, then a zero-length WRITE with
            # immediate, whose VA is 0, signals completion (ncclIbMultiSend).
            flow.add(job.nccl.mtu, **dict(fields, imm=0))
            flow.add(job.nccl.mtu, **dict(fields, imm=1, wire_bytes=0, remote_offset=NO_VA))
        else:
            flow.add(job.nccl.mtu, **dict(fields, imm=1))
    if not split:
        qp_index[c, p] += 1


def _assemble(job, geometries, elem, bucket_numels, data, cts, steps, fifo, calls) -> WirePlan:
    n = job.world_size
    flows, chunks = [], []
    start = 0
    for (c, p, q), b in sorted(data.items()):
        if not b.rows:
            continue
        r = (p + 1) % n
        flows.append((p, r, c, q, DATA, qpn(job, p, c, q, False), qpn(job, r, c, q, True),
                      udp_sport(job, p, c, q), start, len(b.rows), b.psn))
        chunks.append(b.rows)
        start += len(b.rows)
    for (c, r), b in sorted(cts.items()):
        if not b.rows:
            continue
        p = (r - 1) % n
        flows.append((r, p, c, 0, CTS, qpn(job, r, c, 0, True), qpn(job, p, c, 0, False),
                      udp_sport(job, p, c, 0), start, len(b.rows), b.psn))
        chunks.append(b.rows)
        start += len(b.rows)
    flow_arr = np.array(flows, dtype=FLOW_DTYPE)
    messages = np.array([row for rows in chunks for row in rows], dtype=MESSAGE_DTYPE)
    for i in range(len(flow_arr)):
        messages["flow"][flow_arr["msg_start"][i]:flow_arr["msg_start"][i] + flow_arr["msg_count"][i]] = i
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(bucket_numels)[:-1]]))
    blocks = _coverage_blocks(messages, offsets, geometries, elem, job.nccl.mtu,
                              job.nccl.qps_per_connection if N.split_data_on_qps(job.nccl) else 1)
    phase_steps, phase_period = _phases(messages, flow_arr, steps, {g.chunk_steps for g in geometries}, calls)
    return WirePlan(job_name=job.name, world_size=n, elem_size=elem,
                    mtu=job.nccl.mtu, geometries=geometries, bucket_numels=tuple(int(x) for x in bucket_numels),
                    bucket_offsets=offsets, flows=flow_arr, messages=messages,
                    steps_per_iteration=steps, fifo_per_iteration=fifo, blocks=blocks,
                    phase_steps=phase_steps, phase_period=phase_period)


def _coverage_blocks(messages: np.ndarray, bucket_offsets, geometries: tuple[N.ProtocolGeometry, ...], elem: int,
                     mtu: int, nparts: int) -> np.ndarray:
    """Cut the allgather into coverage blocks and point every allgather write at its first.

    Every rank that forwards chunk c in the allgather sends it with the same size, parts and
    packets, so one set of blocks per (bucket, loop, channel, chunk) serves every stream
    that carries the chunk, and the merger can compare streams block by block. A block is
    one packet for Simple and LL (their data is in wire order): ``need`` is 1, one unit. For
    LL128 it is one warp slice (1920 data bytes), whose data is interleaved over the slice's
    2048 wire bytes: its units are the slice's 16 lines of 128 bytes, ``need`` = 0xFFFF.
    Packets and QP parts always start on a line, so each packet sets whole lines, and copies
    of a block from several flows combine line by line.
    """
    messages["block"] = -1
    ag = np.flatnonzero((messages["kind"] == DATA) & (messages["phase"] == PHASE_AG) & (messages["wire_bytes"] > 0))
    rows: list[tuple] = []
    groups: dict[tuple, int] = {}
    part_base: dict[tuple, int] = {}
    slice_wire, slice_data = LL128_SLICE_WIRE_BYTES, LL128_SLICE_DATA_BYTES
    for i in ag:
        m = messages[i]
        key = (int(m["bucket"]), int(m["loop"]), int(m["channel"]), int(m["chunk"]), int(m["slice"]))
        if key not in groups:
            groups[key] = len(rows)
            flat = bucket_offsets[key[0]] + int(m["elem_offset"])
            nbytes, total = int(m["nelem"]) * elem, int(m["msg_bytes"])
            parts = send_parts(total, nparts)
            protocol = geometries[key[0]].protocol
            if protocol == Protocol.LL128:
                for s in range(-(-total // slice_wire)):
                    rows.append(_block(key[0], flat, s * slice_data, (s + 1) * slice_data, nbytes, elem,
                                       LL128_SLICE_LINES_MASK))
            else:
                # LL: 16 wire bytes carry 8 data bytes
                per_wire = LL_LINE_BYTES // LL_LINE_DATA_BYTES if protocol == Protocol.LL else 1
                for q, (off, length) in enumerate(parts):
                    part_base[key + (q,)] = len(rows) - groups[key]
                    for k in range(-(-length // mtu)):
                        lo, hi = off + k * mtu, off + min((k + 1) * mtu, length)
                        rows.append(_block(key[0], flat, lo // per_wire, hi // per_wire, nbytes, elem, 1))
        messages["block"][i] = groups[key] + part_base.get(key + (int(m["part"]),), 0)
    return np.array(rows, dtype=BLOCK_DTYPE)


def _block(bucket: int, flat: int, data_lo: int, data_hi: int, nbytes: int, elem: int, need: int) -> tuple:
    lo, hi = min(data_lo, nbytes) // elem, -(-min(data_hi, nbytes) // elem)
    return bucket, flat + lo, hi - lo, need
