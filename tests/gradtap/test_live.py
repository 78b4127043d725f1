"""The appliance live, on real kernel networking: the end-to-end test of `gradtap run`.

A small cluster of network namespaces: one per GPU node, each with a veth into a Linux
bridge (the leaf switch, in its own namespace), and a CPU node. ``gradtap.netconfig.linux_mirror``
mirrors what ranks 0, 1 and 2 send (tc clsact + u32 + mirred, through pyroute2) to three
mirror veths into the CPU node, where the appliance captures them with ``af_xdp`` in one run
and ``af_packet`` in another. The simulator's traffic is sent from the rank namespaces as
real frames, in time order, at a bounded rate, with a pause between iterations as training
has. The appliance starts without a start state, as on a running job: the test, playing the
trainer, offers its checkpoint with the wall-clock time at which it was the trainer's state,
just before the first captured iteration is sent. The replica after every iteration must
equal the ground truth bit for bit.

Only namespaces this test creates carry traffic; everything is removed even on failure.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
import torch
from pyroute2 import netns

from gradtap.appliance import Appliance, RunOptions
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.capture.sender import FrameSender
from gradtap.capture.worker import SourceSpec
from gradtap.netconfig.linux_mirror import apply_mirrors, teardown_mirrors
from gradtap.netconfig.vendors.linux import TcMirror
from gradtap.simulator.faults import FaultSpec
from gradtap.simulator.run import Simulation
from gradtap.status import RateWindow
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.metrics import ApplianceCollector
from gradtap.workload.spec import parse_job
from tests.capture.netlab import ETHERTYPE, BridgeLab
from tests.capture.test_worker import process_cpu_s

pytestmark = [pytest.mark.privileged, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, tc and AF_XDP")]

N, MIRRORED, MTU = 4, (0, 1, 2), 9000
RATE = 20_000              # frames per second per rank: bounded, well under the veth ceiling
GAP_NS = 20_000_000        # the job's iteration gap: longer than the sender's pacing pauses (bursts of 32)
PAUSE_S = 0.1              # between iterations (the forward pass): longer than the gap
SIMULATED_PAUSE_NS = 1_000_000   # the simulator's iterations are further apart than this


def job_doc():
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:0d:{i + 1:02x}"} for i in range(N)]
    return {"name": "live", "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [64, 96, 10]}},
            "ddp": {"bucket_cap_mb": 0.01}, "optimizer": {"kind": "adamw", "weight_decay": 0.01},
            "nccl": {"protocol": "LL", "channels": 2, "mtu": 1024}, "ring": {"ranks": ranks},
            "training": {"batch_size": 4}, "appliance": {"iteration_gap_ns": GAP_NS},
            "mirrors": [{"name": f"r{r}", "rank": r, "direction": "egress"} for r in MIRRORED]}


class Cluster(BridgeLab):
    """One namespace per rank on the bridge, mirror ports m0..m2 into the CPU node (c0..c2),
    and tc mirroring of what ranks 0, 1 and 2 send to them, applied and torn down here."""

    def __init__(self, tag: str):
        super().__init__(f"gtl{os.getpid()}{tag}", [r["mac"] for r in job_doc()["ring"]["ranks"]], len(MIRRORED),
                         MTU)
        self.mirrors = [TcMirror(f"p{r}", "ingress", f"m{k}") for k, r in enumerate(MIRRORED)]

    def _build(self) -> None:
        super()._build()
        apply_mirrors(self.mirrors, netns=self.sw)

    def __exit__(self, *exc):
        try:
            if self.sw in netns.listnetns():
                teardown_mirrors(self.mirrors, netns=self.sw)
        finally:
            super().__exit__(*exc)


@pytest.mark.parametrize("source", ["af_xdp", "af_packet"])
def test_gradtap_run_keeps_a_bit_exact_replica_from_live_mirror_ports(tmp_path, source):
    job = parse_job(job_doc())
    sim = tmp_path / "sim"
    Simulation(job, sim, iterations=3, seed=3, faults=FaultSpec()).run()
    sends = {r: read_pcap(sim / "streams" / f"r{r}.pcap").bursts(SIMULATED_PAUSE_NS) for r in MIRRORED}
    rounds = max(len(v) for v in sends.values())
    start = torch.load(sim / "truth" / "start.pt", weights_only=True)
    with Cluster(source[3]) as cluster:
        streams = {f"r{r}": SourceSpec(source, (f"c{k}",), {"netns": cluster.cpu}) for k, r in enumerate(MIRRORED)}
        appliance = Appliance(job, streams, tmp_path / "run", None,
                              RunOptions(ring_slots=1 << 14, slot_size=4352, hugepages="auto", digests=True))
        result = {}
        runner = threading.Thread(target=lambda: result.update(r=appliance.run()), daemon=True)
        runner.start()
        try:
            assert appliance.ready.wait(120), "the capture workers did not start"
            # Non-job frames first, so each stream sees the port before the job's first frame.
            for r in MIRRORED:
                with FrameSender("eth0", netns=cluster.nodes[r], slots=16) as tx:
                    tx.send(FrameBatch.from_frames([b"\xff" * 6 + bytes.fromhex(job.ring.ranks[r].mac.replace(":", ""))
                                                    + ETHERTYPE.to_bytes(2, "big") + bytes(60)]))
            time.sleep(PAUSE_S)
            appliance.offer({**start, "time_ns": time.time_ns()}, "the test's trainer")
            time.sleep(PAUSE_S)
            # The live view's rates over the job's traffic, against the kernel's account of each
            # worker and the frames sent.
            window = RateWindow()
            window(appliance.status())
            before = {name: process_cpu_s(w.pid) for name, w in appliance.workers.items()}
            for k in range(rounds):
                for r in MIRRORED:
                    if k < len(sends[r]):
                        with FrameSender("eth0", netns=cluster.nodes[r], slots=256) as tx:
                            tx.send(sends[r][k], rate=RATE)
                time.sleep(PAUSE_S)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and appliance.replica.iteration < start["iteration"] + 3:
                time.sleep(0.1)
            time.sleep(0.2)
            rates = window(appliance.status())
            for name, worker in appliance.workers.items():
                kernel = (process_cpu_s(worker.pid) - before[name]) / rates.seconds
                # Each end of the window may miss up to one publication (0.2 s) of the worker's CPU.
                assert abs(rates.capture_cores[name] - kernel) <= 0.45 / rates.seconds, (name, rates, kernel)
                sent = sum(len(b) for b in sends[int(name[1:])])
                assert rates.pps[name] * rates.seconds == pytest.approx(sent), (name, rates)
            assert 0 < rates.appliance_cores <= len(os.sched_getaffinity(0)) and rates.core_s_per_mframe > 0
            # Each capture worker's CPU time as it publishes it, against the kernel's account of
            # its process read before its next publication (every 0.2 s).
            for name, worker in appliance.workers.items():
                kernel = process_cpu_s(worker.pid)
                time.sleep(0.3)
                published = worker.stats()["cpu_us"] / 1e6
                assert kernel - 0.02 <= published <= kernel + 0.35, (name, published, kernel)
        finally:
            appliance.stop()
            runner.join(timeout=60)
        assert not runner.is_alive(), "the appliance did not stop"
    assert result["r"].exit_code == 0, result["r"].reason
    status = appliance.status()
    for name, c in status.capture.items():
        assert c.get("ring_drops", 0) == 0 and c.get("kernel_drops", 0) == 0, (name, c)
    cpu = {(s.labels["process"], s.labels["stream"]): s.value for m in ApplianceCollector(appliance.status).collect()
           if m.name == "gradtap_cpu_seconds" for s in m.samples}
    assert set(cpu) == {("capture", name) for name in streams} | {("appliance", "")}, cpu
    for name, c in status.capture.items():
        assert cpu["capture", name] == c["cpu_us"] / 1e6 > 0, (name, c)
    assert cpu["appliance", ""] >= status.cpu_s > 0
    for name, events in status.events.items():
        assert events.get("data.written", 0) > 0 and "data.before_lock" not in events, (name, events)
    v = verify(tmp_path / "run", sim / "truth", job_params(job))
    truth_iterations = json.loads((sim / "truth" / "manifest.json").read_text())["iterations"]
    assert v.ok and not v.stale, v
    assert v.digests_checked == truth_iterations
    # The replica's moments against the trainer's, directly.
    replica = appliance.replica.state_dict()["optimizer"]["state"]
    with np.load(sim / "truth" / f"iter_{truth_iterations[-1]:06d}" / "state.npz") as truth:
        for i, p in enumerate(job_params(job)):
            assert replica[i]["exp_avg"].numpy().tobytes() == truth[f"exp_avg/{p.name}"].tobytes(), p.name
