"""The wire plan against a literal walk of NCCL's ring allreduce, era by era.

Each walk below is a slow transcription of NCCL's own code for one era, written from the
source at the tags named, independently of ``workload/ring_schedule.py``:

* host: ``topoGetAlgoInfo`` / ``getChannnelThreadInfo`` (channels and threads of a call),
  ``addCBDCollToPlan`` with ``computeCollAlignCount`` and ``computeCollLastChunkInfo``
  (v2.20.3-1, v2.21.5-1), ``scheduleCollTasksToPlan`` with ``calcCollChunking`` (v2.22.3-1,
  v2.23.4-1, v2.26.2-1, v2.29.2-1, v2.30.3-1), all in ``src/enqueue.cc``;
* device: ``runRing`` of ``src/device/all_reduce.h`` at v2.19.3-1, v2.20.3-1 and v2.22.3-1
  (unchanged in its offsets up to v2.30.7-1), ``ncclCollCbdPart`` of ``src/include/device.h``,
  and ``genericOp``'s slices of ``src/device/prims_simple.h``.

The walk lists every send of every rank on every channel (loop, ring step, chunk, slice,
element offset, element count), which must equal the plan's data messages one for one.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradtap.core.errors import ConfigError, PlanError
from gradtap.workload import nccl as N
from gradtap.workload.spec import SUPPORTED_ERAS, parse_job
from gradtap.workload.wire_plan import CTS, DATA, NO_VA, build_plan

WARP_SIZE = 32
NCCL_STEPS = 8
SIMPLE, LL, LL128 = "Simple", "LL", "LL128"
MAX_THREADS = {SIMPLE: 512, LL: 512, LL128: 640}        # src/graph/tuning.cc
THREAD_THRESHOLD = {SIMPLE: 64, LL: 8, LL128: 8}        # src/include/comm.h
BUFFSIZE = {SIMPLE: 1 << 22, LL: 8 * 512 * 8 * 16, LL128: 120 * 640 * 8 * 8}   # src/init.cc
ALLREDUCE_CHUNKSTEPS, ALLREDUCE_SLICESTEPS = NCCL_STEPS // 2, NCCL_STEPS // 4
LL128_LINEELEMS, LL128_DATAELEMS, LL128_SHMEM_ELEMS_PER_THREAD = 16, 15, 8


def DIVUP(x, y):  # noqa: N802 (NCCL's macro)
    return (x + y - 1) // y


def alignUp(x, a):  # noqa: N802
    return DIVUP(x, a) * a


def version(era: str) -> tuple[int, int]:
    return tuple(int(x) for x in era.split("."))


# -- host: channels and threads of one call (same arithmetic in every era) ---------------------

def algo_info(nBytes, nChannels, proto, nRanks):  # noqa: N803
    nc, nt = nChannels, MAX_THREADS[proto]
    threadThreshold = THREAD_THRESHOLD[proto] * (nRanks if proto == LL else 1)
    while nBytes < nc * nt * threadThreshold:       # 2.19 one loop; 2.20+ two, with the same result
        if nc >= 2:
            nc -= 1
        elif nt % 128 == 0:
            nt //= 2
        else:
            break
    if proto == SIMPLE:
        nt += WARP_SIZE
    nt = 3 * WARP_SIZE if nt // WARP_SIZE < 3 else nt
    return nc, nt


def host_chunk_size(proto):
    """computeCollChunkInfo (2.20) / calcCollChunking (2.22+), ring: bytes."""
    stepSize = BUFFSIZE[proto] // NCCL_STEPS
    chunkSteps = ALLREDUCE_CHUNKSTEPS if proto == SIMPLE else 1
    chunkSize = stepSize * chunkSteps
    if proto == LL:
        chunkSize //= 2
    if proto == LL128:
        chunkSize = (chunkSize // LL128_LINEELEMS) * LL128_DATAELEMS
    return chunkSize


# -- device: runRing of each era, reduced to the sends it posts -------------------------------

def ring_sends(ringIx, nranks, chunk_offset):  # noqa: N803
    """The chunks runRing sends in one loop, in order: send, the recvReduceSends, the
    directRecvReduceCopySend, the directRecvCopySends (directRecv sends nothing)."""
    def modRanks(r):  # noqa: N802
        return r - (nranks if r >= nranks else 0)
    out = [modRanks(ringIx + nranks - 1)]
    out += [modRanks(ringIx + nranks - j) for j in range(2, nranks)]
    out += [ringIx + 0]
    out += [modRanks(ringIx + nranks - j) for j in range(1, nranks - 1)]
    return [(step, chunk, *chunk_offset(chunk)) for step, chunk in enumerate(out)]


def run_ring_2_19(args, ringIx, nranks, size, proto, eltSize):  # noqa: N803
    nthreads, bid, nChannels = args["nWarps"] * WARP_SIZE, args["bid"], args["nChannels"]
    stepSize = BUFFSIZE[proto] // NCCL_STEPS
    calcBytePerStep = {SIMPLE: stepSize, LL: stepSize // 2,
                       LL128: stepSize * LL128_DATAELEMS // LL128_LINEELEMS}[proto]
    calcBytePerGrain = {SIMPLE: 8, LL: 8,
                        LL128: LL128_SHMEM_ELEMS_PER_THREAD * LL128_DATAELEMS * 8 // LL128_LINEELEMS}[proto]
    chunkSize = calcBytePerStep // eltSize * (ALLREDUCE_CHUNKSTEPS if proto == SIMPLE else 1)
    loopSize = nChannels * nranks * chunkSize
    if proto == LL:
        minChunkSize = nthreads * (calcBytePerGrain // eltSize)
    if proto == LL128:
        minChunkSize = nthreads * (calcBytePerGrain // eltSize) // 2
    loop = 0
    for gridOffset in range(0, size, loopSize):
        if proto == SIMPLE:
            realChunkSize = min(chunkSize, DIVUP(size - gridOffset, nChannels * nranks))
            realChunkSize = alignUp(realChunkSize, (nthreads - WARP_SIZE) * 8 // eltSize)
        else:
            realChunkSize = min(chunkSize, DIVUP(size - gridOffset, nChannels * nranks * minChunkSize) * minChunkSize)

        def calcOffset(chunk):  # noqa: N802
            if proto == SIMPLE:
                return gridOffset + bid * nranks * realChunkSize + chunk * realChunkSize
            return gridOffset + (chunk * nChannels + bid) * realChunkSize

        def offset_nelem(chunk):
            offset = calcOffset(chunk)
            return offset, min(realChunkSize, size - offset)
        for step, chunk, offset, nelem in ring_sends(ringIx, nranks, offset_nelem):
            yield loop, step, chunk, offset, nelem
        loop += 1


def ring_loops(gridOffset, channelCount, chunkCount, lastChunkCount, ringIx, nranks):  # noqa: N803
    """The device loop of 2.20 on: contiguous per-channel ranges, loop after loop; the last
    loop's chunk is ``lastChunkCount(remCount)``, which is where the eras differ."""
    loopCount = nranks * chunkCount
    loop = 0
    for elemOffset in range(0, channelCount, loopCount):
        remCount = channelCount - elemOffset
        if remCount < loopCount:
            chunkCount = lastChunkCount(remCount)

        def offset_nelem(chunk):
            chunkOffset = chunk * chunkCount
            return gridOffset + elemOffset + chunkOffset, min(chunkCount, remCount - chunkOffset)
        for step, chunk, offset, nelem in ring_sends(ringIx, nranks, offset_nelem):
            yield loop, step, chunk, offset, nelem
        loop += 1


def run_ring_2_20(args, ringIx, nranks):  # noqa: N803
    yield from ring_loops(args["workOffset"], args["workCount"], args["chunkCount"],
                          lambda remCount: args["lastChunkCount"], ringIx, nranks)


def ncclProtoGrainSize(proto):  # noqa: N802
    return {LL: 16, LL128: WARP_SIZE * LL128_SHMEM_ELEMS_PER_THREAD // LL128_LINEELEMS * LL128_DATAELEMS * 8,
            SIMPLE: 512}[proto]


def ncclCollCbdPart(work, channelId, proto, eltSize):  # noqa: N802, N803
    eltPerGrain = ncclProtoGrainSize(proto) // eltSize
    nMidChannels = work["channelHi"] - work["channelLo"] - 1
    if channelId == work["channelLo"]:
        return 0, work["countLo"], work["chunkGrainsLo"] * eltPerGrain
    if channelId == work["channelHi"]:
        return work["countLo"] + nMidChannels * work["countMid"], work["countHi"], work["chunkGrainsHi"] * eltPerGrain
    mid = channelId - work["channelLo"] - 1
    return work["countLo"] + mid * work["countMid"], work["countMid"], work["chunkGrainsMid"] * eltPerGrain


def run_ring_2_22(work, channelId, ringIx, nranks, proto, eltSize):  # noqa: N803
    gridOffset, channelCount, chunkCount = ncclCollCbdPart(work, channelId, proto, eltSize)
    yield from ring_loops(gridOffset, channelCount, chunkCount,
                          lambda remCount: alignUp(DIVUP(remCount, nranks), 16 // eltSize), ringIx, nranks)


# -- host: the work of each channel, per era ---------------------------------------------------

def works_2_19(count, eltSize, nRanks, nChannels, proto):  # noqa: N803
    nc, nt = algo_info(count * eltSize, nChannels, proto, nRanks)
    return {c: dict(bid=c, nChannels=nc, nWarps=nt // WARP_SIZE) for c in range(nc)}


def works_2_20(count, eltSize, nRanks, nChannels, proto):  # noqa: N803
    nBytes = count * eltSize
    nc, nThreads = algo_info(nBytes, nChannels, proto, nRanks)
    usableChannels = min(max(0, nChannels), nc)          # scheduleCollTasksToPlan
    totalCBDBytes = nBytes
    maxBytesPerChannel = DIVUP(DIVUP(totalCBDBytes, usableChannels), 16) * 16
    chunkCount = host_chunk_size(proto) // eltSize
    if proto == SIMPLE:                                   # computeCollAlignCount
        alignCount = (WARP_SIZE * 8 * 16) // eltSize
    elif proto == LL128:
        alignCount = 480 // eltSize * (nThreads // WARP_SIZE)
    else:
        alignCount = 8 // eltSize * nThreads
    works, collBytes = {}, [0] * usableChannels
    workBytesTotal, workCountTotal, workOffset = nBytes, count, 0
    for c in range(usableChannels):                      # addCBDCollToPlan
        if maxBytesPerChannel <= collBytes[c]:
            continue
        if workBytesTotal == 0:
            break
        enqBytes = min(maxBytesPerChannel - collBytes[c], workBytesTotal)
        workCount = min(DIVUP(DIVUP(enqBytes, eltSize), alignCount) * alignCount, workCountTotal)
        enqBytes = workCount * eltSize
        remCount = workCount % (nRanks * chunkCount)     # computeCollLastChunkInfo
        lastChunkCount = DIVUP(DIVUP(remCount, nRanks), alignCount) * alignCount
        works[c] = dict(workOffset=workOffset, workCount=workCount, chunkCount=chunkCount,
                        lastChunkCount=lastChunkCount)
        workBytesTotal -= enqBytes
        workCountTotal -= workCount
        collBytes[c] += enqBytes
        workOffset += workCount
    return works


def work_2_22(count, elementSize, nRanks, commChannels, proto, era):  # noqa: N803
    v = version(era)
    nc, _ = algo_info(count * elementSize, commChannels, proto, nRanks)
    taskTraffic = count * elementSize * 2               # ncclFuncTrafficPerByte(AllReduce) = 2
    if v >= (2, 26) and proto == LL:                    # ncclPrepareTasks: aggBeg->trafficBytes *= 4
        taskTraffic *= 4
    MinTrafficPerChannel = 512 if v < (2, 23) else (16 << 10) if v < (2, 29) else (32 << 10)
    trafficBytes = taskTraffic if v < (2, 23) else max(MinTrafficPerChannel, taskTraffic)
    nMaxChannels = commChannels
    nChannelsKind = min(nc, nMaxChannels)
    if v < (2, 29):
        trafficPerChannel = max(MinTrafficPerChannel, trafficBytes // nChannelsKind)
    else:
        trafficPerChannel = DIVUP(trafficBytes // nChannelsKind, 16) * 16
    channelId, currentTraffic = 0, 0
    trafficPerByte = 2
    if v >= (2, 26) and proto == LL:
        trafficPerByte *= 4
    cellSize = 16 if v < (2, 23) else DIVUP(DIVUP(MinTrafficPerChannel, trafficPerByte), 16) * 16
    elementsPerCell = cellSize // elementSize
    cells = DIVUP(count * elementSize, cellSize)
    trafficPerCell = cellSize * trafficPerByte
    cellsPerChannel = min(cells, DIVUP(trafficPerChannel, trafficPerCell))
    if channelId + 1 == nMaxChannels:
        cellsLo = cells
    elif v < (2, 23):
        cellsLo = min(cells, (trafficPerChannel - currentTraffic) // trafficPerCell)
    else:
        cellsLo = min(cells, DIVUP(trafficPerChannel - currentTraffic, trafficPerCell))
    nMidChannels = (cells - cellsLo) // cellsPerChannel
    cellsHi = (cells - cellsLo) % cellsPerChannel
    nChannels = (1 if cellsLo != 0 else 0) + nMidChannels + (1 if cellsHi != 0 else 0)
    if nMaxChannels < channelId + nChannels:
        nMidChannels = nMaxChannels - channelId - 2
        cellsPerChannel = (cells - cellsLo) // (nMidChannels + 1)
        cellsHi = cellsPerChannel + (cells - cellsLo) % (nMidChannels + 1)
    if cellsHi == 0 and nMidChannels != 0:
        cellsHi = cellsPerChannel
        nMidChannels -= 1
    if cellsLo == 0:
        channelId += 1
        if nMidChannels == 0:
            cellsLo, cellsHi = cellsHi, 0
        else:
            cellsLo = cellsPerChannel
            nMidChannels -= 1
    countMid = cellsPerChannel * elementsPerCell if nMidChannels != 0 else 0
    countLo = cellsLo * elementsPerCell
    countHi = cellsHi * elementsPerCell
    if countHi != 0:
        countHi -= cells * elementsPerCell - count
    else:
        countLo -= cells * elementsPerCell - count
    nChannels = (1 if countLo != 0 else 0) + nMidChannels + (1 if cellsHi != 0 else 0)
    grainSize = ncclProtoGrainSize(proto)
    chunkSize = host_chunk_size(proto) // grainSize * grainSize     # calcCollChunking, ring
    return dict(channelLo=channelId, channelHi=channelId + nChannels - 1, countLo=countLo, countMid=countMid,
                countHi=countHi, chunkGrainsLo=chunkSize // grainSize, chunkGrainsMid=chunkSize // grainSize,
                chunkGrainsHi=chunkSize // grainSize)


def genericOp_slices(nelem, proto, eltSize):  # noqa: N802
    """(offset, size) of the FIFO posts of one primitive call: Simple's SlicePerChunk slices
    (prims_simple.h genericOp), one for LL and LL128."""
    nelem = 0 if nelem < 0 else nelem
    if proto != SIMPLE:
        return [(0, nelem)]
    SlicePerChunk = ALLREDUCE_CHUNKSTEPS // ALLREDUCE_SLICESTEPS
    stepSize = BUFFSIZE[SIMPLE] // NCCL_STEPS // eltSize
    sliceSize = stepSize * ALLREDUCE_SLICESTEPS
    sliceSize = max(DIVUP(nelem, 16 * SlicePerChunk) * 16, sliceSize // 32)
    out, offset = [], 0
    for _ in range(SlicePerChunk):
        sliceSize = sliceSize if sliceSize < nelem - offset else nelem - offset
        out.append((offset, sliceSize))
        offset += sliceSize
    return out


def nccl_walk(era, count, eltSize, nranks, nChannels, proto):  # noqa: N803
    """{(channel, position): [(loop, ring_step, chunk, slice, elem_offset, nelem), ...]}."""
    v = version(era)
    out = {}
    if v < (2, 20):
        per = {c: (lambda p, a=a: run_ring_2_19(a, p, nranks, count, proto, eltSize))
               for c, a in works_2_19(count, eltSize, nranks, nChannels, proto).items()}
    elif v < (2, 22):
        per = {c: (lambda p, a=a: run_ring_2_20(a, p, nranks))
               for c, a in works_2_20(count, eltSize, nranks, nChannels, proto).items()}
    else:
        work = work_2_22(count, eltSize, nranks, nChannels, proto, era)
        per = {c: (lambda p, c=c: run_ring_2_22(work, c, p, nranks, proto, eltSize))
               for c in range(work["channelLo"], work["channelHi"] + 1)}
    for c, run in per.items():
        for p in range(nranks):
            rows = []
            for loop, step, chunk, offset, nelem in run(p):
                for s, (soff, ssize) in enumerate(genericOp_slices(nelem, proto, eltSize)):
                    rows.append((loop, step, chunk, s, offset + soff, ssize))
            out[c, p] = rows
    return out


# -- the plan ----------------------------------------------------------------------------------

def job(era, n=4, protocol="Simple", channels=2, nqps=1, dtype="fp32", **nccl):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:00:{i + 1:02x}"} for i in range(n)]
    return parse_job({
        "name": "t", "model": {"params": [{"name": "w", "shape": [8]}]},
        "ddp": {"grad_dtype": dtype},
        "nccl": dict(era=era, protocol=protocol, channels=channels, qps_per_connection=nqps, **nccl),
        "ring": {"ranks": ranks},
        "mirrors": [{"name": "m0", "rank": 0, "direction": "egress"}],
    })


def plan_sends(plan, bucket, channel=None, sender=None):
    """{(channel, position): [(loop, ring_step, chunk, slice, elem_offset, nelem), ...]} of one
    bucket; with ``bucket`` None, one connection's [(bucket, ...), ...] over all buckets."""
    m = plan.messages
    m = m[(m["kind"] == DATA) & (m["part"] == 0) & ((m["imm"] == 1) | (m["remote_offset"] != NO_VA))]
    if bucket is None:
        m = m[(m["channel"] == channel) & (plan.flows["src"][m["flow"]] == sender)]
        return [(int(b),) for b in m["bucket"]]
    m = m[m["bucket"] == bucket]
    src = plan.flows["src"][m["flow"]]
    out = {}
    for c, p in sorted({(int(a), int(b)) for a, b in zip(m["channel"], src)}):
        mine = m[(m["channel"] == c) & (src == p)]
        out[c, p] = [tuple(int(x) for x in r) for r in
                     zip(mine["loop"], mine["ring_step"], mine["chunk"], mine["slice"], mine["elem_offset"], mine["nelem"])]
    return out


ERAS = list(SUPPORTED_ERAS)
# Small and odd sizes (empty sends, one partial loop), a few loops, and many LL loops.
SMALL = [1, 7, 1000, 5003, 40_001]
LARGE = [300_000, 1_300_001]


def check(era, n, proto, ch, sizes, dtype="fp32"):
    plan = build_plan(job(era, n, proto, ch, dtype=dtype), sizes)
    elt = 4 if dtype == "fp32" else 2
    for b, count in enumerate(sizes):
        want = nccl_walk(era, count, elt, n, ch, proto)
        got = plan_sends(plan, b)
        assert got.keys() == want.keys(), (era, n, proto, ch, count, sorted(got), sorted(want))
        for key in want:
            assert got[key] == want[key], (era, n, proto, ch, count, key)


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("proto", [SIMPLE, LL, LL128])
def test_plan_equals_nccl_walk_small_sizes(era, proto):
    for n in range(2, 9):
        for ch in range(1, 5):
            check(era, n, proto, ch, SMALL)


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("proto", [SIMPLE, LL, LL128])
def test_plan_equals_nccl_walk_several_loops(era, proto):
    for n, ch in ((2, 1), (3, 4), (8, 2)):
        check(era, n, proto, ch, LARGE)


@pytest.mark.parametrize("era", ["2.19", "2.20", "2.22", "2.23", "2.26", "2.29"])
def test_plan_equals_nccl_walk_two_byte_elements(era):
    for proto in (SIMPLE, LL, LL128):
        check(era, 5, proto, 3, SMALL + [300_000], dtype="bf16")


def test_walks_differ_between_eras():
    """The eras really lay the same call out differently (else the tests above prove little)."""
    layouts = {era: nccl_walk(era, 100_003, 4, 4, 4, LL) for era in ("2.19", "2.20", "2.22", "2.23", "2.26", "2.29")}
    seen = {repr(sorted(v.items())) for v in layouts.values()}
    assert len(seen) == len(layouts)


# -- the other per-era facts -------------------------------------------------------------------

@pytest.mark.parametrize("era,big,split,cts", [
    ("2.19", False, True, 32), ("2.20", False, False, 64), ("2.23", False, False, 64),
    ("2.24", False, False, 64), ("2.28", False, False, 64), ("2.29", True, False, 64), ("2.30", True, False, 64)])
def test_era_facts(era, big, split, cts):
    f = N.ERAS[era]
    assert (f.imm_big_endian, f.split_data_on_qps_default, f.cts_bytes, f.cts_slot_stride) == (big, split, cts, 8 * cts)


def test_every_supported_era_has_facts():
    assert set(SUPPORTED_ERAS) == set(N.ERAS) and len(SUPPORTED_ERAS) == 12


@pytest.mark.parametrize("era", ERAS)
def test_cts_writes_have_the_eras_size_and_stride(era):
    plan = build_plan(job(era, 3, "LL", 2), [5000, 40_001])
    m = plan.messages[plan.messages["kind"] == CTS]
    size = N.ERAS[era].cts_bytes
    assert (m["wire_bytes"] == size).all()
    assert ((m["remote_offset"] % (8 * size)) == 0).all()
    assert (m["remote_offset"] // (8 * size) == m["fifo_seq"] % 256).all()


def test_split_parts_start_at_the_message_index_from_2_29():
    """ncclIbCommBaseGetQpForRequest (v2.29.2-1): part i of message k goes on QP (k + i) mod nqps;
    before, part i on QP i."""
    for era, rotates in (("2.28", False), ("2.29", True)):
        plan = build_plan(job(era, 2, "LL", 1, nqps=2, split_data_on_qps=True), [64_000])
        m = plan.messages[(plan.messages["kind"] == DATA)]
        src = plan.flows["src"][m["flow"]]
        for p in (0, 1):
            mine = m[src == p]
            expect = (mine["fifo_seq"] + mine["part"]) % 2 if rotates else mine["part"]
            assert (mine["qp"] == expect).all(), era


def test_2_30_refuses_split_over_several_qps():
    with pytest.raises(PlanError, match="split_data_on_qps"):
        build_plan(job("2.30", 2, "LL", 1, nqps=2, split_data_on_qps=True), [64_000])
    build_plan(job("2.30", 2, "LL", 1, nqps=2, split_data_on_qps=False), [64_000, 64_000])


def test_ooo_rq_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        job("2.30", ib_ooo_rq=True)
    msg = str(err.value)
    assert "nccl.ib_ooo_rq" in msg and "request ID" in msg and "NCCL_IB_OOO_RQ" in msg
    with pytest.raises(ConfigError, match="does not exist before NCCL 2.30"):
        job("2.29", ib_ooo_rq=True)


def test_era_default_for_split_data_on_qps():
    assert N.split_data_on_qps(job("2.19").nccl) and not N.split_data_on_qps(job("2.20").nccl)
    assert N.split_data_on_qps(job("2.20", split_data_on_qps=True).nccl)


def test_cts_dtype_matches_struct_offsets():
    """struct ncclIbSendFifo field offsets (x86-64 alignment) of each layout."""
    d = N.ERAS["2.20"].cts_dtype
    assert (d.fields["nreqs"][1], d.fields["tag"][1], d.fields["idx"][1]) == (20, 24, 32)
    d = N.ERAS["2.24"].cts_dtype
    assert (d.fields["rkeys"][1], d.fields["nreqs"][1], d.fields["tag"][1], d.fields["idx"][1]) == (16, 32, 36, 40)
    d = N.ERAS["2.30"].cts_dtype
    assert (d.fields["nreqs"][1], d.fields["tag"][1], d.fields["idx"][1]) == (48, 52, 56)
    assert np.dtype(N.ERAS["2.19"].cts_dtype).itemsize == N.CTS_BYTES


# -- calls of different protocols on one connection ---------------------------------------------

MIXES = [[LL, SIMPLE, LL128, LL, SIMPLE], [SIMPLE, LL], [LL128, LL, LL128], [SIMPLE, SIMPLE, LL]]
MIX_SIZES = [1000, 300_001, 40_001, 7, 5003]


def counter_walk(plan, protocols, channel, sender, start):
    """NCCL's step counter of one connection over one iteration from ``start``: each call
    begins at ROUNDUP(counter, chunkSteps) (net.cc sendProxyProgress, v2.19.3-1; 4 for Simple,
    1 for LL and LL128) and posts 2 steps per Simple slice, 1 per LL/LL128 send. Returns the
    absolute step of each of the connection's sends, in plan order, and the counter after."""
    sends = plan_sends(plan, None, channel, sender)
    counter, out = start, []
    for bucket, proto in enumerate(protocols):
        mine = [s for s in sends if s[0] == bucket]
        if not mine:
            continue
        counter = alignUp(counter, ALLREDUCE_CHUNKSTEPS if proto == SIMPLE else 1)
        for _ in mine:
            out.append(counter)
            counter += ALLREDUCE_SLICESTEPS if proto == SIMPLE else 1
    return out, counter


@pytest.mark.parametrize("era", ["2.19", "2.22", "2.29"])
@pytest.mark.parametrize("protocols", MIXES)
def test_calls_of_several_protocols_share_each_connections_counter(era, protocols):
    sizes = MIX_SIZES[:len(protocols)]
    plan = build_plan(job(era, 3, LL, 2, protocols=protocols), sizes)
    for b, (proto, count) in enumerate(zip(protocols, sizes)):
        assert plan_sends(plan, b) == nccl_walk(era, count, 4, 3, 2, proto)       # each call as its protocol walks
    m = plan.messages
    sends = (m["kind"] == DATA) & (m["part"] == 0) & ((m["imm"] == 1) | (m["remote_offset"] != NO_VA))
    mixed = len({ALLREDUCE_CHUNKSTEPS if p == SIMPLE else 1 for p in protocols}) > 1
    assert plan.step_phases == (ALLREDUCE_CHUNKSTEPS if mixed else 1)
    for c in range(2):
        for p in range(3):
            rows = np.flatnonzero(sends & (m["channel"] == c) & (plan.flows["src"][m["flow"]] == p))
            if not len(rows):
                continue
            # Any counter at the iteration's start: the plan's row for its phase, from that start.
            for start in (0, 1, 2, 3, 5, 10, 63):
                phase = start % plan.step_phases
                want, end = counter_walk(plan, protocols, c, p, start)
                assert (start + plan.phase_steps[phase, rows]).tolist() == want, (c, p, start)
                assert start + int(plan.phase_period[phase, c, p]) == end
    with pytest.raises(PlanError, match=r"nccl.protocols names 2 protocols, but the job has 5 DDP buckets"):
        build_plan(job(era, 3, LL, 2, protocols=[LL, SIMPLE]), MIX_SIZES)
