"""tshark, an independent decoder, reads every simulated RoCEv2 frame as we meant it.

For each frame the simulator encodes, tshark must report the opcode, destination QP, PSN,
RETH virtual address and DMA length, ImmDt and AETH that the packet descriptor asked for,
and no malformed-packet expert info.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapWriter
from gradtap.wire.headers import opcodes as op
from gradtap.simulator.background import Background
from gradtap.simulator.frames import Routes, encode_frames
from gradtap.simulator.run import EPOCH_NS
from gradtap.simulator.traffic import ConnectionState, LinkFaults, Timing, TrafficBuilder
from tests.simulator.test_simulate import make_job
from gradtap.workload.layout import job_plan

pytestmark = [pytest.mark.tshark, pytest.mark.skipif(shutil.which("tshark") is None,
                                                     reason="tshark is not installed (bin/test installs it)")]

FIELDS = ["frame.number", "infiniband.bth.opcode", "infiniband.bth.destqp", "infiniband.bth.psn",
          "infiniband.reth.va", "infiniband.reth.dmalen", "infiniband.immdt", "infiniband.aeth.msn",
          "_ws.malformed", "udp.srcport"]


def tshark_rows(path):
    cmd = ["tshark", "-r", str(path), "-T", "fields", "-E", "separator=|", "-E", "occurrence=f"]
    for f in FIELDS:
        cmd += ["-e", f]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    return [line.split("|") for line in out.splitlines()]


def one_iteration(job, link_faults=LinkFaults()):
    plan = job_plan(job)
    rng = np.random.default_rng(3)
    routes = Routes(job.ipv6)
    n = job.world_size
    builder = TrafficBuilder(job, plan, routes, Timing(), link_faults, rng, set(range(n)), set(range(n)))
    dtype = {"fp32": np.float32, "bf16": np.uint16, "fp16": np.float16}[job.ddp.grad_dtype]
    partials = [rng.integers(0, 1 << 15, size=(n, count)).astype(dtype) for count in plan.bucket_numels]
    state = ConnectionState.initial(plan, rng)
    traffics = []
    t = EPOCH_NS
    for b in range(len(partials)):
        traffics.append(builder.build(b, partials[b], state, t))
        t = traffics[-1].end_ns + 1000
    arena_parts = [tr.arena for tr in traffics]
    bases = np.cumsum([0] + [len(a) for a in arena_parts])
    for tr, base in zip(traffics, bases):
        tr.packets["payload_off"] += base
    traffic_packets = np.concatenate([tr.packets for tr in traffics])
    traffic_arena = np.concatenate(arena_parts)
    background = Background(job, routes, {0}, rng)
    bg, _, _ = background.packets(EPOCH_NS, job.nccl.mtu, len(traffic_arena))
    packets = np.concatenate([traffic_packets, bg])
    packets = packets[np.argsort(packets["ts_ns"], kind="stable")]
    data, offsets, lengths = encode_frames(packets, routes, np.concatenate([traffic_arena, background.arena]))
    return packets, FrameBatch(data=data, offsets=offsets, caplens=lengths, wirelens=lengths,
                               ts_ns=packets["ts_ns"], linktype=1)


@pytest.mark.slow
@pytest.mark.parametrize("protocol,ipv6,nqps,ar", [
    ("Simple", False, 1, False), ("LL", True, 1, True), ("LL128", False, 2, False), ("Simple", True, 2, True)])
def test_tshark_decodes_every_field_as_intended(tmp_path, protocol, ipv6, nqps, ar):
    job = make_job(3, protocol, 2, "fp32", ipv6=ipv6, nqps=nqps, mtu=1024, adaptive_routing=ar)
    packets, batch = one_iteration(job, LinkFaults(loss=0.01, corrupt=0.01))
    path = tmp_path / "sim.pcap"
    with PcapWriter(path) as w:
        w.write_batch(batch)
    rows = tshark_rows(path)
    assert len(rows) == len(packets)
    for p, row in zip(packets, rows):
        _, opcode, qp, psn, va, dmalen, imm, msn, malformed, _ = row
        assert not malformed, row
        assert int(opcode) == p["opcode"] and int(qp, 16) == p["dest_qpn"] and int(psn) == p["psn"], row
        if op.OPCODE_RETH_OFF[p["opcode"]] >= 0:
            assert int(va, 16) == p["reth_va"] and int(dmalen) == p["reth_len"], row
        else:
            assert va == "" and dmalen == ""
        if op.OPCODE_IMMDT_OFF[p["opcode"]] >= 0:
            assert bytes.fromhex(imm) == int(p["imm"]).to_bytes(4, "big"), row
        if op.OPCODE_AETH_OFF[p["opcode"]] >= 0:
            assert int(msn) == p["aeth"] & 0xFFFFFF, row
    seen = {int(r[1]) for r in rows}
    assert {op.RC_RDMA_WRITE_ONLY, op.RC_ACKNOWLEDGE, op.UD_SEND_ONLY} <= seen
    assert seen & {op.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, op.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE}


@pytest.mark.slow
def test_whole_streams_have_no_malformed_frames(tmp_path):
    from tests.simulator.test_simulate import simulate

    job = make_job(3, "LL", 2, "bf16", ipv6=True)
    summary = simulate(tmp_path, job, faults="mirror_loss=0.01,reorder=0.01,duplicate=0.01,link_loss=0.01,corrupt=0.01")
    for s in summary.streams:
        out = subprocess.run(["tshark", "-r", str(s.path), "-Y", "_ws.malformed", "-T", "fields", "-e", "frame.number"],
                             capture_output=True, text=True, check=True, timeout=120).stdout
        assert out == "", f"{s.name}: malformed frames {out.split()[:10]}"
        proto = subprocess.run(["tshark", "-r", str(s.path), "-q", "-z", "io,phs"], capture_output=True, text=True,
                               check=True, timeout=120).stdout
        assert "infiniband" in proto
        if job.mirror(s.name).direction != "ingress":
            assert "tcp" in proto and "arp" in proto
