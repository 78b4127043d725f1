"""Properties of the wire plan that follow from NCCL's ring algorithm, checked independently
of how the plan computes them (the golden check against real traffic is test_plan_captures)."""

import numpy as np
import pytest

from gradtap.core.errors import PlanError
from gradtap.workload.ring_schedule import sent_chunk
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import CTS, DATA, NO_VA, PHASE_AG, PHASE_RS, build_plan, packets, send_parts


def job(n=4, protocol="Simple", channels=2, nqps=1, mtu=1024, dtype="fp32", **nccl):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:00:{i + 1:02x}"} for i in range(n)]
    return parse_job({
        "name": "t", "model": {"params": [{"name": "w", "shape": [8]}]},
        "ddp": {"grad_dtype": dtype},
        "nccl": dict(protocol=protocol, channels=channels, qps_per_connection=nqps, mtu=mtu, **nccl),
        "ring": {"ranks": ranks},
        "mirrors": [{"name": "m0", "rank": 0, "direction": "egress"}],
    })


MATRIX = [(n, proto, ch, nq, dtype)
          for n in (2, 3, 8) for proto in ("Simple", "LL", "LL128") for ch in (1, 2) for nq in (1, 2)
          for dtype in ("fp32", "bf16")]
SIZES = [1, 5000, 70_001, 1_300_000]


def data_msgs(plan):
    m = plan.messages
    return m[(m["kind"] == DATA) & (m["part"] == 0) & ((m["imm"] == 1) | (m["remote_offset"] != NO_VA))]


@pytest.mark.parametrize("n,proto,ch,nq,dtype", MATRIX)
def test_each_step_partitions_every_bucket(n, proto, ch, nq, dtype):
    plan = build_plan(job(n, proto, ch, nq, dtype=dtype), SIZES)
    sends = data_msgs(plan)
    for b, count in enumerate(SIZES):
        mine = sends[sends["bucket"] == b]
        for (loop, step) in {(int(x), int(y)) for x, y in zip(mine["loop"], mine["ring_step"])}:
            at = mine[(mine["loop"] == loop) & (mine["ring_step"] == step)]
            cover = np.zeros(count, dtype=np.int64)
            for off, k in zip(at["elem_offset"], at["nelem"]):
                cover[off:off + k] += 1
            assert cover.max() <= 1, (b, loop, step)
        for phase in (PHASE_RS, PHASE_AG):
            cover = np.zeros(count, dtype=np.int64)
            for off, k in zip(mine["elem_offset"][mine["phase"] == phase], mine["nelem"][mine["phase"] == phase]):
                cover[off:off + k] += 1
            assert (cover == n - 1).all(), (b, phase)


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("proto", ["Simple", "LL", "LL128"])
def test_egress_of_rank_p_misses_exactly_chunk_p_plus_1(n, proto):
    plan = build_plan(job(n, proto), [300_000])
    sends = data_msgs(plan)
    chunk_of = np.full(300_000, -1)
    for m in sends[sends["ring_step"] == 0]:
        chunk_of[m["elem_offset"]:m["elem_offset"] + m["nelem"]] = m["chunk"]
    for p in range(n):
        flows = plan.flows_of(p, "egress")
        ag = sends[np.isin(sends["flow"], flows) & (sends["phase"] == PHASE_AG)]
        seen = np.zeros(300_000, dtype=bool)
        for off, k in zip(ag["elem_offset"], ag["nelem"]):
            seen[off:off + k] = True
        assert set(np.unique(chunk_of[~seen])) <= {(p + 1) % n}
        assert seen[chunk_of != (p + 1) % n].all()


def test_sent_chunk_follows_run_ring():
    # runRing: step 0 sends ringIx-1, steps j=2..n-1 send ringIx-j, step n-1 ringIx, copy steps ringIx-j.
    n = 5
    for r in range(n):
        expected = [(r - 1) % n] + [(r - j) % n for j in range(2, n)] + [r] + [(r - j) % n for j in range(1, n - 1)]
        assert [sent_chunk(r, s, n) for s in range(2 * (n - 1))] == expected


@pytest.mark.parametrize("proto,mtu,nq", [("Simple", 4096, 2), ("LL", 1024, 1), ("LL128", 2048, 2)])
def test_psns_are_contiguous_per_flow_and_packets_follow_mtu(proto, mtu, nq):
    plan = build_plan(job(3, proto, 2, nq, mtu=mtu), SIZES)
    for f in range(len(plan.flows)):
        msgs = plan.flow_messages(f)
        assert (msgs["flow"] == f).all()
        assert (msgs["npkts"] == [packets(int(b), mtu) for b in msgs["wire_bytes"]]).all()
        assert (np.diff(msgs["psn_offset"]) == msgs["npkts"][:-1]).all()
        assert msgs["psn_offset"][0] == 0 and plan.flows["npkts"][f] == msgs["npkts"].sum()


def test_capture_geometry_ll_two_ranks_two_channels():
    # ../shared/captures/README.md: 5000 int32, 2 ranks, 2 channels, LL -> 7232, 16384 and empty messages.
    plan = build_plan(job(2, "LL", 2), [5000])
    sizes = sorted(int(x) for x in data_msgs(plan)["msg_bytes"])
    assert sizes == [0, 0, 7232, 7232, 16384, 16384, 16384, 16384]
    assert set(plan.messages["remote_offset"][plan.messages["kind"] == DATA] % 65536) == {0}


def test_simple_slices_and_step_rounding():
    plan = build_plan(job(2, "Simple", 1), [1_000_000, 3])
    sends = data_msgs(plan)
    f0 = sends[sends["flow"] == 0]
    assert set(f0["slice"]) == {0, 1}
    assert (f0["step"] % 2 == 0).all() and (np.diff(f0["step"]) == 2).all()
    assert plan.steps_per_iteration[0, 0] % 4 == 0


def test_qp_split_parts_are_128_aligned_and_sum_to_the_message():
    for size in (0, 1, 127, 128, 129, 65536, 1_048_575):
        for nq in (1, 2, 3, 4):
            parts = send_parts(size, nq)
            assert sum(length for _, length in parts) == size
            assert all(off % 128 == 0 for off, _ in parts)
    plan = build_plan(job(2, "Simple", 1, 2), [1_000_000])
    m = plan.messages[plan.messages["kind"] == DATA]
    assert set(m["qp"]) == {0, 1} and (m["qp"] == m["part"]).all()


def test_cts_mirror_every_data_send_in_reverse():
    plan = build_plan(job(3, "LL", 2), SIZES)
    f = plan.flows
    for c in range(2):
        for p in range(3):
            data = f[(f["kind"] == DATA) & (f["src"] == p) & (f["channel"] == c)]
            cts = f[(f["kind"] == CTS) & (f["dst"] == p) & (f["channel"] == c)]
            assert len(cts) == 1 and cts["src"][0] == (p + 1) % 3
            assert cts["dst_qpn"][0] == data["src_qpn"][0] and cts["udp_sport"][0] == data["udp_sport"][0]
            assert cts["msg_count"][0] == plan.fifo_per_iteration[c, p]


def test_cts_address_wraps_after_256_fifo_slots():
    """NCCL 2.19 ``ncclIbPostFifo`` (src/transport/net_ib.cc): the CTS of receive ``fifoTail``
    goes to slot ``fifoTail % MAX_REQUESTS``, MAX_REQUESTS = NCCL_NET_MAX_REQUESTS (32,
    src/include/nccl_net.h) * NCCL_NET_IB_MAX_RECVS (8); a slot holds 8 entries of 32 bytes."""
    plan = build_plan(job(2, "LL", 1), [1_300_000] * 2)
    cts = plan.messages[plan.messages["kind"] == CTS]
    assert cts["fifo_seq"].max() >= 256
    assert (cts["remote_offset"] == (cts["fifo_seq"] % 256) * 256).all()
    assert set(cts["remote_offset"][cts["fifo_seq"] == 64]) == {64 * 256}


def test_adaptive_routing_adds_an_immediate_write_with_no_address():
    plan = build_plan(job(2, "LL", 1, adaptive_routing=True), [100_000])
    m = plan.flow_messages(0)
    big = m[(m["imm"] == 0)]
    assert len(big) and (big["msg_bytes"] > 8192).all()
    follow = m[np.flatnonzero(m["imm"] == 0) + 1]
    assert (follow["imm"] == 1).all() and (follow["wire_bytes"] == 0).all() and (follow["remote_offset"] == NO_VA).all()


def test_unsplit_multi_qp_plan_must_be_periodic():
    with pytest.raises(PlanError, match="split_data_on_qps"):
        build_plan(job(3, "LL", 1, 3, split_data_on_qps=False), [5000])


@pytest.mark.parametrize("n,proto,ch,nq,dtype", [m for m in MATRIX if m[0] != 8] + [(8, "LL128", 2, 2, "bf16")])
@pytest.mark.parametrize("mtu", [1024, 4096])
def test_coverage_blocks_tile_the_gradient_once(n, proto, ch, nq, dtype, mtu):
    plan = build_plan(job(n, proto, ch, nq, mtu=mtu, dtype=dtype), SIZES)
    b = plan.blocks
    cover = np.zeros(sum(SIZES), np.int64)
    for e, k in zip(b["elem"], b["nelem"]):
        cover[e:e + k] += 1
    assert (cover == 1).all()
    assert (b["need"] >= 1).all()
    m = plan.messages
    ag = (m["kind"] == DATA) & (m["phase"] == PHASE_AG) & (m["wire_bytes"] > 0)
    assert (m["block"][ag] >= 0).all() and (m["block"][~ag] == -1).all()
    # No write reaches outside its bucket (what a stream kept aside is laid over a bucket by the
    # writes inside it: parser/aside.py, AsideCopies._inside).
    data = m[(m["kind"] == DATA) & (m["nelem"] > 0)]     # an empty send (past a small bucket's end) writes nothing
    assert (data["elem_offset"] >= 0).all()
    assert (data["elem_offset"] + data["nelem"] <= np.asarray(plan.bucket_numels)[data["bucket"]]).all()
    # Each allgather write's first block starts at the element where its data starts.
    per_wire = {"Simple": 1, "LL": 2, "LL128": None}[proto]
    elem = 4 if dtype == "fp32" else 2
    for w in m[ag]:
        blk = b[w["block"]]
        start = plan.bucket_offsets[w["bucket"]] + w["elem_offset"]
        if per_wire:
            assert blk["elem"] == start + w["part_offset"] // per_wire // elem
        else:
            assert blk["elem"] == start
    if proto == "LL128":
        # need = packets of the whole message (all parts) overlapping the slice's wire bytes
        assert b["need"].sum() >= (m["npkts"][ag & (m["ring_step"] == n - 1)]).sum()
