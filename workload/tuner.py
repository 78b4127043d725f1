"""NCCL's protocol choice for one ring allreduce: a model of its tuner, for the simulator.

With ``nccl.protocol: auto`` NCCL picks each call's protocol by size. The appliance reads the
choice from the wire; the simulator has no wire to read, so it asks this model, which follows
``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` (src/graph/tuning.cc) restricted to the Ring
algorithm (the trainer runs with ``NCCL_ALGO=Ring``) and to allreduce, era by era (2.19 - 2.30).
docs/wire-format.md, "The tuner's protocol choice", lists every constant with its tag.

For a ring of ``n`` ranks on ``N`` nodes (``ppn = n / N``), a graph of ``c`` channels of
``b`` GB/s each, and protocol ``p`` (LL, LL128, Simple)::

    busBw[LL]     = min(llMaxBw, c*b * f_LL)                  f_LL = 1/4 (2.19-2.20), 1/2 (2.21+)
    busBw[LL128]  = min(c*b * f_128, c * perChMaxRingLL128Bw) f_128 = 0.7 if ppn < 2 (2.19-2.22), else 0.92
    busBw[Simple] = c*b
    bw[p]  = busBw[p] * n / (2 (n-1))                                   GB/s (algorithm bandwidth)
    lat[p] = baseLat[p] + (2(n-1) - s) * max(intraLat[p], netOverhead[p]) + s * interLat[p]    us
             s = 2N (2.19-2.22) or 2(N-1) (2.23+) inter-node steps
    time[p](B) = lat[p] * k + B / (1000 * bw[p])                                                us
             k = 1.4 (1.9 before Ampere) for Simple when B / (channels * n) >= 64, else 1

NCCL takes the protocol of least time, the first in the order LL, LL128, Simple on a tie;
LL128 only where it is enabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, floor
from typing import Sequence

from gradtap.core.errors import ConfigError, PlanError
from gradtap.wire.protocol import Protocol
from gradtap.workload.spec import WIRE_DTYPE_BYTES, JobSpec, TunerSpec

# NCCL's protocol order (NCCL_PROTO_LL 0, LL128 1, SIMPLE 2, src/include/nccl_common.h): the
# order topoGetAlgoInfo (src/enqueue.cc) tries them in, keeping the first on a tie (time < minTime).
ORDER = (Protocol.LL, Protocol.LL128, Protocol.SIMPLE)

# Latencies in us, per protocol (LL, LL128, Simple), src/graph/tuning.cc, unchanged v2.19.3-1 - v2.30.7-1
# (ncclTunerConstantsDefaults from v2.28.3-1):
BASE_LAT = (6.6, 14.0, 8.4)                  # baseLat[RING]
HW_LAT_NVLINK = (0.6, 1.9, 3.4)              # hwLat[NCCL_HW_NVLINK][RING]
HW_LAT_PCI = (1.0, 2.5, 5.7)                 # hwLat[NCCL_HW_PCI][RING]
HW_LAT_NET = (2.7, 4.0, 14.0)                # hwLat[NCCL_HW_NET][RING]
# getNetOverhead (tuning.cc, every era): us per net step, x3 for Simple
NET_OVERHEAD = {"intel": 1.0, "amd": 2.0, "other": 1.0}
NET_OVERHEAD_SIMPLE_FACTOR = 3
# llMaxBws[index1][index2] for several nodes: index1 0 (not AMD) or 1 (AMD CPUs), index2 = min(nNodes-1, 2);
# tuning.cc, unchanged v2.19.3-1 - v2.30.7-1 (only the single-node Hopper/Blackwell rows change)
LL_MAX_BW = {"intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0), "other": (39.0, 39.0, 20.4)}
# perChMaxRingLL128Bws[compCapIndex] (N1/N2/N4), tuning.cc: Volta, Ampere, Hopper rows in every era
PER_CH_LL128 = {70: (20.0, 20.0, 20.0), 80: (20.0, 20.0, 20.0), 90: (36.7, 36.7, 36.7)}
LL128_FACTOR = 0.92                          # busBw * 0.92 /*120.0/128.0*/ (ppn >= 2, or any ppn from 2.23)
LL128_FACTOR_PPN1 = 0.7                      # busBw * (ppn < 2 ? 0.7 : 0.92), v2.19.3-1 - v2.22.3-1
# ncclTopoGetAlgoTime: "Plateau effect of ring", Simple allreduce over several nodes
PLATEAU = (1.9, 1.4)                         # minCompCap < 80, else
PLATEAU_MIN_BYTES = 64                       # nBytes / (comm->nChannels * nRanks) >= 64

# src/graph/search.cc, ncclTopoCompute: the ring graph's per-channel speeds (GB/s) it tries,
# fastest first; unchanged v2.19.3-1 - v2.30.7-1 for the first two
SPEEDS = (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12)
SPEEDS_SM90 = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24, 0.12)
SPEEDS_DECREASE_RATIO = 0.49   # search.cc: lower the speed while speedArray[i+1]/graph->bwInter > .49
DUP_MIN_BW = 25.0              # ncclTopoDupChannels: no duplication below bwIntra 25
DUP_SM90_BW, DUP_SM90_CHANNELS = 50.0, 4   # ... nor for ccMin > 80, bwIntra < 50 and nChannels > 4
MAX_RING_CHANNELS = 16         # ringGraph.maxChannels = MAXCHANNELS/2 (MAXCHANNELS 32; 64 from 2.28, not reached)
MBPS_PER_GBS = 8000.0          # src/graph/topo.cc: net->net.bw = mbps / 8000.0 (GB/s)


@dataclass(frozen=True)
class EraTuning:
    """The ring-allreduce tuner constants that differ between eras (first tag of each in
    docs/wire-format.md, "The tuner's protocol choice")."""

    ll_factor: float                      # busBw * 1/4 (v2.19.3-1, v2.20.5-1), * .5 (v2.21.5-1+)
    ll128_ppn1_factor: float              # 0.7 for ppn < 2 up to v2.22.3-1, then 0.92 (v2.23.4-1)
    inter_steps_all_nodes: bool           # nInterSteps = 2*nNodes up to v2.22.3-1, 2*(nNodes-1) from v2.23.4-1
    ppn1_tree_net_lat: tuple[float, float, float] | None  # v2.23.4-1+: with ppn 1 interLat = hwLat[NET][TREE]
    blackwell_ll128: tuple[float, float, float] | None     # perChMaxRingLL128Bws Blackwell row (v2.25.1-1+)
    ll128_compcaps: frozenset[int] | None  # LL128 default: compcaps of the switch; None: any >= 70 (v2.27.3-1+)
    sm100_speeds: tuple[float, ...] | None  # sm100SpeedArrayInter when it differs from the sm90 one


_TREE_NET_LAT = (5.0, 8.5, 14.0)            # hwLat[NET][TREE], v2.23.4-1+ (Simple was 28 before)
_CC_2_19 = frozenset({70, 80, 90})          # tuning.cc switch (minCompCap), v2.19.3-1 - v2.24.3-1
_CC_2_25 = frozenset({70, 80, 90, 100, 120})  # + case 100, case 120, v2.25.1-1 - v2.26.6-1
_BW_2_25 = (2 * 36.7, 2 * 36.7, 2 * 36.7)   # v2.25.1-1 - v2.28.3-1
_BW_2_28 = (2 * 36.7, 34.6, 2 * 36.7)       # v2.28.7-1, v2.28.9-1
_BW_2_29 = (40.0, 40.0, 40.0)               # v2.29.7-1, v2.30.x (v2.29.2-1 had 34.5, 34.6, 34.5)
_SM100_2_27 = (96.0, 48.0, 45.1) + SPEEDS_SM90[2:]          # v2.27.7-1, v2.28.x (v2.27.3-1: 47.9, 45.0, ...)
_SM100_2_29 = (96.0, 80.0, 48.0, 45.1) + SPEEDS_SM90[2:]    # v2.29.x
_SM100_2_30 = (96.0, 86.0, 80.0, 48.0, 45.1) + SPEEDS_SM90[2:]  # v2.30.7-1

_T219 = EraTuning(0.25, LL128_FACTOR_PPN1, True, None, None, _CC_2_19, None)
_T221 = EraTuning(0.5, LL128_FACTOR_PPN1, True, None, None, _CC_2_19, None)
_T223 = EraTuning(0.5, LL128_FACTOR, False, _TREE_NET_LAT, None, _CC_2_19, None)
_T225 = EraTuning(0.5, LL128_FACTOR, False, _TREE_NET_LAT, _BW_2_25, _CC_2_25, None)
_T227 = EraTuning(0.5, LL128_FACTOR, False, _TREE_NET_LAT, _BW_2_25, None, _SM100_2_27)
_T228 = EraTuning(0.5, LL128_FACTOR, False, _TREE_NET_LAT, _BW_2_28, None, _SM100_2_27)
_T229 = EraTuning(0.5, LL128_FACTOR, False, _TREE_NET_LAT, _BW_2_29, None, _SM100_2_29)
_T230 = EraTuning(0.5, LL128_FACTOR, False, _TREE_NET_LAT, _BW_2_29, None, _SM100_2_30)
ERA_TUNING = {"2.19": _T219, "2.20": _T219, "2.21": _T221, "2.22": _T221, "2.23": _T223, "2.24": _T223,
              "2.25": _T225, "2.26": _T225, "2.27": _T227, "2.28": _T228, "2.29": _T229, "2.30": _T230}

# PATH_* order of src/graph/topo.h (PIX < PXB < PXN < PHB < SYS in every era)
_PATHS = ("PIX", "PXB", "PXN", "PHB", "SYS")


@dataclass(frozen=True)
class RingModel:
    """The tuner's view of one job's ring allreduce: per protocol in :data:`ORDER`, the
    latency (us) and algorithm bandwidth (GB/s; 0 where the protocol is disabled)."""

    lat: tuple[float, float, float]
    bw: tuple[float, float, float]
    ranks: int
    channels: int          # comm->nChannels: the job's nccl.channels
    plateau: float         # Simple's latency factor past the plateau size

    def time_us(self, protocol: Protocol, nbytes: int) -> float:
        """ncclTopoGetAlgoTime for Ring, one pipelined op (numPipeOps 1: a DDP bucket is one call);
        -1 when the protocol is disabled."""
        p = ORDER.index(protocol)
        if self.bw[p] == 0:
            return -1.0
        lat = self.lat[p]
        if protocol == Protocol.SIMPLE and nbytes // (self.channels * self.ranks) >= PLATEAU_MIN_BYTES:
            lat *= self.plateau
        return lat + nbytes / (1000 * self.bw[p])

    def choose(self, nbytes: int) -> Protocol:
        """The protocol of least time for an allreduce of ``nbytes`` (first in :data:`ORDER` on a tie)."""
        best, best_time = Protocol.SIMPLE, float("inf")
        for proto in ORDER:
            t = self.time_us(proto, nbytes)
            if 0 <= t < best_time:
                best, best_time = proto, t
        return best


def era_tuning(job: JobSpec) -> EraTuning:
    if job.nccl.era == "auto":
        raise PlanError("nccl.era is 'auto': NCCL's tuner constants differ by release, so the tuner model needs "
                        "the trainer's NCCL major.minor; give nccl.era (e.g. '2.21')")
    return ERA_TUNING[job.nccl.era]


def ring_graph(tuner: TunerSpec, era: EraTuning) -> tuple[int, float]:
    """The ring graph's ``(nChannels, bw)`` (GB/s per channel) as ncclTopoCompute finds it for
    a rank whose one NIC (``nic_gbps``) carries every channel and whose GPU-NIC path is not
    narrower; ``graph_channels``/``graph_bw`` when given. A channel takes ``bw`` of the NIC.

    Pass 1 tries speeds from the fastest the NIC carries downwards, while the next is over 0.49
    of the best found, keeping the largest ``nChannels * bw``; ncclTopoDupChannels then doubles
    the channels at half the speed; pass 2 raises the speed while the channels still fit."""
    if tuner.graph_channels is not None and tuner.graph_bw is not None:
        return tuner.graph_channels, tuner.graph_bw
    cc, nic = tuner.compute_capability, tuner.nic_gbps * 1000 / MBPS_PER_GBS
    speeds = SPEEDS if cc < 90 else (era.sm100_speeds or SPEEDS_SM90) if cc >= 100 else SPEEDS_SM90

    def fit(speed: float) -> int:
        return min(floor(nic / speed), MAX_RING_CHANNELS)

    i = next((k for k, s in enumerate(speeds) if s <= nic), len(speeds) - 1)
    nch, bw = 0, 0.0
    while True:
        if fit(speeds[i]) * speeds[i] > nch * bw:
            nch, bw = fit(speeds[i]), speeds[i]
        if i + 1 < len(speeds) and (nch == 0 or speeds[i + 1] / bw > SPEEDS_DECREASE_RATIO):
            i += 1
            continue
        break
    if bw >= DUP_MIN_BW and not (cc > 80 and bw < DUP_SM90_BW and nch > DUP_SM90_CHANNELS):
        dup = min(2 * nch, MAX_RING_CHANNELS)
        bw /= ceil(dup / nch)
        nch = dup
    for speed in reversed([s for s in speeds if s > bw]):   # pass 2: faster, same channels
        if fit(speed) >= nch and fit(speed) * speed > nch * bw:
            nch, bw = fit(speed), speed
    return nch, bw


def ll128_enabled(tuner: TunerSpec, era: EraTuning) -> bool:
    """NCCL_PROTO's choice (``tuner.ll128``), else tuning.cc's default rule (``pEnable == 2``):
    GPU-NIC path up to PXB (PXN from Hopper, NCCL_LL128_C2C's default), GPUs of a node on
    NVLink (typeIntra <= PATH_NVB), and a compute capability the era enables."""
    if tuner.ll128 is not None:
        return tuner.ll128
    cc = tuner.compute_capability
    path = _PATHS.index(tuner.gpu_nic_path)
    on = path <= _PATHS.index("PXB") or (cc >= 90 and path <= _PATHS.index("PXN"))
    on &= tuner.ppn == 1 or tuner.nvlink
    return on and (cc >= 70 if era.ll128_compcaps is None else cc in era.ll128_compcaps)


def ring_model(job: JobSpec) -> RingModel:
    """ncclTopoTuneModel for Ring allreduce, for this job's ring and ``nccl.tuner``."""
    tuner, era = job.nccl.tuner, era_tuning(job)
    n = job.world_size
    nodes = tuner.nodes if tuner.nodes is not None else n // tuner.ppn
    if nodes * tuner.ppn != n or nodes < 2:
        raise ConfigError(f"nccl.tuner: {nodes} nodes x ppn {tuner.ppn} is not the ring's {n} ranks over at "
                          "least 2 nodes; set nccl.tuner.ppn (ranks per node) and nccl.tuner.nodes to match")
    cc = tuner.compute_capability
    ppn = n / nodes
    nch, bw = ring_graph(tuner, era)
    bus = nch * bw                                  # nNodes <= 2 takes bwIntra, more bwInter: equal for a ring
    index2 = min(nodes - 1, 2)
    ll_bus = min(LL_MAX_BW[tuner.cpu_vendor][index2], bus * era.ll_factor)
    row = 70 if cc < 80 else 80 if cc < 90 else 90    # compCapIndex (Blackwell, cc >= 100, its own from 2.25)
    per_ch = era.blackwell_ll128 if cc >= 100 and era.blackwell_ll128 else PER_CH_LL128[row]
    ll128_bus = min(bus * (era.ll128_ppn1_factor if ppn < 2 else LL128_FACTOR), nch * per_ch[index2])
    if not ll128_enabled(tuner, era):
        ll128_bus = 0.0
    nsteps = 2 * (n - 1)
    ratio = n / nsteps
    inter_steps = 2 * nodes if era.inter_steps_all_nodes else 2 * (nodes - 1)
    # typeIntra is LOC for one GPU per node (not NVL): the PCI row
    intra = HW_LAT_NVLINK if tuner.ppn > 1 and tuner.nvlink else HW_LAT_PCI
    inter = era.ppn1_tree_net_lat if era.ppn1_tree_net_lat is not None and ppn == 1 else HW_LAT_NET
    lat = []
    for p, proto in enumerate(ORDER):
        overhead = NET_OVERHEAD[tuner.cpu_vendor] * (NET_OVERHEAD_SIMPLE_FACTOR if proto == Protocol.SIMPLE else 1)
        # graph->latencyInter is the net's latency property, 0 for NCCL's IB transport (net_ib.cc)
        lat.append(BASE_LAT[p] + (nsteps - inter_steps) * max(intra[p], overhead) + inter_steps * inter[p])
    return RingModel(lat=tuple(lat), bw=(ll_bus * ratio, ll128_bus * ratio, bus * ratio), ranks=n,
                     channels=job.nccl.channels, plateau=PLATEAU[0] if cc < 80 else PLATEAU[1])


def ring_protocols(job: JobSpec, bucket_numels: Sequence[int]) -> tuple[Protocol, ...]:
    """The protocol NCCL's tuner picks for each bucket's ring allreduce (``numel`` elements of
    the wire dtype ``ddp.grad_dtype``), in launch order."""
    model = ring_model(job)
    elem = WIRE_DTYPE_BYTES[job.ddp.grad_dtype]
    return tuple(model.choose(int(numel) * elem) for numel in bucket_numels)


def tuned(job: JobSpec, bucket_numels: Sequence[int]) -> JobSpec:
    """The job with ``nccl.protocols`` filled in by :func:`ring_protocols` when ``nccl.protocol``
    is ``auto`` and ``nccl.protocols`` unset; else the job itself."""
    if job.nccl.protocol != "auto" or job.nccl.protocols is not None:
        return job
    names = tuple(p.nccl_name for p in ring_protocols(job, bucket_numels))
    return job.model_copy(update={"nccl": job.nccl.model_copy(update={"protocols": names})})


def crossovers(job: JobSpec, max_bytes: int = 1 << 40) -> tuple[tuple[int, Protocol], ...]:
    """Where the choice changes: ``(first size in bytes, protocol)`` for the smallest size (1)
    and for every size at which the tuner's protocol differs from the size before."""
    model = ring_model(job)
    points, size, proto = [(1, model.choose(1))], 1, model.choose(1)
    while size < max_bytes:
        nxt = min(size * 2, max_bytes)
        if model.choose(nxt) != proto:
            lo, hi = size, nxt                      # choose(lo) == proto != choose(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if model.choose(mid) == proto else (lo, mid)
            proto = model.choose(hi)
            points.append((hi, proto))
            size = hi
        else:
            size = nxt
    return tuple(points)
