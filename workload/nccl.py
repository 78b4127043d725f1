"""NCCL facts the wire plan relies on, one era at a time.

Every number here is cited in ``docs/wire-format.md`` with the NCCL source file and version
it comes from. The ``2.19`` era covers NCCL 2.18.x and 2.19.x (checked against v2.19.3-1).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class EraFacts:
    """What changes between NCCL eras on the wire."""

    cts_bytes: int
    imm_big_endian: bool
    split_data_on_qps_default: bool


ERAS = {"2.19": EraFacts(cts_bytes=CTS_BYTES, imm_big_endian=False, split_data_on_qps_default=True)}


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


def geometry(nccl: NcclSpec, world_size: int) -> ProtocolGeometry:
    proto = Protocol.of(nccl.protocol)
    buffsize = nccl.buffsize.get(nccl.protocol, DEFAULT_BUFFSIZE[proto])
    if buffsize % NCCL_STEPS:
        raise PlanError(f"nccl.buffsize.{nccl.protocol} = {buffsize} is not a multiple of NCCL_STEPS ({NCCL_STEPS})")
    threshold = THREAD_THRESHOLD[proto] * (world_size if proto == Protocol.LL else 1)
    return ProtocolGeometry(
        protocol=proto, buffsize=buffsize, step_bytes=buffsize // NCCL_STEPS,
        slice_steps=SLICE_STEPS[proto], chunk_steps=CHUNK_STEPS[proto],
        max_threads=nccl.nthreads or MAX_THREADS[proto], thread_threshold=threshold,
    )


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
    return ERAS[nccl.era]


def split_data_on_qps(nccl: NcclSpec) -> bool:
    return era_facts(nccl).split_data_on_qps_default if nccl.split_data_on_qps is None else nccl.split_data_on_qps
