"""The parser on real NCCL traffic with a job spec that gives no QPNs (golden).

The three allreduce captures of ``../shared/captures`` (see its README) hold NCCL 2.19 ring
allreduces of 5000 int32 elements between 2 ranks over 2 channels with LL; the allgather
carries ``2 * (i mod 10)``. The job spec below is what an operator writes from the README:
addresses, MACs, protocol, channels, no QPNs. The parser must learn every flow itself (the
real QPNs follow no rule), recover every element, count every frame under one event, count
the point-to-point writes between the same hosts as other traffic, and refuse loudly where
the spec does not describe the traffic.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradtap.capture.pcap import PcapReader, PcapWriter
from gradtap.parser.stream import StreamParser
from gradtap.wire import events as ev
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import build_plan
from tests import naive
from tests.golden import CAPTURES

COUNT = 5000
RANK0, RANK1 = "fe80::e42:a1ff:fe9f:58f8", "fe80::ac0:ebff:fe8c:282c"     # ring order (README; assign())
MACS = {RANK0: "0c:42:a1:9f:58:f8", RANK1: "08:c0:eb:8c:28:2c"}
GOLDEN = [("allreduce_addstep.pcapng", False), ("allreduce+p2p.pcapng", False), ("rdma32.pcapng", True)]
EXPECTED = 2 * (np.arange(COUNT, dtype=np.int32) % 10)


def job(order=(RANK0, RANK1), direction="both", adaptive_routing=False, **ranks_extra):
    return parse_job({
        "name": "flowcheck-captures",
        "model": {"params": [{"name": "x", "shape": [COUNT]}]},
        "ddp": {"grad_dtype": "fp32"},
        "nccl": {"protocol": "LL", "channels": 2, "mtu": 1024, "adaptive_routing": adaptive_routing},
        "ring": {"ranks": [{"ip": ip, "mac": MACS.get(ip, f"02:00:00:00:00:{ip[-1]}0"), **ranks_extra} for ip in order]},
        "mirrors": [{"name": "port", "rank": 0, "direction": direction}],
    })


def parse(spec, path):
    parser = StreamParser(spec, build_plan(spec, [COUNT]), "port")
    frames, out = 0, []
    with PcapReader(path) as reader:
        for batch in reader:
            frames += len(batch.offsets)
            out += parser.feed(batch)
    out += parser.flush()
    assert int(parser.counters.sum()) == frames, "every frame ends in exactly one event counter"
    return parser, out


def one_direction(tmp_path, name, src):
    """The capture's frames sent by ``src`` (and the non-IPv6 noise), as a port mirrored one way."""
    path = tmp_path / f"{src[-4:]}-{name}.pcap"
    with PcapWriter(path) as w:
        for ts, frame in naive.read_capture(CAPTURES / name):
            f, _ = naive.decode_frame(frame)
            if f is None or f["ip_src"] == src:
                w.write(np.frombuffer(frame, np.uint8), ts)
    return path


@pytest.mark.parametrize("name,ar", GOLDEN)
def test_learns_every_flow_and_recovers_every_element(name, ar):
    parser, out = parse(job(adaptive_routing=ar), CAPTURES / name)
    assert parser.locked, parser.failure
    first = out[0]
    assert first.covered.all()
    assert np.array_equal(first.grad.view(np.int32), EXPECTED)
    learnt = {parser.tables.label(f): int(q) for f, q in enumerate(parser.tables.qpn)}
    # What the test-side reassembly (tests/workload/test_plan_captures.py assign()) finds.
    data = {"allreduce_addstep.pcapng": (0x915, 0x917, 0x822, 0x825),
            "allreduce+p2p.pcapng": (0x836, 0x838, 0x71D, 0x720),
            "rdma32.pcapng": (0x38B, 0x38E, 0x2C9, 0x2CE)}[name]
    assert (learnt["rank 0->1 channel 0 QP 0 data"], learnt["rank 0->1 channel 1 QP 0 data"],
            learnt["rank 1->0 channel 0 QP 0 data"], learnt["rank 1->0 channel 1 QP 0 data"]) == data
    counters = ev.as_dict(parser.counters)
    assert counters["other.cts"] > 0 and counters["data.written"] > 0
    if name == "allreduce+p2p.pcapng":
        # The pipeline p2p writes and their CTS between the same hosts (QPNs 0x83e, 0x735).
        assert counters["other.unknown_flow"] == 22


@pytest.mark.parametrize("name,ar", GOLDEN)
def test_each_direction_alone(tmp_path, name, ar):
    union = None
    for src, direction in ((RANK0, "egress"), (RANK1, "ingress")):
        parser, out = parse(job(direction=direction, adaptive_routing=ar), one_direction(tmp_path, name, src))
        assert parser.locked, parser.failure
        got = out[0]
        assert got.covered.any()
        values = got.grad.view(np.int32)
        per_block = parser.plan.blocks
        for b in np.flatnonzero(got.covered):
            lo, n = int(per_block["elem"][b]), int(per_block["nelem"][b])
            assert np.array_equal(values[lo:lo + n], EXPECTED[lo:lo + n])
        union = got.covered if union is None else union | got.covered
    # Rank 0's egress carries chunk 0 of the allgather, its ingress chunk 1 (docs/wire-format.md).
    assert union.all()


def test_qpn_hints_are_checked_not_required(caplog):
    """A wrong hint loses to the wire, and says so."""
    spec = job(qpn_base=0x100)
    parser, out = parse(spec, CAPTURES / "allreduce_addstep.pcapng")
    assert parser.locked and np.array_equal(out[0].grad.view(np.int32), EXPECTED)
    assert "QPN hint does not match the wire" in caplog.text


def test_wrong_ring_order_is_refused():
    """Swapped ranks fit every write size modulo the period; the iteration boundary shows it."""
    parser, out = parse(job(order=(RANK1, RANK0)), CAPTURES / "allreduce+p2p.pcapng")
    assert not parser.locked and not any(a.covered.any() for a in out)
    assert "ring order" in parser.failure.reason
    assert ev.as_dict(parser.counters).get("data.written", 0) == 0


def test_no_job_traffic_is_loud():
    parser, out = parse(job(order=("fe80::1", "fe80::2")), CAPTURES / "allreduce+p2p.pcapng")
    assert not parser.locked and out == []
    assert "no RDMA WRITE between the job's ranks" in parser.failure.reason
    assert "never locked on (837 frames)" == parser.failure.what


def test_p2p_only_capture_never_locks():
    """A capture of point-to-point messages between the two hosts: their sizes fit no planned flow."""
    name = "iter_40000_p2p_iter10.pcapng"
    hosts = sorted({ip for _, frame in naive.read_capture(CAPTURES / name)
                    for f in [naive.decode_frame(frame)[0]] if f is not None for ip in (f["ip_src"], f["ip_dst"])})
    assert len(hosts) == 2
    parser, _ = parse(job(order=tuple(hosts)), CAPTURES / name)
    assert not parser.locked
    assert "fits no planned flow" in parser.failure.detail
    assert ev.as_dict(parser.counters).get("data.written", 0) == 0
