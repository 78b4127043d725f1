"""Planned flows that write the same sizes (channels of one connection) are told apart by QPN
order, and that order is cross-checked against the other NIC's: the sender's QPNs, seen as the
destinations of the CTS writes coming back on each connection. Where the two disagree the
stream refuses to assign channels rather than misplace their data."""

from __future__ import annotations


import pytest

from gradtap.capture.pcap import PcapReader
from gradtap.parser.stream import StreamParser
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import parse_job
from tests.frame_edits import bth_offset, read_frames, resign, write_frames
from tests.gradtap.test_replay import streams_of
from tests.simulator.test_simulate import simulate

CTS_2_19 = 32


def ties_job():
    """One LL bucket of 30720 elements over 3 ranks and 2 channels: both channels of every
    connection write four 40960-byte messages, so only QPNs tell them apart."""
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:01:{i + 1:02x}"} for i in range(3)]
    return parse_job({
        "name": "ties", "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [119, 256]}},
        "ddp": {"bucket_cap_mb": 25}, "optimizer": {"kind": "adam"}, "nccl": {"protocol": "LL", "channels": 2},
        "ring": {"ranks": ranks}, "training": {"batch_size": 4},
        "mirrors": [{"name": "m-both", "rank": 2, "direction": "both"}]})


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ties")
    job = ties_job()
    simulate(tmp / "sim", job, iterations=2)
    return job, streams_of(tmp / "sim", job)["m-both"], tmp


def parse(job, path):
    parser = StreamParser(job, job_plan(job), "m-both")
    with PcapReader(path) as reader:
        for batch in reader:
            parser.feed(batch)
    parser.flush()
    return parser


def test_ties_are_broken_by_qpn_order_when_both_nics_agree(capture):
    job, path, _ = capture
    parser = parse(job, path)
    assert parser.locked and parser.lockon.learner.conflict is None
    assert "rank 1->2 channel 0 QP 0 data, rank 1->2 channel 1 QP 0 data" in parser.lockon.learner.learnt.by_order
    plan = job_plan(job)
    learnt = {parser.tables.label(f): int(q) for f, q in enumerate(parser.tables.qpn)}
    for f in plan.flows_of(2, "both"):
        row = plan.flows[f]
        what = f"QP {int(row['qp'])} data" if row["kind"] == 0 else "CTS"
        assert learnt[f"rank {int(row['src'])}->{int(row['dst'])} channel {int(row['channel'])} {what}"] == \
            int(row["dst_qpn"])


def test_nics_that_number_the_channels_in_different_orders_are_refused(capture):
    """The CTS writes of connection 1->2 (sent by rank 2 to rank 1's QPs) with their two
    destination QPNs swapped: rank 1's NIC then looks as if it numbered channel 1 first."""
    job, path, tmp = capture
    frames = read_frames(path)
    cts = {}
    for i, (frame, _) in enumerate(frames):
        bth = bth_offset(frame)
        if bth is not None and frame[26:30] == bytes([198, 18, 2, 1]) and frame[30:34] == bytes([198, 18, 1, 1]) \
                and frame[bth] == 0x0A and len(frame) - bth - 12 - 16 - 4 == CTS_2_19:
            cts.setdefault(int.from_bytes(frame[bth + 5:bth + 8], "big"), []).append(i)
    assert len(cts) == 2
    a, b = sorted(cts)
    for qpn, other in ((a, b), (b, a)):
        for i in cts[qpn]:
            frame = bytearray(frames[i][0])
            bth = bth_offset(frame)
            frame[bth + 5:bth + 8] = other.to_bytes(3, "big")
            frames[i] = (resign(frame), frames[i][1])
    edited = tmp / "swapped.pcap"
    write_frames(edited, frames)
    parser = parse(job, edited)
    assert not parser.locked
    assert "number their connections in different orders" in parser.failure.reason
    assert f"{a:#x}" in parser.failure.reason or f"{b:#x}" in parser.failure.reason
    assert "qpn_base" in parser.failure.reason


def test_hints_leave_no_tie_to_break(capture):
    """With every rank's qpn_base hint the simulator numbers QPs by the hint rule, and the
    learner takes the hints: no order is relied on, so there is nothing to cross-check."""
    job, path, tmp = capture
    hinted = job.model_copy(update={"ring": job.ring.model_copy(update={"ranks": tuple(
        r.model_copy(update={"qpn_base": 0x100 * (i + 1)}) for i, r in enumerate(job.ring.ranks))})})
    simulate(tmp / "hinted", hinted, iterations=2)
    parser = parse(hinted, streams_of(tmp / "hinted", hinted)["m-both"])
    assert parser.locked and not parser.lockon.learner.learnt.by_order
