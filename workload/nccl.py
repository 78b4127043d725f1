"""NCCL facts the wire plan relies on, one era at a time.

Every number here is cited in ``docs/wire-format.md`` with the NCCL source file and version
it comes from. The ``2.19`` era covers NCCL 2.18.x and 2.19.x (checked against v2.19.3-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradtap.core.errors import PlanError
from gradtap.workload.spec import NcclSpec

NCCL_STEPS = 8                 # src/include/device.h: FIFO slots per connection
WARP_SIZE = 32
LL_LINE_BYTES = 16             # union ncclLLFifoLine: data1, flag1, data2, flag2
LL_DATA_PER_LINE = 8
LL128_LINE_BYTES = 128         # NCCL_LL128_LINESIZE
LL128_LINE_WORDS = 16          # NCCL_LL128_LINEELEMS (uint64 words per line)
LL128_DATA_WORDS = 15          # NCCL_LL128_DATAELEMS; word 15 of each line is the flag
LL128_SHMEM_WORDS_PER_THREAD = 8
LL128_WIRE_WORDS_PER_WARP = WARP_SIZE * LL128_SHMEM_WORDS_PER_THREAD  # 256 words = 2048 B
LL128_DATA_WORDS_PER_WARP = LL128_WIRE_WORDS_PER_WARP * LL128_DATA_WORDS // LL128_LINE_WORDS  # 240
CTS_BYTES = 32                 # sizeof(struct ncclIbSendFifo), src/transport/net_ib.cc
CTS_SLOT_STRIDE = 8 * CTS_BYTES  # NCCL_NET_IB_MAX_RECVS entries per fifo slot = 256 B
CTS_SLOTS = 64                 # MAX_REQUESTS = NCCL_NET_MAX_REQUESTS (8) * NCCL_NET_IB_MAX_RECVS (8)
QP_SPLIT_ALIGN = 128           # ncclIbMultiSend: multi-QP parts are multiples of 128 B

# src/init.cc DEFAULT_*_BUFFSIZE
DEFAULT_BUFFSIZE = {
    "LL": 8 * 512 * NCCL_STEPS * LL_LINE_BYTES,          # NCCL_LL_LINES_PER_THREAD*NCCL_LL_MAX_NTHREADS*STEPS*16
    "LL128": 120 * 640 * NCCL_STEPS * 8,                 # NCCL_LL128_ELEMS_PER_THREAD*MAX_NTHREADS*STEPS*8
    "Simple": 1 << 22,
}
# src/graph/tuning.cc: maxThreads[RING][proto] and threadThresholds (LL's is scaled by nRanks)
MAX_THREADS = {"Simple": 512, "LL": 512, "LL128": 640}
THREAD_THRESHOLD = {"Simple": 64, "LL": 8, "LL128": 8}
# src/include/collectives.h: ALLREDUCE_SLICESTEPS / ALLREDUCE_CHUNKSTEPS (Simple only)
SLICE_STEPS = {"Simple": NCCL_STEPS // 4, "LL": 1, "LL128": 1}
CHUNK_STEPS = {"Simple": NCCL_STEPS // 2, "LL": 1, "LL128": 1}


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

    protocol: str
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
        if self.protocol == "LL":
            return self.step_bytes // 2
        if self.protocol == "LL128":
            return self.step_bytes * LL128_DATA_WORDS // LL128_LINE_WORDS
        return self.step_bytes

    def wire_bytes(self, nelem: int, elem_size: int) -> int:
        """Bytes on the wire for one protocol message carrying ``nelem`` elements."""
        if nelem <= 0:
            return 0
        data = nelem * elem_size
        if self.protocol == "LL":
            return -(-data // LL_DATA_PER_LINE) * LL_LINE_BYTES
        if self.protocol == "LL128":
            per_warp = LL128_DATA_WORDS_PER_WARP * 8
            return -(-data // per_warp) * LL128_WIRE_WORDS_PER_WARP * 8
        return data


def geometry(nccl: NcclSpec, world_size: int) -> ProtocolGeometry:
    proto = nccl.protocol
    buffsize = nccl.buffsize.get(proto, DEFAULT_BUFFSIZE[proto])
    if buffsize % NCCL_STEPS:
        raise PlanError(f"nccl.buffsize.{proto} = {buffsize} is not a multiple of NCCL_STEPS ({NCCL_STEPS})")
    threshold = THREAD_THRESHOLD[proto] * (world_size if proto == "LL" else 1)
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
    if geo.protocol == "Simple":
        nt += WARP_SIZE
    return nc, max(nt, 3 * WARP_SIZE)


def era_facts(nccl: NcclSpec) -> EraFacts:
    return ERAS[nccl.era]


def split_data_on_qps(nccl: NcclSpec) -> bool:
    return era_facts(nccl).split_data_on_qps_default if nccl.split_data_on_qps is None else nccl.split_data_on_qps
