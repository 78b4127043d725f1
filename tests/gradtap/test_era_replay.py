"""A small job in every NCCL era and protocol, simulated and replayed bit-exactly: the
simulator and the parser follow each era's wire plan (channel split, ImmDt byte order, CTS
size); the allgather payloads equal the ground truth under the slow decoders. Buckets in
several protocols, and ``auto``, per era: ``tests/parser/test_resolve.py``."""

from __future__ import annotations

import pytest

from gradtap.replay import run_replay
from gradtap.simulator.background import P2P_BYTES
from gradtap.workload import nccl as N
from tests import naive
from gradtap.verify import verify
from gradtap.workload.layout import job_params, job_plan
from gradtap.workload.spec import SUPPORTED_ERAS
from gradtap.workload.wire_plan import DATA
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import check_allgather_matches_truth, make_job, simulate


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["Simple", "LL", "LL128"])
@pytest.mark.parametrize("era", SUPPORTED_ERAS)
def test_every_era_and_protocol_replays_bit_exactly(tmp_path, era, protocol):
    job = make_job(3, protocol, 2, "fp32", era=era)
    simulate(tmp_path / "sim", job, iterations=2)
    check_allgather_matches_truth(tmp_path / "sim", job, 2)
    _, sink = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"))
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale, v
    assert not sink.replica.stale


@pytest.mark.slow
@pytest.mark.parametrize("era", ["2.28", "2.29"])
def test_immdt_byte_order_follows_the_era(tmp_path, era):
    """Every simulated ImmDt, read in the era's byte order, is the size of a planned message."""
    job = make_job(2, "LL", 1, "fp32", era=era)
    simulate(tmp_path, job, iterations=1)
    plan = job_plan(job)
    sizes = {int(x) for x in plan.messages["msg_bytes"]}
    ring_qps = {int(q) for q in plan.flows["dst_qpn"][plan.flows["kind"] == DATA]}
    order = "big" if N.ERAS[era].imm_big_endian else "little"
    # The ring's writes only: the simulator's background p2p message is not the plan's.
    imms = [f["immdt_raw"] for f in (naive.decode_frame(fr)[0] for _, fr in
                                     naive.read_capture(tmp_path / "streams" / "m-egress.pcap"))
            if f is not None and 0x06 <= f["opcode"] <= 0x0B and "immdt_raw" in f and f["dest_qp"] in ring_qps]
    assert imms
    assert all(int.from_bytes(b, order) in sizes for b in imms)
    assert any(int.from_bytes(b, order) != int.from_bytes(b, "big" if order == "little" else "little")
               for b in imms)
    # The background p2p messages are NCCL's too: their ImmDt follows the era's order as well.
    p2p = [f["immdt_raw"] for f in (naive.decode_frame(fr)[0] for _, fr in
                                    naive.read_capture(tmp_path / "streams" / "m-egress.pcap"))
           if f is not None and f["opcode"] in (0x09, 0x0B) and f["dest_qp"] not in ring_qps]
    assert p2p and all(int.from_bytes(b, order) in P2P_BYTES for b in p2p)
