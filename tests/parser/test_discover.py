"""``gradtap discover``: the ring of a job spec learnt from captures.

Golden: the real allreduce captures of ``../shared/captures`` (2 ranks, 2 channels, LL, NCCL
2.19; the ring order, MACs and QPNs are those ``test_real_captures.py`` holds, found there by
the test-side reassembly). Simulated: a 3-rank job of a later era with point-to-point traffic
beside the ring, whose spec is the reference; the discovered spec must replay."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml

from gradtap.core.errors import GradtapError
from gradtap.parser.discover import discover
from gradtap.parser.stream import StreamParser
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import parse_job
from tests.golden import CAPTURES
from tests.gradtap.test_replay import streams_of
from tests.parser.test_real_captures import COUNT, EXPECTED, GOLDEN, MACS, RANK0, RANK1
from tests.simulator.test_simulate import make_job, simulate

PARTIAL = {"name": "flowcheck-captures", "model": {"params": [{"name": "x", "shape": [COUNT]}]},
           "ddp": {"layout": "initial"}}
LEARNT = {"allreduce_addstep.pcapng": (0x915, 0x917, 0x822, 0x825),
          "allreduce+p2p.pcapng": (0x836, 0x838, 0x71D, 0x720),
          "rdma32.pcapng": (0x38B, 0x38E, 0x2C9, 0x2CE)}


@pytest.mark.parametrize("name,ar", GOLDEN)
def test_real_capture_alone_gives_hosts_macs_protocol_and_what_it_cannot_decide(name, ar):
    found = discover([CAPTURES / name])
    nccl, ranks = found.doc["nccl"], found.doc["ring"]["ranks"]
    assert {r["ip"]: r["mac"] for r in ranks} == MACS          # the p2p host 282d is not in the ring
    assert nccl == {"era": "2.19", "protocol": "LL", "channels": 2, "qps_per_connection": 1,
                    "adaptive_routing": ar, "mtu": 1024}
    assert any("ring position 0" in u for u in found.undecided)
    assert any("channels x QPs" in u for u in found.undecided)


@pytest.mark.parametrize("name,ar", GOLDEN)
def test_real_capture_with_the_model_gives_a_job_that_recovers_every_element(name, ar):
    found = discover([CAPTURES / name], PARTIAL)
    doc = found.doc
    assert [r["ip"] for r in doc["ring"]["ranks"]] == [RANK0, RANK1]
    assert doc["nccl"]["channels"] == 2 and doc["nccl"]["qps_per_connection"] == 1
    learnt = found.learnt[0]
    assert (learnt["rank 0->1 channel 0 QP 0 data"], learnt["rank 0->1 channel 1 QP 0 data"],
            learnt["rank 1->0 channel 0 QP 0 data"], learnt["rank 1->0 channel 1 QP 0 data"]) == LEARNT[name]
    assert not found.undecided
    # the written job, as an operator would save and use it
    spec = parse_job(yaml.safe_load(yaml.safe_dump(doc)))
    parser = StreamParser(spec, job_plan(spec), spec.mirrors[0].name)
    from gradtap.capture.pcap import PcapReader
    out = []
    with PcapReader(CAPTURES / name) as reader:
        for batch in reader:
            out += parser.feed(batch)
    out += parser.flush()
    assert out[0].covered.all() and np.array_equal(out[0].grad.view(np.int32), EXPECTED)


def test_captures_without_a_ring_are_refused_with_what_they_draw():
    with pytest.raises(GradtapError, match="draw no ring .*LL: 1 edge"):
        discover([CAPTURES / "iter_40000_p2p_iter10.pcapng"])


def test_a_capture_without_nccl_traffic_is_refused(tmp_path):
    from gradtap.capture.pcap import PcapWriter
    path = tmp_path / "arp.pcap"
    with PcapWriter(path) as w:
        w.write(np.frombuffer(bytes.fromhex("ffffffffffff020000000001" "0806") + bytes(28), np.uint8), 0)
    with pytest.raises(GradtapError, match="no RDMA WRITE with immediate"):
        discover([path])
    with pytest.raises(GradtapError, match="no such capture file"):
        discover([tmp_path / "missing.pcap"])


def test_a_partial_job_without_the_model_is_refused():
    with pytest.raises(GradtapError, match="no 'model'"):
        discover([CAPTURES / "allreduce_addstep.pcapng"], {"name": "x"})


@pytest.mark.slow
def test_simulated_later_era_job_is_rediscovered(tmp_path):
    """3 ranks, LL, 2 channels, NCCL 2.29 (64-byte CTS, big-endian ImmDt), random QPNs and
    p2p traffic between the same hosts: from the job's three mirror streams and its model."""
    job = make_job(3, "LL", 2, "fp32", era="2.29")
    simulate(tmp_path / "sim", job, iterations=2)
    paths = list(streams_of(tmp_path / "sim", job).values())
    alone = discover(paths)
    assert sorted(r["ip"] for r in alone.doc["ring"]["ranks"]) == sorted(r.ip for r in job.ring.ranks)
    assert "era" not in alone.doc["nccl"]            # 2.29 or 2.30: both write 64-byte CTS, big-endian ImmDt
    assert any("2.29 to 2.30" in u for u in alone.undecided)
    partial = {k: v for k, v in job.model_dump(mode="json", exclude_none=True).items()
               if k in ("name", "model", "ddp", "optimizer", "training")}
    found = discover(paths, partial)
    assert [r["ip"] for r in found.doc["ring"]["ranks"]] == [r.ip for r in job.ring.ranks]
    assert [r["mac"] for r in found.doc["ring"]["ranks"]] == [r.mac for r in job.ring.ranks]
    nccl = found.doc["nccl"]
    # 2.29 and 2.30 send this job's traffic alike: the newest is written, and both are named
    assert (nccl["era"], nccl["protocol"], nccl["channels"], nccl["qps_per_connection"], nccl["mtu"]) == \
        ("2.30", "LL", 2, 1, 1024)
    assert [m["direction"] for m in found.doc["mirrors"]] == ["egress", "ingress", "both"]
    assert any("2.29 to 2.30 send this job's traffic alike" in u for u in found.undecided), found.undecided
    plan = job_plan(job)
    want = {(f"rank {int(f['src'])}->{int(f['dst'])} channel {int(f['channel'])} "
             + (f"QP {int(f['qp'])} data" if f["kind"] == 0 else "CTS")): int(f["dst_qpn"]) for f in plan.flows}
    for learnt in found.learnt:
        assert learnt and all(want[label] == qpn for label, qpn in learnt.items())


def test_the_command_writes_yaml_and_says_what_it_did_not_decide(tmp_path):
    partial = tmp_path / "partial.yaml"
    partial.write_text(yaml.safe_dump(PARTIAL))
    out = tmp_path / "job.yaml"
    run = subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", "discover", str(CAPTURES / "allreduce+p2p.pcapng"),
                          "--job", str(partial), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    text = out.read_text()
    assert "#   rank 0->1 channel 0 QP 0 data: 0x836" in text
    assert parse_job(yaml.safe_load(text)).ring.ranks[0].ip == RANK0
    run = subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", "discover", str(CAPTURES / "allreduce+p2p.pcapng")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ring position 0" in run.stderr and "protocol: LL" in run.stdout
    partial.write_text("[" * 100_000)          # a partial job is read as carefully as a job spec
    run = subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", "discover",
                          str(CAPTURES / "allreduce+p2p.pcapng"), "--job", str(partial)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "nested too deeply" in run.stderr and str(partial) in run.stderr


def test_hostile_frames_give_an_answer_or_a_named_refusal(tmp_path):
    """Random bytes, and a real capture with bits flipped and frames cut short: discover
    answers or refuses with a GradtapError, and never fails otherwise."""
    from gradtap.capture.pcap import PcapWriter
    from tests.frame_edits import read_frames

    rng = np.random.default_rng(5)
    frames = read_frames(CAPTURES / "allreduce+p2p.pcapng")
    for trial in range(6):
        path = tmp_path / f"hostile-{trial}.pcap"
        with PcapWriter(path) as w:
            for frame, ts in frames:
                b = bytearray(frame)
                for _ in range(int(rng.integers(0, 4))):
                    b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
                if rng.random() < 0.1:
                    b = b[:int(rng.integers(1, len(b)))]
                w.write(np.frombuffer(bytes(b), np.uint8), ts)
            for _ in range(50):
                w.write(rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8), 0)
        try:
            found = discover([path])
        except GradtapError:
            continue
        assert found.doc["ring"]["ranks"]


def test_what_the_partial_job_says_is_kept_not_tried():
    from gradtap.parser.discover import candidates, ring_of, survey

    ring = ring_of(survey([CAPTURES / "allreduce+p2p.pcapng"]))
    assert len(candidates(PARTIAL, ring)) == 2 * 2           # 2 rotations x (2 channels of 1 QP, 1 of 2)
    said = dict(PARTIAL, nccl={"channels": 2, "era": "2.19", "ar_threshold": 4096})
    docs = candidates(said, ring)
    assert len(docs) == 2 and all(d["nccl"]["channels"] == 2 and d["nccl"]["qps_per_connection"] == 1 and
                                  d["nccl"]["ar_threshold"] == 4096 for d in docs)
    ordered = dict(PARTIAL, ring={"ranks": [{"ip": RANK0, "mac": MACS[RANK0]}, {"ip": RANK1, "mac": MACS[RANK1]}]})
    assert [d["ring"] for d in candidates(ordered, ring)] == [ordered["ring"]] * 2
    found = discover([CAPTURES / "allreduce+p2p.pcapng"], said)
    assert [r["ip"] for r in found.doc["ring"]["ranks"]] == [RANK0, RANK1] and found.doc["nccl"]["ar_threshold"] == 4096


@pytest.mark.slow
def test_buckets_in_several_protocols_are_written_one_per_bucket(tmp_path):
    """NCCL's tuner put the buckets in LL, Simple and LL128: discover, given the model, writes
    ``nccl.protocols`` in launch order and the era, read from the wire."""
    from tests.gradtap.test_mixed_protocols import ITERATIONS, PROTOCOLS, mixed_job

    job = mixed_job("2.22")
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    paths = list(streams_of(tmp_path / "sim", job).values())
    alone = discover(paths)
    assert alone.doc["nccl"]["protocol"] == "auto" and alone.doc["nccl"]["channels"] == 2, alone.doc
    assert any("several protocols" in u for u in alone.undecided)
    partial = {k: v for k, v in job.model_dump(mode="json", exclude_none=True).items()
               if k in ("name", "model", "ddp", "optimizer", "training")}
    found = discover(paths, partial)
    nccl = found.doc["nccl"]
    assert nccl["protocols"] == PROTOCOLS and nccl["era"] == "2.22", nccl
    assert found.doc["ring"]["ranks"] == [{"ip": r.ip, "mac": r.mac} for r in job.ring.ranks]
