"""Mirror streams over L3: the simulator's GRE/ERSPAN encapsulation (``simulator/frames.py``
:class:`ErspanTunnel`), read back by tshark and by stage 1, and the appliance end to end on
ERSPAN II and III streams, bit-exact."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scapy.contrib.erspan import ERSPAN_II, ERSPAN_III
from scapy.layers.inet import IP
from scapy.layers.l2 import GRE, Ether
from scapy.packet import Raw

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.parser.decode import decode_batch, is_roce
from gradtap.replay import run_replay
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.frames import (ERSPAN_COLLECTOR_IP, ERSPAN_COLLECTOR_MAC, ERSPAN_SWITCH_IP, ERSPAN_SWITCH_MAC,
                                      ErspanTunnel)
from gradtap.simulator.run import Simulation
from gradtap.verify import verify
from gradtap.wire import events as ev
from gradtap.workload.layout import job_params
from gradtap.workload.spec import load_job
from tests.parser.test_decode import roce_frame
from tests.parser.test_erspan import check_erspan_record, compare_with_tshark
from tests.simulator.test_simulate import make_job, simulate

ROOT = Path(__file__).resolve().parents[2]
ENCAPSULATIONS = {"m-egress": "erspan2", "m-ingress": "erspan3", "m-both": "none"}


def with_encapsulation(job, encapsulations: dict[str, str]):
    mirrors = tuple(m.model_copy(update={"encapsulation": encapsulations.get(m.name, m.encapsulation)})
                    for m in job.mirrors)
    return job.model_copy(update={"mirrors": mirrors})


def _scapy(inner: bytes, encapsulation: str, seq: int, session: int, ts_ns: int) -> bytes:
    """What the tunnel must send, encoded by scapy."""
    head = Ether(dst=ERSPAN_COLLECTOR_MAC, src=ERSPAN_SWITCH_MAC) / IP(src=ERSPAN_SWITCH_IP, dst=ERSPAN_COLLECTOR_IP,
                                                                       id=0, ttl=64)
    if encapsulation == "erspan2":
        head = head / GRE(seqnum_present=1, sequence_number=seq, proto=0x88BE) / ERSPAN_II(session_id=session)
    else:
        head = head / GRE(seqnum_present=1, sequence_number=seq, proto=0x22EB) / \
            ERSPAN_III(session_id=session, timestamp=(ts_ns // 100) % (1 << 32), p=1, gra=1)
    return bytes(head / Raw(inner))


@pytest.mark.parametrize("encapsulation", ["erspan2", "erspan3"])
def test_tunnel_bytes_equal_scapys_and_sequence_numbers_count_in_sending_order(encapsulation):
    frames = [roce_frame(), roce_frame()[:60], roce_frame() + bytes(3)]
    batch = FrameBatch.from_frames(frames)
    ts = np.array([30_000_000_123, 10_000_000_456, 20_000_000_789])
    tunnel = ErspanTunnel(encapsulation, session=77)
    tunnel.next_seq = (1 << 32) - 2                     # the 32-bit counter wraps
    order = np.argsort(ts)
    data, offsets, lengths = tunnel.encapsulate(batch.data, batch.offsets, batch.caplens, ts, order)
    got = [data[o:o + n].tobytes() for o, n in zip(offsets, lengths)]
    seqs = {int(i): s for s, i in zip([(1 << 32) - 2, (1 << 32) - 1, 0], order)}
    assert got == [_scapy(f, encapsulation, seqs[i], 77, int(ts[i])) for i, f in enumerate(frames)]
    assert tunnel.next_seq == 1


def test_tunnel_refuses_what_it_cannot_send():
    with pytest.raises(ValueError, match="not 'erspan2' or 'erspan3'"):
        ErspanTunnel("none", session=1)


@pytest.mark.tshark
@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed (bin/test installs it)")
def test_simulated_erspan_streams_agree_with_tshark_and_count_mirror_loss(tmp_path):
    job = with_encapsulation(make_job(3, "LL", 2, "fp32", ipv6=True), ENCAPSULATIONS)
    summary = simulate(tmp_path, job, iterations=1, faults="mirror_loss=0.05,link_loss=0.01,corrupt=0.01")
    icrc_bad = 0
    for index, stream in enumerate(summary.streams):
        encapsulation = ENCAPSULATIONS[stream.name]
        batch = read_pcap(stream.path)
        records, counters = decode_batch(batch, decapsulate=True)
        for i in range(len(batch)):
            check_erspan_record(records[i], batch.data, bytes(batch.frame(i)), int(batch.wirelens[i]))
        assert is_roce(records).sum() == stream.roce_frames
        assert compare_with_tshark(stream.path, records, batch.data) >= stream.roce_frames
        if encapsulation == "none":
            assert (records["erspan_type"] == 0).all() and (records["gre_seq"] == -1).all()
            continue
        assert (records["erspan_type"] == {"erspan2": 2, "erspan3": 3}[encapsulation]).all()
        assert (records["erspan_session"] == index + 1).all()
        icrc_bad += counters[ev.DECODE_ICRC_BAD]
        # The switch numbers what it sends; the frames lost after it are the gaps.
        seq = records["gre_seq"]
        assert seq[0] == 0 and (np.diff(seq) >= 1).all()
        gaps = int(seq[-1]) + 1 - len(seq)                 # frames lost after the last one received are not seen
        assert 0 < gaps <= stream.faults["mirror_loss"] and len(np.unique(seq)) == len(seq)
    assert icrc_bad > 0                                    # corrupted frames were inside the tunnels too


@pytest.mark.slow
def test_small_config_over_erspan_replays_bit_exact(tmp_path):
    job = load_job(ROOT / "configs" / "small.yaml")
    job = with_encapsulation(job, {"r0-egress": "erspan3", "r1-egress": "erspan2"})
    faults = "mirror_loss=1e-3,link_loss=1e-3,corrupt=1e-3,reorder=1e-3,duplicate=1e-3,truncate=1e-3"
    Simulation(job, tmp_path / "sim", iterations=3, seed=1,
               faults=parse_faults(faults, tuple(m.name for m in job.mirrors))).run()
    streams = {m.name: tmp_path / "sim" / "streams" / f"{m.name}.pcap" for m in job.mirrors}
    _, sink = run_replay(job, streams, tmp_path / "replay",
                         torch.load(tmp_path / "sim" / "truth" / "start.pt", weights_only=True))
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale and v.digests_checked == [1, 2, 3], v
    # The ERSPAN streams' frames really were encapsulated, and were opened.
    r0 = decode_batch(read_pcap(streams["r0-egress"]))[1]
    assert r0[ev.OTHER_NON_UDP] > r0[ev.DECODE_OK] == 0
