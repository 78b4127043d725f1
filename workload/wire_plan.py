"""The wire plan: every RDMA message of one training iteration, per queue pair.

The plan is derived from the job spec and the DDP bucket sizes. It lists, for every flow
(a sending rank, a receiving rank and the destination QP), the RDMA WRITE work requests of
one iteration in posting order: the data writes of the ring allreduce of every bucket and the
clear-to-send (CTS) writes that the receiver sends back on the same RC connection.

The simulator generates frames from the plan and the parser locates frames with it, so both
read the same NumPy structured arrays (:data:`MESSAGE_DTYPE`, :data:`FLOW_DTYPE`), which Numba
kernels can index directly. Positions are relative to the iteration: ``psn_offset`` to the
flow's first PSN of the iteration, ``step`` to the connection's first FIFO step of the
iteration. Every NCCL fact used here is in ``docs/wire-format.md``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from gradtap.core.errors import PlanError
from gradtap.wire.ll import LL_LINE_BYTES, LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_SLICE_DATA_BYTES, LL128_SLICE_LINES, LL128_SLICE_WIRE_BYTES
from gradtap.wire.protocol import Protocol
from gradtap.workload import nccl as N
from gradtap.workload.plan_columns import coverage_blocks, packet_counts, writes
from gradtap.workload.ring_schedule import CallSchedule, SendTable
from gradtap.workload.spec import WIRE_DTYPE_BYTES, JobSpec

DATA, CTS = 0, 1                 # message kinds
PHASE_RS, PHASE_AG, PHASE_OTHER = 0, 1, 2
NO_VA = -1                       # remote_offset of the zero-length immediate write of adaptive routing
LL128_SLICE_LINES_MASK = (1 << LL128_SLICE_LINES) - 1   # the 16 lines of a warp slice

MESSAGE_DTYPE = np.dtype([
    ("flow", "i4"),          # index into the flow table
    ("kind", "i1"),          # DATA or CTS
    ("protocol", "i1"),      # wire.protocol.Protocol of the bucket's allreduce (a CTS: of the data it clears)
    ("imm", "i1"),           # 1: RDMA WRITE with immediate (ImmDt = msg_bytes); 0: plain WRITE
    ("phase", "i1"),         # PHASE_RS, PHASE_AG, PHASE_OTHER (CTS)
    ("slice", "i1"),         # Simple: slice of the chunk (0/1)
    ("bucket", "i4"),        # DDP bucket (= allreduce call) index, in launch order
    ("channel", "i2"),
    ("qp", "i2"),            # QP index within the connection
    ("part", "i2"),          # part of a message split over QPs (IB_SPLIT_DATA_ON_QPS)
    ("ring_step", "i2"),     # 0 .. 2(n-1)-1 within a loop
    ("loop", "i4"),
    ("chunk", "i4"),         # ring chunk index 0..n-1
    ("step", "i8"),          # connection FIFO step of this send, relative to the iteration
    ("fifo_seq", "i8"),      # receive posted on the connection (CTS idx - 1), relative
    ("elem_offset", "i8"),   # first element of the send within the bucket buffer
    ("nelem", "i8"),         # elements of the whole send
    ("msg_bytes", "i8"),     # bytes of the whole send on the wire (the ImmDt value)
    ("part_offset", "i8"),   # first byte of this write within the send's wire bytes
    ("wire_bytes", "i8"),    # payload bytes of this write (RETH DMA length)
    ("remote_offset", "i8"), # RETH VA minus the base of the protocol's receive buffer (or fifo base for CTS)
    ("npkts", "i4"),
    ("psn_offset", "i8"),    # first PSN of this write, relative to the flow's iteration base
    ("block", "i8"),         # allgather data: first coverage block of this write (see BLOCK_DTYPE), else -1
])

BLOCK_DTYPE = np.dtype([
    ("bucket", "i4"),
    ("elem", "i8"),          # first element, in the flat gradient (buckets concatenated in launch order)
    ("nelem", "i8"),
    ("need", "i4"),          # bitmask of the units that must arrive (see _coverage_blocks)
])

FLOW_DTYPE = np.dtype([
    ("src", "i2"), ("dst", "i2"),       # ring positions
    ("channel", "i2"), ("qp", "i2"), ("kind", "i1"),
    ("src_qpn", "i4"), ("dst_qpn", "i4"), ("udp_sport", "i4"),
    ("msg_start", "i8"), ("msg_count", "i8"), ("npkts", "i8"),
])


def packets(nbytes: int, mtu: int) -> int:
    """Packets of one RDMA WRITE of ``nbytes`` payload (a zero-length write is one packet)."""
    return max(1, -(-nbytes // mtu))


def qpn(job: JobSpec, position: int, channel: int, qp: int, receiver: bool) -> int:
    """QPN of one end of a ring connection.

    With the rank's ``qpn_base`` set: ``base + 2 * index + receiver`` (``index`` = channel *
    QPs per connection + QP). Without it, as a real NIC numbers them: in creation order (the
    send side then the receive side of each channel and QP, as NCCL connects), from a start
    and with gaps between consecutive QPNs (other QPs created in between; the real captures
    show strides of 1 to 5) that follow from the job's name and the rank, so the simulator
    and any test agree on them. The parser never relies on either: it learns QPNs from the
    wire (``parser/flow_learning.py``) and only checks ``qpn_base`` as a hint.
    """
    index = channel * job.nccl.qps_per_connection + qp
    base = job.ring.ranks[position].qpn_base
    if base is not None:
        return base + 2 * index + int(receiver)
    seed = int.from_bytes(hashlib.blake2b(f"{job.name}/{position}".encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    count = 2 * index + int(receiver) + 1
    start = int(rng.integers(0x100, 0x800000))
    return start + int(rng.integers(1, 6, size=count).sum())


def udp_sport(job: JobSpec, sender: int, channel: int, qp: int) -> int:
    """UDP source port of one RC connection's QP. Both directions of the connection use the
    same port, as the real captures show (the NIC derives it from the QP pair)."""
    base = job.ring.ranks[sender].udp_sport_base
    base = 49152 + 64 * sender if base is None else base
    return (base + channel * job.nccl.qps_per_connection + qp - 1) % 0xFFFF + 1


@dataclass(frozen=True)
class WirePlan:
    """The plan of one iteration. ``messages`` is sorted by flow, then posting order."""

    job_name: str
    world_size: int
    elem_size: int
    mtu: int
    geometries: tuple[N.ProtocolGeometry, ...]   # per bucket: its protocol's constants
    bucket_numels: tuple[int, ...]
    bucket_offsets: tuple[int, ...]        # element offset of each bucket in the flat gradient
    flows: np.ndarray                      # FLOW_DTYPE
    messages: np.ndarray                   # MESSAGE_DTYPE
    steps_per_iteration: np.ndarray        # [channel, position] FIFO steps per iteration
    fifo_per_iteration: np.ndarray         # [channel, position] receives (CTS) per iteration
    blocks: np.ndarray                     # BLOCK_DTYPE: the coverage blocks of the allgather
    # Steps by the phase of the connection's counter at the iteration's start (see _phases):
    phase_steps: np.ndarray                # int64[phases, messages]; row 0 is messages["step"]
    phase_period: np.ndarray               # int64[phases, channel, position]; row 0 is steps_per_iteration

    @property
    def step_phases(self) -> int:
        """Phases of a connection's step counter the steps depend on (1: they do not)."""
        return int(self.phase_steps.shape[0])

    @property
    def total_elems(self) -> int:
        return sum(self.bucket_numels)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the whole flat gradient in the wire dtype."""
        return self.total_elems * self.elem_size

    @property
    def protocols(self) -> tuple[Protocol, ...]:
        """The protocol of each bucket's allreduce."""
        return tuple(g.protocol for g in self.geometries)

    def by_protocol(self, field: str) -> np.ndarray:
        """``int64[len(Protocol)]``: a geometry field (``"step_bytes"``, ``"slot_bytes"``) of
        each protocol the job uses, indexed by :class:`Protocol`; 0 for a protocol it does not."""
        out = np.zeros(len(Protocol), np.int64)
        for g in self.geometries:
            out[g.protocol] = getattr(g, field)
        return out

    def flow_messages(self, flow: int) -> np.ndarray:
        f = self.flows[flow]
        return self.messages[f["msg_start"]:f["msg_start"] + f["msg_count"]]

    def flows_of(self, position: int, direction: str) -> np.ndarray:
        """Flow indices a mirror of the rank at ``position`` sees (egress, ingress or both)."""
        src, dst = self.flows["src"] == position, self.flows["dst"] == position
        mask = {"egress": src, "ingress": dst, "both": src | dst}[direction]
        return np.flatnonzero(mask)


def build_plan(job: JobSpec, bucket_numels: Sequence[int]) -> WirePlan:
    """Derive the wire plan of one iteration from the job and its DDP bucket sizes (elements).

    The sends of each call, rank and channel come as arrays (``CallSchedule.send_table``);
    their steps, receives, wire sizes, QP parts and PSNs are computed over all of them at
    once (:mod:`gradtap.workload.plan_columns`). ``tests/workload/naive_plan.py`` is the same
    plan built message by message, which this must equal field for field.
    """
    n, nq = job.world_size, job.nccl.qps_per_connection
    elem = WIRE_DTYPE_BYTES[job.ddp.grad_dtype]
    protocols = N.bucket_protocols(job.nccl, len(bucket_numels))
    by_protocol = {p: N.geometry(job.nccl, n, p) for p in set(protocols)}
    geometries = tuple(by_protocol[p] for p in protocols)
    era = N.era_supported(job.nccl, n)
    split = N.split_data_on_qps(job.nccl)
    nch = job.nccl.channels

    steps = np.zeros((nch, n), dtype=np.int64)     # per connection (channel, sender position)
    calls: dict[tuple[int, int], list[tuple]] = {}  # per connection: (bucket, chunk steps, first step, end)
    fifo = np.zeros((nch, n), dtype=np.int64)
    tables: list[tuple] = []                       # (bucket, channel, first steps, first fifos, sends)
    positions = np.arange(n)
    for bucket, count in enumerate(bucket_numels):
        # Each call runs in its bucket's protocol. A connection has one step counter for all
        # protocols (ncclConnInfo.step; the proxy's resources->step) and one buffer per
        # protocol (buffs[p]), so slots and LL flags continue across calls of different
        # protocols (docs/wire-format.md, "Protocols per call").
        geo = geometries[bucket]
        sched = CallSchedule(count, elem, n, nch, geo, era)
        for c in sched.channels:
            # A call rounds the step counter up to a whole chunk of its protocol (net.cc:
            # sub->base = ROUNDUP(resources->step, args->chunkSteps)): Simple's 4 steps.
            steps[c] = -(-steps[c] // geo.chunk_steps) * geo.chunk_steps
            first = steps[c].copy()
            sends = sched.send_table(positions, c)   # [position, send]; each rank posts as many
            if sends.loop.size:
                tables.append((bucket, c, first, fifo[c].copy(), sends))
            steps[c] += sends.loop.shape[1] * geo.slice_steps
            fifo[c] += sends.loop.shape[1]
            for p in range(n):
                calls.setdefault((c, p), []).append((bucket, geo.chunk_steps, int(first[p]), int(steps[c, p])))

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
    messages, flows = _messages(job, era, split, _send_columns(tables, geometries, elem))
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(bucket_numels)[:-1]]))
    blocks = _coverage_blocks(messages, offsets, geometries, elem, job.nccl.mtu, nq if split else 1)
    phase_steps, phase_period = _phases(messages, flows, steps, {g.chunk_steps for g in geometries}, calls)
    return WirePlan(job_name=job.name, world_size=n, elem_size=elem,
                    mtu=job.nccl.mtu, geometries=geometries, bucket_numels=tuple(int(x) for x in bucket_numels),
                    bucket_offsets=offsets, flows=flows, messages=messages,
                    steps_per_iteration=steps, fifo_per_iteration=fifo, blocks=blocks,
                    phase_steps=phase_steps, phase_period=phase_period)


def _send_columns(tables: list[tuple], geometries: tuple[N.ProtocolGeometry, ...], elem: int) -> dict[str, np.ndarray]:
    """Every send of the iteration in posting order (call by call, then channel, rank and
    send), as ``int64`` columns named like MESSAGE_DTYPE's fields, plus ``position`` and
    ``slot_va`` (the FIFO slot's offset in the protocol's receive buffer)."""
    names = (*SendTable._fields, "bucket", "channel", "position", "step", "fifo_seq", "slot_va", "protocol")
    cols: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for bucket, c, first, fifo0, sends in tables:
        geo = geometries[bucket]
        npos, k = sends.loop.shape
        for name, column in zip(SendTable._fields, sends):
            cols[name].append(column.ravel())
        index = np.arange(k, dtype=np.int64)[None, :]
        step = (first[:, None] + index * geo.slice_steps).ravel()   # every send advances one slice of steps
        cols["step"].append(step)
        cols["slot_va"].append(step % N.NCCL_STEPS * geo.step_bytes)
        cols["fifo_seq"].append((fifo0[:, None] + index).ravel())
        cols["position"].append(np.repeat(np.arange(npos, dtype=np.int64), k))
        for name, value in (("bucket", bucket), ("channel", c), ("protocol", int(geo.protocol))):
            cols[name].append(np.full(npos * k, value, np.int64))
    out = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in cols.items()}
    # Few distinct sizes per protocol: the wire size of each, spread back over the sends.
    out["msg_bytes"] = np.zeros(len(out["nelem"]), np.int64)
    for geo in set(geometries):
        mine = out["protocol"] == int(geo.protocol)
        sizes, at = np.unique(out["nelem"][mine], return_inverse=True)
        out["msg_bytes"][mine] = np.array([geo.wire_bytes(int(x), elem) for x in sizes], np.int64)[at]
    return out


def _messages(job: JobSpec, era: N.EraFacts, split: bool,
              sends: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The message and flow tables: each send's CTS (on the CTS flow of its receiver) and its
    data writes (on the data flow of its sender and QP), grouped by flow in posting order."""
    n, nq, nch, mtu = job.world_size, job.nccl.qps_per_connection, job.nccl.channels, job.nccl.mtu
    ar = (sends["msg_bytes"] > job.nccl.ar_threshold) & job.nccl.adaptive_routing
    w = writes(sends["msg_bytes"], sends["fifo_seq"], sends["slot_va"], nq, split, era.split_qp_rotates, ar, NO_VA)
    nsend, nwrite = len(sends["step"]), len(w.send)
    # Rows: the data writes, then one CTS per send; each takes its send's fields.
    of_send = np.concatenate([w.send, np.arange(nsend, dtype=np.int64)])
    cts = np.arange(nwrite + nsend) >= nwrite
    c, p = sends["channel"][of_send], sends["position"][of_send]
    # Flow keys in the order of the flow table: data flows by (channel, sender, QP), then
    # CTS flows by (channel, receiver).
    qp = np.concatenate([w.qp, np.zeros(nsend, np.int64)])
    key = np.where(cts, nch * n * nq + c * n + (p + 1) % n, (c * n + p) * nq + qp)
    order = np.argsort(key, kind="stable")       # within a flow, keep posting order
    sorted_key = key[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = sorted_key[1:] != sorted_key[:-1]
    start = np.flatnonzero(new)                  # each flow's first message
    keys, count = sorted_key[start], np.diff(np.append(start, len(order)))
    flow = np.cumsum(new) - 1

    msgs = np.zeros(len(order), dtype=MESSAGE_DTYPE)
    src = of_send[order]
    for name in ("slice", "bucket", "channel", "ring_step", "loop", "chunk", "step", "fifo_seq",
                 "elem_offset", "nelem", "msg_bytes", "protocol"):
        msgs[name] = sends[name][src]
    is_cts = cts[order]
    data, acks = np.flatnonzero(~is_cts), np.flatnonzero(is_cts)
    write = order[data]                          # the data rows' index among the writes
    msgs["flow"] = flow
    msgs["kind"] = np.where(is_cts, CTS, DATA)
    msgs["phase"] = np.where(is_cts, PHASE_OTHER, np.where(sends["ring_step"][src] < n - 1, PHASE_RS, PHASE_AG))
    for name in ("qp", "part", "imm", "part_offset", "remote_offset"):
        msgs[name][data] = getattr(w, name)[write]
    wire_bytes = np.full(len(order), era.cts_bytes, np.int64)
    wire_bytes[data] = w.wire_bytes[write]
    msgs["wire_bytes"] = wire_bytes
    msgs["remote_offset"][acks] = sends["fifo_seq"][src[acks]] % N.CTS_SLOTS * era.cts_slot_stride
    npkts = packet_counts(wire_bytes, mtu)
    msgs["npkts"] = npkts
    psn = np.cumsum(npkts) - npkts
    msgs["psn_offset"] = psn - psn[start][flow]
    flow_pkts = np.add.reduceat(npkts, start) if len(start) else np.zeros(0, np.int64)

    rows = []
    for key_, first, cnt, pkts in zip(keys.tolist(), start.tolist(), count.tolist(), flow_pkts.tolist()):
        if key_ < nch * n * nq:
            (ch, sender), q = divmod(key_ // nq, n), key_ % nq
            r = (sender + 1) % n
            rows.append((sender, r, ch, q, DATA, qpn(job, sender, ch, q, False), qpn(job, r, ch, q, True),
                         udp_sport(job, sender, ch, q), first, cnt, pkts))
        else:
            ch, r = divmod(key_ - nch * n * nq, n)
            sender = (r - 1) % n
            rows.append((r, sender, ch, 0, CTS, qpn(job, r, ch, 0, True), qpn(job, sender, ch, 0, False),
                         udp_sport(job, sender, ch, 0), first, cnt, pkts))
    return msgs, np.array(rows, dtype=FLOW_DTYPE)


def senders(messages: np.ndarray, flows: np.ndarray) -> np.ndarray:
    """The sender's ring position of each message's connection: a data write's own sender, and
    for a CTS the sender of the data it clears (the CTS flows the other way)."""
    return np.where(messages["kind"] == DATA, flows["src"][messages["flow"]], flows["dst"][messages["flow"]])


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
    nch, n = steps_per_iteration.shape
    nbuckets = 1 + max(b for mine in calls.values() for b, *_ in mine)
    # Per call (channel, sender, bucket): its first step in row 0, and its start in row phi.
    first = np.zeros(nch * n * nbuckets, np.int64)
    start = np.zeros((q, nch * n * nbuckets), np.int64)
    for (c, p), mine in calls.items():
        for phi in range(1, q):
            at = phi
            for bucket, chunk_steps, begin, end in mine:
                call = (c * n + p) * nbuckets + bucket
                start[phi, call] = -(-at // chunk_steps) * chunk_steps
                first[call] = begin
                at = start[phi, call] + end - begin
            period[phi, c, p] = at - phi
    call = (m["channel"].astype(np.int64) * n + senders(m, flows)) * nbuckets + m["bucket"]
    steps[1:] = m["step"][None, :] - first[call][None, :] + start[1:, call] - np.arange(1, q)[:, None]
    return steps, period


def send_parts(msg_bytes: int, nparts: int) -> list[tuple[int, int]]:
    """(offset, length) of each QP's part of a message (ncclIbMultiSend, 128-byte aligned)."""
    part = -(-(-(-msg_bytes // nparts)) // N.QP_SPLIT_ALIGN) * N.QP_SPLIT_ALIGN
    return [(q * part, max(0, min(part, msg_bytes - q * part))) for q in range(nparts)]


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
    m = {f: messages[f][ag].astype(np.int64) for f in ("bucket", "loop", "channel", "chunk", "slice", "part",
                                                         "elem_offset", "nelem", "msg_bytes")}
    key = np.stack([m[f] for f in ("bucket", "loop", "channel", "chunk", "slice")], axis=1)
    protocol = np.array([int(g.protocol) for g in geometries], np.int64)[m["bucket"]]
    # LL: 16 wire bytes carry 8 data bytes
    per_wire = np.where(protocol == Protocol.LL, LL_LINE_BYTES // LL_LINE_DATA_BYTES, 1)
    flat = np.asarray(bucket_offsets, np.int64)[m["bucket"]] + m["elem_offset"]
    b = coverage_blocks(key, m["part"], flat, m["nelem"] * elem, m["msg_bytes"],
                        protocol == Protocol.LL128, per_wire, elem, mtu, nparts,
                        LL128_SLICE_WIRE_BYTES, LL128_SLICE_DATA_BYTES, LL128_SLICE_LINES_MASK)
    messages["block"][ag] = b.first
    blocks = np.zeros(len(b.bucket), dtype=BLOCK_DTYPE)
    for name in BLOCK_DTYPE.names:
        blocks[name] = getattr(b, name)
    return blocks
