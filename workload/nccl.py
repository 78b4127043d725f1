"""NCCL facts the wire plan relies on, one era at a time.

Every number here is cited in ``docs/wire-format.md`` with the NCCL source file and version
it comes from. The ``2.19`` era covers NCCL 2.18.x and 2.19.x (checked against v2.19.3-1);
the eras ``2.20`` to ``2.30`` are each one NCCL minor release (section "NCCL eras 2.19 – 2.30"
of the document lists what changes on the wire between them, and the first tag of each change).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache

import numpy as np

from gradtap.core.errors import PlanError
from gradtap.wire.ll import LL_LINE_BYTES, LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_LINE_DATA_WORDS, LL128_LINE_WORDS, LL128_WORD_BYTES, WARP_SIZE
from gradtap.wire.protocol import Protocol
from gradtap.workload.spec import NcclSpec

NCCL_STEPS = 8                 # src/include/device.h: FIFO slots per connection
NET_MAX_REQUESTS = 32          # NCCL_NET_MAX_REQUESTS, src/include/nccl_net.h
NET_IB_MAX_RECVS = 8           # NCCL_NET_IB_MAX_RECVS, src/transport/net_ib.cc
CTS_BYTES = 32                 # sizeof(struct ncclIbSendFifo), src/transport/net_ib.cc
CTS_SLOT_STRIDE = NET_IB_MAX_RECVS * CTS_BYTES     # bytes per fifo slot: 256
CTS_SLOTS = NET_MAX_REQUESTS * NET_IB_MAX_RECVS    # MAX_REQUESTS fifo slots: 256
QP_SPLIT_ALIGN = 128           # ncclIbMultiSend: multi-QP parts are multiples of 128 B

# src/init.cc DEFAULT_*_BUFFSIZE
DEFAULT_BUFFSIZE = {
    Protocol.LL: 8 * 512 * NCCL_STEPS * LL_LINE_BYTES,   # NCCL_LL_LINES_PER_THREAD*NCCL_LL_MAX_NTHREADS*STEPS*16
    Protocol.LL128: 120 * 640 * NCCL_STEPS * LL128_WORD_BYTES,   # NCCL_LL128_ELEMS_PER_THREAD*MAX_NTHREADS*STEPS*8
    Protocol.SIMPLE: 1 << 22,
}
# src/graph/tuning.cc: maxThreads[RING][proto] and threadThresholds (LL's is scaled by nRanks)
MAX_THREADS = {Protocol.SIMPLE: 512, Protocol.LL: 512, Protocol.LL128: 640}
THREAD_THRESHOLD = {Protocol.SIMPLE: 64, Protocol.LL: 8, Protocol.LL128: 8}
# src/include/collectives.h: ALLREDUCE_SLICESTEPS / ALLREDUCE_CHUNKSTEPS (Simple only)
SLICE_STEPS = {Protocol.SIMPLE: NCCL_STEPS // 4, Protocol.LL: 1, Protocol.LL128: 1}
CHUNK_STEPS = {Protocol.SIMPLE: NCCL_STEPS // 2, Protocol.LL: 1, Protocol.LL128: 1}


class ChannelSplit(IntEnum):
    """How one ring allreduce call cuts its elements over channels (docs/wire-format.md)."""

    GRID = 0         # 2.19: one grid of loops over all channels; runRing's calcOffset places chunks
    PER_CHANNEL = 1  # 2.20-2.21: addCBDCollToPlan gives each channel a contiguous range (workOffset/workCount)
    CBD_PART = 2     # 2.22+: scheduleCollTasksToPlan's traffic cells, read back by ncclCollCbdPart


@dataclass(frozen=True)
class CbdCells:
    """The constants of ``scheduleCollTasksToPlan`` (src/enqueue.cc, 2.22+) that size the
    per-channel ranges of the CBD_PART split."""

    min_traffic: int          # MinTrafficPerChannel, bytes of traffic
    cell_from_min: bool       # cellSize = divUp(divUp(MinTrafficPerChannel, trafficPerByte), 16)*16; else 16
    task_min: bool            # trafficBytes[kind] += max(MinTrafficPerChannel, task->trafficBytes)
    ll_traffic_factor: int    # LL counts its traffic 4 times (task trafficBytes and trafficPerByte), 2.26+
    per_channel_align16: bool  # trafficPerChannel = divUp(traffic/nChannels, 16)*16 (2.29+); else max(min, ..)
    lo_round_up: bool         # cellsLo rounds the channel's traffic budget up (divUp), 2.23+


CBD_2_22 = CbdCells(min_traffic=512, cell_from_min=False, task_min=False, ll_traffic_factor=1,
                    per_channel_align16=False, lo_round_up=False)
CBD_2_23 = CbdCells(min_traffic=16 << 10, cell_from_min=True, task_min=True, ll_traffic_factor=1,
                    per_channel_align16=False, lo_round_up=True)
CBD_2_26 = CbdCells(min_traffic=16 << 10, cell_from_min=True, task_min=True, ll_traffic_factor=4,
                    per_channel_align16=False, lo_round_up=True)
CBD_2_29 = CbdCells(min_traffic=32 << 10, cell_from_min=True, task_min=True, ll_traffic_factor=4,
                    per_channel_align16=True, lo_round_up=True)

# struct ncclIbSendFifo, the CTS entry, by era (src/transport/net_ib.cc; net_ib/common.h from 2.29).
CTS_2_19 = (("addr", "<u8"), ("size", "<i4"), ("rkey", "<u4"), ("nreqs", "<u4"), ("tag", "<u4"), ("idx", "<u8"))
CTS_2_20 = (("addr", "<u8"), ("size", "<i4"), ("rkeys", "<u4", (2,)), ("nreqs", "<u4"), ("tag", "<u4"),
            ("pad0", "<u4"), ("idx", "<u8"), ("padding", "u1", (24,)))
CTS_2_24 = (("addr", "<u8"), ("size", "<u8"), ("rkeys", "<u4", (4,)), ("nreqs", "<u4"), ("tag", "<u4"),
            ("idx", "<u8"), ("padding", "u1", (16,)))
CTS_2_30 = (("addr", "<u8"), ("size", "<u8"), ("rkeys", "<u4", (8,)), ("nreqs", "<u4"), ("tag", "<u4"),
            ("idx", "<u8"))


@dataclass(frozen=True)
class EraFacts:
    """What changes between NCCL eras on the wire (each fact with its first tag in
    docs/wire-format.md, section "NCCL eras 2.19 – 2.30")."""

    releases: str                     # the NCCL releases of the era, for messages
    channel_split: ChannelSplit
    imm_big_endian: bool              # ImmDt = htobe32(size), 2.29+
    split_data_on_qps_default: bool   # NCCL_IB_SPLIT_DATA_ON_QPS default: 1 up to 2.19, 0 from 2.20
    cts_fields: tuple                 # struct ncclIbSendFifo as NumPy dtype fields
    cbd: CbdCells | None = None       # CBD_PART only
    split_qp_rotates: bool = False    # split parts start at QP (fifoHead mod nqps), 2.29.2-2.30.4
    split_qp_patch_dependent: bool = False  # 2.30: 2.30.7 went back to part q on QP q
    ooo_rq: bool = False              # NCCL_IB_OOO_RQ exists (2.30); when set ImmDt carries a request ID

    @property
    def cts_dtype(self) -> np.dtype:
        return _struct(self.cts_fields)

    @property
    def cts_bytes(self) -> int:
        """sizeof(struct ncclIbSendFifo): the length of one CTS write (one receive)."""
        return self.cts_dtype.itemsize

    @property
    def cts_slot_stride(self) -> int:
        """Bytes between fifo slots: NCCL_NET_IB_MAX_RECVS entries."""
        return NET_IB_MAX_RECVS * self.cts_bytes


@lru_cache(maxsize=None)
def _struct(fields: tuple) -> np.dtype:
    """A C struct's fields as a NumPy dtype (made once: the wire plan asks per message)."""
    return np.dtype(list(fields))


def _era(releases: str, split: ChannelSplit, cts: tuple, cbd: CbdCells | None = None, **kw) -> EraFacts:
    return EraFacts(releases=releases, channel_split=split, cts_fields=cts, cbd=cbd,
                    imm_big_endian=kw.pop("imm_big_endian", False),
                    split_data_on_qps_default=kw.pop("split_default", False), **kw)


# One record per group of identical eras; every minor release from 2.19 to 2.30 names one.
_E219 = _era("2.18.x-2.19.x", ChannelSplit.GRID, CTS_2_19, split_default=True)
_E220 = _era("2.20.x-2.21.x", ChannelSplit.PER_CHANNEL, CTS_2_20)
_E222 = _era("2.22.x", ChannelSplit.CBD_PART, CTS_2_20, CBD_2_22)
_E223 = _era("2.23.x", ChannelSplit.CBD_PART, CTS_2_20, CBD_2_23)
_E224 = _era("2.24.x-2.25.x", ChannelSplit.CBD_PART, CTS_2_24, CBD_2_23)
_E226 = _era("2.26.x-2.28.x", ChannelSplit.CBD_PART, CTS_2_24, CBD_2_26)
_E229 = _era("2.29.x", ChannelSplit.CBD_PART, CTS_2_24, CBD_2_29, imm_big_endian=True, split_qp_rotates=True)
_E230 = _era("2.30.x", ChannelSplit.CBD_PART, CTS_2_30, CBD_2_29, imm_big_endian=True, split_qp_rotates=True,
             split_qp_patch_dependent=True, ooo_rq=True)
ERAS = {"2.19": _E219, "2.20": _E220, "2.21": _E220, "2.22": _E222, "2.23": _E223, "2.24": _E224,
        "2.25": _E224, "2.26": _E226, "2.27": _E226, "2.28": _E226, "2.29": _E229, "2.30": _E230}


@dataclass(frozen=True)
class ProtocolGeometry:
    """The per-job constants of one protocol (all sizes in bytes unless named elems)."""

    protocol: Protocol
    buffsize: int
    step_bytes: int        # one FIFO slot on the wire: buffsize / NCCL_STEPS
    slice_steps: int
    chunk_steps: int
    max_threads: int
    thread_threshold: int

    @property
    def slot_bytes(self) -> int:
        """Receive size a CTS announces: one slice of FIFO slots."""
        return self.step_bytes * self.slice_steps

    @property
    def data_bytes_per_step(self) -> int:
        """Payload (flag-free) bytes per FIFO step: Proto::calcBytePerStep()."""
        if self.protocol == Protocol.LL:
            return self.step_bytes * LL_LINE_DATA_BYTES // LL_LINE_BYTES
        if self.protocol == Protocol.LL128:
            return self.step_bytes * LL128_LINE_DATA_WORDS // LL128_LINE_WORDS
        return self.step_bytes

    def wire_bytes(self, nelem: int, elem_size: int) -> int:
        """Bytes on the wire for one protocol message carrying ``nelem`` elements."""
        return self.protocol.wire_bytes(max(nelem, 0) * elem_size)


def geometry(nccl: NcclSpec, world_size: int, protocol: Protocol | None = None) -> ProtocolGeometry:
    """The constants of ``protocol`` (default: the job's ``nccl.protocol``) in this job."""
    proto = Protocol.of(nccl.protocol) if protocol is None else protocol
    buffsize = _buffsize(nccl, proto)
    if buffsize % NCCL_STEPS:
        raise PlanError(f"nccl.buffsize.{proto.nccl_name} = {buffsize} is not a multiple of NCCL_STEPS ({NCCL_STEPS})")
    threshold = THREAD_THRESHOLD[proto] * (world_size if proto == Protocol.LL else 1)
    return ProtocolGeometry(
        protocol=proto, buffsize=buffsize, step_bytes=buffsize // NCCL_STEPS,
        slice_steps=SLICE_STEPS[proto], chunk_steps=CHUNK_STEPS[proto],
        max_threads=nccl.nthreads or MAX_THREADS[proto], thread_threshold=threshold,
    )


def _buffsize(nccl: NcclSpec, proto: Protocol) -> int:
    return nccl.buffsize.get(proto.nccl_name, DEFAULT_BUFFSIZE[proto])


def bucket_protocols(nccl: NcclSpec, buckets: int) -> tuple[Protocol, ...]:
    """The protocol of each bucket's allreduce: ``nccl.protocols`` when given (one per bucket),
    else ``nccl.protocol`` for all."""
    if nccl.protocols is None:
        if nccl.protocol == "auto":
            raise PlanError("nccl.protocol is 'auto': each bucket's protocol is read from the wire at lock-on "
                            "(gradtap.parser.resolve) or modelled by the tuner (gradtap.workload.tuner) before a "
                            "wire plan is built; give nccl.protocols to fix them")
        return (Protocol.of(nccl.protocol),) * buckets
    if len(nccl.protocols) != buckets:
        raise PlanError(f"nccl.protocols names {len(nccl.protocols)} protocols, but the job has {buckets} DDP "
                        "buckets; give one per bucket, in launch order (gradtap inspect --job lists the buckets)")
    return tuple(Protocol.of(p) for p in nccl.protocols)


# NCCL's protocol numbering (NCCL_PROTO_LL 0, NCCL_PROTO_LL128 1,
# NCCL_PROTO_SIMPLE 2 in src/include/nccl_common.h, v2.19.3-1), the order its receive buffers are laid out in.
NCCL_PROTOCOL_ORDER = (Protocol.LL, Protocol.LL128, Protocol.SIMPLE)


def recv_buffer_offset(nccl: NcclSpec, proto: Protocol) -> int:
    """Where protocol ``proto``'s receive buffer starts in a connection's receive memory. The
    receiver's proxy maps the buffers of all protocols one after another in NCCL's protocol
    order, in one bank (``recvProxyConnect``: ``NCCL_NET_MAP_ADD_POINTER(map, 0, useGdr,
    buffSizes[p], buffs[p])`` for p = 0, 1, 2; src/transport/net.cc, v2.19.3-1). The parser
    does not rely on it: it learns each protocol's base from the wire."""
    offset = 0
    for p in NCCL_PROTOCOL_ORDER:
        if p == proto:
            return offset
        offset += _buffsize(nccl, p)
    raise AssertionError(proto)


def call_channels_threads(nbytes: int, nchannels: int, geo: ProtocolGeometry) -> tuple[int, int]:
    """Channels and threads NCCL uses for one ring allreduce of ``nbytes`` (topoGetAlgoInfo).

    Small calls use fewer channels, then fewer threads, so that each thread has at least
    ``thread_threshold`` bytes of work. Simple adds one warp for synchronisation.
    """
    nc, nt = nchannels, geo.max_threads
    while nbytes < nc * nt * geo.thread_threshold:
        if nc >= 2:
            nc -= 1
        elif nt % 128 == 0:
            nt //= 2
        else:
            break
    if geo.protocol == Protocol.SIMPLE:
        nt += WARP_SIZE
    return nc, max(nt, 3 * WARP_SIZE)


def era_facts(nccl: NcclSpec) -> EraFacts:
    if nccl.era == "auto":
        raise PlanError("nccl.era is 'auto': the era is read from the wire at lock-on (gradtap.parser.resolve) "
                        "before a wire plan is built; give the trainer's NCCL major.minor to fix it")
    return ERAS[nccl.era]


def era_supported(nccl: NcclSpec, world_size: int) -> EraFacts:
    """The era's facts, or a PlanError when the job uses a feature of the era that the wire
    plan does not model (each message names the job field and the fix)."""
    facts = era_facts(nccl)
    nq = nccl.qps_per_connection
    if facts.split_qp_patch_dependent and split_data_on_qps(nccl) and nq > 1:
        raise PlanError(f"nccl.era {nccl.era} with nccl.split_data_on_qps and qps_per_connection {nq}: "
                        "NCCL 2.30.3/2.30.4 start each message's parts at QP (message index mod nqps) and "
                        "2.30.7 at QP 0, so the era does not fix the wire; set nccl.split_data_on_qps false "
                        "(NCCL's default since 2.20) or use one QP per connection")
    return facts


def split_data_on_qps(nccl: NcclSpec) -> bool:
    return era_facts(nccl).split_data_on_qps_default if nccl.split_data_on_qps is None else nccl.split_data_on_qps
