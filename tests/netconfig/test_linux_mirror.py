"""Linux mirroring applied through netlink, checked with real frames in network namespaces.

The lab: a "switch" namespace holding a bridge whose ports p0..p3 are veth pairs into one
namespace per GPU node, plus mirror ports m0..m2 (not bridged) into a CPU-node namespace.
A plan for it is applied with pyroute2; every node then sends a few raw frames (a local
experimental EtherType) to every other node, and each CPU-side interface must receive
exactly the frames of the planned ports and directions -- no more, no fewer, no repeats.
"""

from __future__ import annotations

import errno
import gzip
import os
import select
import socket
import time
from collections import Counter

import pytest
from pyroute2 import NetNS, netns, protocols

from gradtap.core.errors import NetlinkError
from gradtap.netconfig.linux_mirror import PARENT, _Link, apply_mirrors, plan_mirrors, teardown_mirrors
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.topology import parse_topology
from gradtap.netconfig.vendors.linux import TcMirror
from tests.capture.netlab import in_netns

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(20),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")]

N_NODES, N_MIRRORS, FRAMES_PER_PAIR = 4, 3, 3
ETHERTYPE = 0x88B5  # IEEE 802 local experimental
PREFIX = f"gtnc{os.getpid()}"


def mac(i: int) -> bytes:
    return bytes([2, 0, 0, 0, 0, i + 1])


def packet_socket(ns: str, ifname: str, ethertype: int) -> socket.socket:
    with in_netns(ns):  # a socket keeps the namespace it was created in
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ethertype))
        sock.bind((ifname, ethertype))
    return sock


class Lab:
    def __init__(self):
        self.sw, self.cpu = f"{PREFIX}-sw", f"{PREFIX}-cpu"
        self.nodes = [f"{PREFIX}-n{i}" for i in range(N_NODES)]
        self.names = [self.sw, self.cpu, *self.nodes]

    def build(self) -> None:
        for name in self.names:
            netns.create(name)
        with NetNS(self.sw) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            bridge = sw.link_lookup(ifname="br0")[0]
            for i, node in enumerate(self.nodes):
                sw.link("add", ifname=f"p{i}", kind="veth", peer={"ifname": "eth0", "net_ns_fd": node})
                sw.link("set", index=sw.link_lookup(ifname=f"p{i}")[0], master=bridge, state="up")
            for k in range(N_MIRRORS):
                sw.link("add", ifname=f"m{k}", kind="veth", peer={"ifname": f"c{k}", "net_ns_fd": self.cpu})
                sw.link("set", index=sw.link_lookup(ifname=f"m{k}")[0], state="up")
            sw.link("set", index=bridge, state="up")
        for i, node in enumerate(self.nodes):
            with NetNS(node) as ns:
                ns.link("set", index=ns.link_lookup(ifname="eth0")[0], address=mac(i).hex(":"), state="up")
        with NetNS(self.cpu) as ns:
            for k in range(N_MIRRORS):
                ns.link("set", index=ns.link_lookup(ifname=f"c{k}")[0], state="up")

    def destroy(self) -> None:
        for name in self.names:
            if name in netns.listnetns():
                netns.remove(name)

    def topology(self, directions: list[str], cpu_speed: float = 100) -> dict:
        ports = [{"name": f"Ethernet{4 * i}", "speed_gbps": 100, "linux_ifname": f"p{i}"} for i in range(N_NODES)]
        ports += [{"name": f"Ethernet{100 + k}", "speed_gbps": cpu_speed, "linux_ifname": f"m{k}"}
                  for k in range(N_MIRRORS)]
        return {
            "name": "netns-lab",
            "layout": {"dp": N_NODES},
            "mirror": {"loss_rate": 1e-9, "packets_per_iteration": 1e6, "directions": directions},
            "leaf_switches": [{"name": "sw0", "vendor": "linux", "ports": ports}],
            "gpu_nodes": [{"name": f"n{i}", "gpus": [{"nic": "eth0", "switch": "sw0", "port": f"Ethernet{4 * i}"}]}
                          for i in range(N_NODES)],
            "cpu_nodes": [{"name": "ckpt0", "ports": [{"nic": f"c{k}", "switch": "sw0", "port": f"Ethernet{100 + k}"}
                                                      for k in range(N_MIRRORS)]}],
        }

    def send_and_capture(self) -> dict[str, Counter]:
        """Send FRAMES_PER_PAIR frames between every ordered pair of nodes; count them per CPU interface."""
        receivers = {f"c{k}": packet_socket(self.cpu, f"c{k}", ETHERTYPE) for k in range(N_MIRRORS)}
        senders = [packet_socket(node, "eth0", ETHERTYPE) for node in self.nodes]
        try:
            # Let the bridge learn every MAC first, so that measured frames are never flooded.
            for i, sock in enumerate(senders):
                sock.send(b"\xff" * 6 + mac(i) + ETHERTYPE.to_bytes(2, "big") + b"L" + bytes(59))
            time.sleep(0.2)
            for i, sock in enumerate(senders):
                for j in range(N_NODES):
                    for seq in range(FRAMES_PER_PAIR):
                        if i != j:
                            sock.send(mac(j) + mac(i) + ETHERTYPE.to_bytes(2, "big") + b"M" + bytes([i, j, seq])
                                      + bytes(56))
            counts = {name: Counter() for name in receivers}
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                ready, _, _ = select.select(list(receivers.values()), [], [], 0.5)
                if not ready:
                    break
                for name, sock in receivers.items():
                    if sock in ready:
                        frame = sock.recv(2048)
                        if frame[14:15] == b"M":
                            counts[name][tuple(frame[15:18])] += 1
            return counts
        finally:
            for sock in [*receivers.values(), *senders]:
                sock.close()

    def tc_state(self) -> dict[str, tuple]:
        """Qdisc kinds and filter (priority, kind) per bridge port, for before/after comparisons."""
        state = {}
        with NetNS(self.sw) as sw:
            for i in range(N_NODES):
                index = sw.link_lookup(ifname=f"p{i}")[0]
                qdiscs = sorted(q.get_attr("TCA_KIND") for q in sw.get_qdiscs(index=index) if q["index"] == index)
                filters = sorted((hook, f["info"] >> 16, f.get_attr("TCA_KIND"))
                                 for hook, parent in PARENT.items() for f in sw.get_filters(index=index, parent=parent))
                state[f"p{i}"] = (tuple(qdiscs), tuple(filters))
        return state


@pytest.fixture
def lab():
    lab = Lab()
    try:
        lab.build()
        yield lab
    finally:
        lab.destroy()


def expected_counts(plan) -> dict[str, Counter]:
    expected = {f"c{k}": Counter() for k in range(N_MIRRORS)}
    for source in plan.groups[0].sources:
        node = source.position  # one GPU per node, ring order = DP rank = node index
        for i in range(N_NODES):
            for j in range(N_NODES):
                sent = source.direction in ("egress", "both") and i == node
                received = source.direction in ("ingress", "both") and j == node
                if i != j and (sent or received):
                    for seq in range(FRAMES_PER_PAIR):
                        expected[source.cpu_nic][i, j, seq] += 1
    return expected


@pytest.mark.parametrize("direction,cpu_speed", [("egress", 100), ("ingress", 100), ("both", 200)])
def test_planned_ports_and_directions_arrive_and_nothing_else(lab, direction, cpu_speed):
    plan = plan_topology(parse_topology(lab.topology([direction], cpu_speed)))
    assert {s.direction for s in plan.groups[0].sources} == {direction}
    switch, mirrors = plan_mirrors(plan)
    untouched = lab.tc_state()

    result = apply_mirrors(mirrors, netns=lab.sw)
    assert (switch, len(result.created), result.unchanged) == ("sw0", len(mirrors), [])
    counts = lab.send_and_capture()
    assert counts == expected_counts(plan)
    assert all(counts.values())  # every mirror interface got something

    teardown = teardown_mirrors(mirrors, netns=lab.sw)
    assert sorted(teardown.removed) == sorted(mirrors)
    assert lab.tc_state() == untouched
    assert all(not c for c in lab.send_and_capture().values())


def test_apply_and_teardown_are_idempotent(lab):
    plan = plan_topology(parse_topology(lab.topology(["egress"])))
    _, mirrors = plan_mirrors(plan)
    untouched = lab.tc_state()
    apply_mirrors(mirrors, netns=lab.sw)
    once = lab.tc_state()
    again = apply_mirrors(mirrors, netns=lab.sw)
    assert (again.created, again.replaced, sorted(again.unchanged)) == ([], [], sorted(mirrors))
    assert lab.tc_state() == once
    assert lab.send_and_capture() == expected_counts(plan)
    teardown_mirrors(mirrors, netns=lab.sw)
    second = teardown_mirrors(mirrors, netns=lab.sw)
    assert (second.removed, sorted(second.absent), second.qdiscs_removed) == ([], sorted(mirrors), [])
    assert lab.tc_state() == untouched


def test_a_filter_at_our_priority_that_mirrors_elsewhere_is_replaced(lab):
    plan = plan_topology(parse_topology(lab.topology(["egress"])))
    _, mirrors = plan_mirrors(plan)
    wrong = TcMirror(mirrors[0].ifname, mirrors[0].hook, "m2" if mirrors[0].dest_ifname != "m2" else "m1")
    apply_mirrors([wrong], netns=lab.sw)
    result = apply_mirrors(mirrors, netns=lab.sw)
    assert result.replaced == [mirrors[0]]
    assert lab.send_and_capture() == expected_counts(plan)


def test_teardown_keeps_filters_it_did_not_create(lab):
    plan = plan_topology(parse_topology(lab.topology(["egress"])))
    _, mirrors = plan_mirrors(plan)
    with NetNS(lab.sw) as sw:
        index, m2 = sw.link_lookup(ifname=mirrors[0].ifname)[0], sw.link_lookup(ifname="m2")[0]
        sw.tc("add", "clsact", index)
        sw.tc("add-filter", "u32", index, parent=PARENT["egress"], prio=100, protocol=protocols.ETH_P_ALL,
              target=0, keys=["0x0/0x0+0"],
              action={"kind": "mirred", "direction": "egress", "action": "mirror", "ifindex": m2})
    foreign = lab.tc_state()
    apply_mirrors(mirrors, netns=lab.sw)
    teardown = teardown_mirrors(mirrors, netns=lab.sw)
    assert mirrors[0].ifname not in teardown.qdiscs_removed
    assert lab.tc_state() == foreign


def kernel_has_matchall() -> bool | None:
    try:
        config = gzip.open("/proc/config.gz", "rt").read()
    except OSError:
        return None
    return "CONFIG_NET_CLS_MATCHALL=" in config


def test_classifier_is_matchall_where_the_kernel_has_it_else_u32(lab):
    has = kernel_has_matchall()
    if has is None:
        pytest.skip("no /proc/config.gz to tell whether cls_matchall is built")
    _, mirrors = plan_mirrors(plan_topology(parse_topology(lab.topology(["egress"]))))
    assert apply_mirrors(mirrors, netns=lab.sw).classifier == ("matchall" if has else "u32")
    kinds = {kind for _, filters in lab.tc_state().values() for _, _, kind in filters}
    assert kinds == ({"matchall"} if has else {"u32"})


def test_errors_keep_the_errno_and_name_the_interface(lab):
    with pytest.raises(NetlinkError, match="'nope0'") as missing:
        apply_mirrors([TcMirror("nope0", "ingress", "m0")], netns=lab.sw)
    assert missing.value.errno == errno.ENODEV

    link = _Link(lab.sw)
    try:
        with pytest.raises(NetlinkError, match="'p1'") as kernel:
            link.call("deleting the clsact qdisc", "p1", "tc", "del", "clsact", link.index("p1"))
    finally:
        link.close()
    assert kernel.value.errno in (errno.EINVAL, errno.ENOENT)

    with pytest.raises(NetlinkError, match="does not exist") as absent:
        apply_mirrors([TcMirror("p0", "ingress", "m0")], netns=f"{PREFIX}-absent")
    assert absent.value.errno == errno.ENOENT
    assert f"{PREFIX}-absent" not in netns.listnetns()
