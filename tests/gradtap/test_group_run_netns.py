"""``gradtap run`` as a mirror group across network namespaces: one namespace per CPU node.

Each node captures its mirror stream live (``af_packet`` on ``mir``, one end of a veth pair
whose other end, in a sender namespace, replays the simulator's frames of that stream in
time order, at a bounded rate, with a pause between iterations). The nodes meet and merge
over gloo on their own network: a veth ``grp`` per node into a Linux bridge in a namespace
of its own, named by the job spec's ``appliance.mirror_group.interface``; those are the
nodes' only addresses, so every byte of the group's traffic crosses the bridge. At the end
the nodes' joined group snapshot must equal the trainer's state (the simulator's truth)
bit for bit, up to the last iteration sent: a node whose one stream completes no bucket alone
joins its rounds once its stream has been quiet for the iteration gap, with no next iteration
to wait for.

Only namespaces this test creates carry traffic; everything is removed even on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from pyroute2 import NetNS, netns

from gradtap.capture.pcap import read_pcap
from gradtap.capture.sender import FrameSender
from gradtap.simulator.faults import FaultSpec
from gradtap.simulator.run import Simulation
from gradtap.store.shard_snapshot import assemble
from gradtap.updater.replica import Replica
from gradtap.workload.layout import job_params
from gradtap.workload.spec import dump_job, parse_job
from tests.capture.netlab import in_netns, quiet_netns, remove_stale
from tests.gradtap.test_live import MIRRORED, PAUSE_S, RATE, SIMULATED_PAUSE_NS, job_doc

pytestmark = [pytest.mark.privileged, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and AF_PACKET")]

ROOT = Path(__file__).resolve().parents[2]
WORLD = len(MIRRORED)
MTU = 9000
PORT = 29500                # free: each node's namespace is new
CONTROL_PORT = 9465
ITERATIONS = 4              # iterations sent, every one checked
START_S, END_S = 300.0, 120.0   # the nodes up (three interpreters importing torch on a shared VM); the run


def group_job():
    """test_live's job, deeper, in three buckets (one per node) and clipped: the nodes all-gather norms."""
    doc = job_doc()
    doc["name"] = "live-group"
    doc["model"]["kwargs"]["sizes"] = [64, 96, 64, 10]
    doc["ddp"]["bucket_cap_mb"] = 0.002
    doc["optimizer"] = {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.01, "clip_grad_norm": 0.05}
    return doc


class GroupLab:
    """``<prefix>-tx`` holds t0..t{W-1}; node k (``<prefix>-n{k}``) holds ``mir`` (t{k}'s peer:
    its mirror port) and ``grp`` (10.77.0.{k+1}/24, a port g{k} of bridge br0 in ``<prefix>-br``).
    IPv6 is off everywhere. Every namespace is removed on exit, even after a failure."""

    def __init__(self, prefix: str, world: int):
        self.tx, self.br = f"{prefix}-tx", f"{prefix}-br"
        self.nodes = [f"{prefix}-n{k}" for k in range(world)]

    def address(self, k: int) -> str:
        return f"10.77.0.{k + 1}"

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self) -> None:
        for name in (self.tx, self.br, *self.nodes):
            quiet_netns(name)
        with NetNS(self.br) as br:
            br.link("add", ifname="br0", kind="bridge")
            bridge = br.link_lookup(ifname="br0")[0]
            for k, node in enumerate(self.nodes):
                br.link("add", ifname=f"g{k}", kind="veth", peer={"ifname": "grp", "net_ns_fd": node})
                br.link("set", index=br.link_lookup(ifname=f"g{k}")[0], master=bridge, state="up")
            br.link("set", index=bridge, state="up")
        with NetNS(self.tx) as tx:
            for k, node in enumerate(self.nodes):
                tx.link("add", ifname=f"t{k}", kind="veth", peer={"ifname": "mir", "net_ns_fd": node})
                tx.link("set", index=tx.link_lookup(ifname=f"t{k}")[0], mtu=MTU, state="up")
        for k, node in enumerate(self.nodes):
            with NetNS(node) as ns:
                ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
                ns.link("set", index=ns.link_lookup(ifname="mir")[0], mtu=MTU, state="up")
                grp = ns.link_lookup(ifname="grp")[0]
                ns.addr("add", index=grp, address=self.address(k), prefixlen=24)
                ns.link("set", index=grp, state="up")

    def bridged_bytes(self) -> int:
        """Bytes the bridge's ports took in from the nodes."""
        with NetNS(self.br) as br:
            return sum(br.get_links(br.link_lookup(ifname=f"g{k}")[0])[0].get_attr("IFLA_STATS64")["rx_bytes"]
                       for k in range(len(self.nodes)))

    def __exit__(self, *exc):
        for name in (self.tx, self.br, *self.nodes):
            if name in netns.listnetns():
                netns.remove(name)


def status(lab: GroupLab, k: int, out: Path) -> dict | None:
    """Node k's GET /status, from inside its namespace (None while it does not answer)."""
    token = out / "control.token"
    if not token.exists():
        return None
    request = urllib.request.Request(f"http://127.0.0.1:{CONTROL_PORT}/status",
                                     headers={"Authorization": f"Bearer {token.read_text().strip()}"})
    with in_netns(lab.nodes[k]):
        try:
            return json.loads(urllib.request.urlopen(request, timeout=5).read())
        except OSError:
            return None


def test_a_mirror_group_across_namespaces_keeps_a_bit_exact_replica(tmp_path):
    remove_stale()
    job = parse_job(group_job())
    sim = tmp_path / "sim"
    # No node's one egress stream completes a bucket alone, and no iteration follows the last:
    # the nodes merge it once their streams have settled (the pause), not at a deadline.
    Simulation(job, sim, iterations=ITERATIONS, seed=3, faults=FaultSpec()).run()
    sends = {r: read_pcap(sim / "streams" / f"r{r}.pcap").bursts(SIMULATED_PAUSE_NS) for r in MIRRORED}
    truth_iterations = json.loads((sim / "truth" / "manifest.json").read_text())["iterations"]
    # Declared: the trainer's state when the capture begins (a live clock is not the simulation's).
    start = torch.load(sim / "truth" / "start.pt", weights_only=True)
    start.pop("time_ns", None)
    torch.save(start, tmp_path / "start.pt")
    last = truth_iterations[ITERATIONS - 1]
    done_at = last + 1
    with GroupLab(f"gtc{os.getpid()}g", WORLD) as lab:
        procs = []
        try:
            for k, r in enumerate(MIRRORED):
                doc = group_job()
                # As `gradtap netconfig plan` writes it for each node: every node's streams by rank.
                doc["appliance"]["mirror_group"] = {"rank": k, "world_size": WORLD, "interface": "grp",
                                                    "rendezvous": f"tcp://{lab.address(0)}:{PORT}",
                                                    "timeout_s": START_S, "streams": [[f"r{r}"] for r in MIRRORED]}
                (tmp_path / f"job{k}.yaml").write_text(dump_job(parse_job(doc)))
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", lab.nodes[k], sys.executable, "-c", "from gradtap.cli import main; main()",
                     "run", str(tmp_path / f"job{k}.yaml"), "--stream", f"r{r}=mir", "--source", "af_packet",
                     "--out", str(tmp_path / f"node{k}"), "--start", str(tmp_path / "start.pt"),
                     "--metrics-port", "0", "--control-port", str(CONTROL_PORT), "--no-status",
                     "--hugepages", "off", "--ring-slots", "16384", "--slot-size", "4352"],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                    env={**os.environ, "COLUMNS": "200"}))
            # Every node listening on its mirror port, and the group joined.
            deadline, ready = time.monotonic() + START_S, {}
            while len(ready) < WORLD and time.monotonic() < deadline:
                for k, p in enumerate(procs):
                    assert p.poll() is None, f"node {k} ended early: {p.communicate()[1]}"
                    s = ready.get(k) or status(lab, k, tmp_path / f"node{k}")
                    if s is not None and s["listening"]:
                        ready[k] = s
                time.sleep(0.5)
            assert len(ready) == WORLD, f"nodes {sorted(set(range(WORLD)) - set(ready))} did not start"
            for k, s in ready.items():
                g = s["group"]
                assert (g["rank"], g["world_size"]) == (k, WORLD) and set(g["peers"].values()) == {"up"}, g
            bridged = lab.bridged_bytes()
            for k in range(max(len(v) for v in sends.values())):
                for node, r in enumerate(MIRRORED):
                    if k < len(sends[r]):
                        with FrameSender(f"t{node}", netns=lab.tx, slots=256) as tx:
                            tx.send(sends[r][k], rate=RATE)
                time.sleep(PAUSE_S)
            manifests = [tmp_path / f"node{k}" / "snapshots" / f"iteration-{done_at:06d}" / "group.json"
                         for k in range(WORLD)]
            deadline = time.monotonic() + END_S
            while time.monotonic() < deadline and not all(m.exists() for m in manifests):
                assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
                time.sleep(0.2)
            finals = [status(lab, k, tmp_path / f"node{k}") for k in range(WORLD)]
            bridged = lab.bridged_bytes() - bridged
            assert all(m.exists() for m in manifests), [{key: f[key] for key in ("capture", "events", "locked",
                                                                                  "replica_iteration", "group")}
                                                        for f in finals]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            errors = [p.communicate(timeout=60)[1] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
    for k, (p, err) in enumerate(zip(procs, errors)):
        assert p.returncode == 0 and "gradtap run: stopped" in err, (k, err)
        lines = [json.loads(x) for x in (tmp_path / f"node{k}" / "iterations.jsonl").read_text().splitlines()]
        assert [x["recovered"] for x in lines] == [True] * ITERATIONS, (k, lines)
        g = finals[k]["group"]
        assert set(g["peers"].values()) == {"up"} and g["sent_bytes"] > 0, g
        for name, c in finals[k]["capture"].items():
            assert c.get("ring_drops", 0) == 0 and c.get("kernel_drops", 0) == 0, (k, name, c)
    # The group's messages crossed the bridge: at least their payload, which the nodes counted.
    assert bridged >= sum(f["group"]["sent_bytes"] for f in finals)
    folders = [tmp_path / f"node{k}" / "snapshots" / f"iteration-{done_at:06d}" for k in range(WORLD)]
    joined = assemble(Replica(job, start), folders)
    assert joined["iteration"] == done_at
    with np.load(sim / "truth" / f"iter_{last:06d}" / "state.npz") as truth:
        for i, p in enumerate(job_params(job)):
            assert joined["model"][p.name].numpy().tobytes() == truth[f"param/{p.name}"].tobytes(), p.name
            for name in ("exp_avg", "exp_avg_sq"):
                assert joined["optimizer"]["state"][i][name].numpy().tobytes() == truth[f"{name}/{p.name}"].tobytes(), \
                    (p.name, name)
