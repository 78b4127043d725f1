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

from gradtap.core.errors import ConfigError, NetlinkError
from gradtap.netconfig.linux_mirror import (PARENT, _Link, _mirred_targets, _ours, apply_mirrors, apply_recorded,
                                            load_record, plan_mirrors, teardown_mirrors, teardown_recorded)
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.topology import parse_topology
from gradtap.netconfig.vendors.linux import TcMirror
from tests.capture.netlab import in_netns, remove_stale

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
        remove_stale()
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

    teardown = teardown_mirrors(mirrors, netns=lab.sw, qdiscs_added=set(result.qdiscs_added))
    assert sorted(teardown.removed) == sorted(mirrors)
    assert lab.tc_state() == untouched
    assert all(not c for c in lab.send_and_capture().values())


def test_apply_and_teardown_are_idempotent(lab):
    plan = plan_topology(parse_topology(lab.topology(["egress"])))
    _, mirrors = plan_mirrors(plan)
    untouched = lab.tc_state()
    added = set(apply_mirrors(mirrors, netns=lab.sw).qdiscs_added)
    once = lab.tc_state()
    again = apply_mirrors(mirrors, netns=lab.sw)
    assert (again.created, again.replaced, sorted(again.unchanged), again.qdiscs_added) == ([], [], sorted(mirrors), [])
    assert lab.tc_state() == once
    assert lab.send_and_capture() == expected_counts(plan)
    teardown_mirrors(mirrors, netns=lab.sw, qdiscs_added=added)
    second = teardown_mirrors(mirrors, netns=lab.sw, qdiscs_added=added)
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
    added = apply_mirrors(mirrors, netns=lab.sw).qdiscs_added
    assert mirrors[0].ifname not in added
    teardown = teardown_mirrors(mirrors, netns=lab.sw, qdiscs_added=set(added))
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


# -- rollback, the record of what was applied, and clsact qdiscs gradtap did not add ---------------

def add_empty_clsact(lab, ifname: str) -> None:
    with NetNS(lab.sw) as sw:
        sw.tc("add", "clsact", sw.link_lookup(ifname=ifname)[0])


def targets(lab, mirror: TcMirror) -> set[int]:
    link = _Link(lab.sw)
    try:
        return set().union(*(_mirred_targets(m) for m in _ours(link, mirror)))
    finally:
        link.close()


def ifindex(lab, ifname: str) -> int:
    with NetNS(lab.sw) as sw:
        return sw.link_lookup(ifname=ifname)[0]


@pytest.mark.parametrize("broken", [TcMirror(f"{PREFIX[:8]}x0", "ingress", "m1"), TcMirror("p1", "ingress", "nope0")],
                         ids=["missing-interface", "missing-destination"])
def test_a_failed_apply_rolls_back_what_it_installed(lab, broken):
    """Fault injection: the 2nd of 3 mirrors names a device that does not exist."""
    good = [TcMirror("p0", "ingress", "m0"), TcMirror("p2", "ingress", "m2")]
    add_empty_clsact(lab, "p2")     # someone else's, empty: must survive the rollback
    before = lab.tc_state()
    with pytest.raises(NetlinkError) as err:
        apply_mirrors([good[0], broken, good[1]], netns=lab.sw)
    assert err.value.errno == errno.ENODEV
    added = 2 if broken.ifname == "p1" else 1      # p0's clsact, and p1's when p1 is the broken one
    assert f"rolled back: 1 added and 0 replaced mirror filters, {added} added clsact qdiscs" in str(err.value)
    assert "FAILED" not in str(err.value)
    assert lab.tc_state() == before
    assert all(not c for c in lab.send_and_capture().values())  # nothing half-installed is mirroring


def test_a_failed_apply_points_a_replaced_filter_back_where_it_mirrored(lab):
    old = TcMirror("p0", "ingress", "m2")
    apply_mirrors([old], netns=lab.sw)
    with pytest.raises(NetlinkError, match="rolled back: 0 added and 1 replaced"):
        apply_mirrors([TcMirror("p0", "ingress", "m0"), TcMirror("p1", "ingress", "nope0")], netns=lab.sw)
    assert targets(lab, old) == {ifindex(lab, "m2")}


def test_teardown_after_replanning_removes_what_is_running(lab, tmp_path):
    state = tmp_path / "var" / "sw0.json"
    untouched = lab.tc_state()
    _, egress = plan_mirrors(plan_topology(parse_topology(lab.topology(["egress"]))))
    _, ingress = plan_mirrors(plan_topology(parse_topology(lab.topology(["ingress"]))))
    apply_recorded("sw0", egress, state, netns=lab.sw)
    assert load_record(state).mirrors == egress
    # Re-planned: the new apply removes the mirrors the old plan had and the new one lacks.
    result = apply_recorded("sw0", ingress, state, netns=lab.sw)
    assert sorted(result.stale_removed) == sorted(egress)
    assert load_record(state).mirrors == ingress
    assert lab.send_and_capture() == expected_counts(plan_topology(parse_topology(lab.topology(["ingress"]))))
    record, teardown = teardown_recorded(state)
    assert sorted(teardown.removed) == sorted(ingress) and teardown.absent == []
    assert not state.exists() and list(state.parent.iterdir()) == []   # no temporary file left either
    assert lab.tc_state() == untouched


def test_a_clsact_that_was_there_before_is_kept(lab, tmp_path):
    state = tmp_path / "sw0.json"
    _, mirrors = plan_mirrors(plan_topology(parse_topology(lab.topology(["egress"]))))
    add_empty_clsact(lab, mirrors[0].ifname)
    before = lab.tc_state()
    result = apply_recorded("sw0", mirrors, state, netns=lab.sw)
    assert mirrors[0].ifname not in result.qdiscs_added
    assert mirrors[0].ifname not in load_record(state).qdiscs_added
    _, teardown = teardown_recorded(state)
    assert teardown.qdiscs_kept == [mirrors[0].ifname]
    assert lab.tc_state() == before       # its clsact, empty as it was, is still there


def test_a_failed_apply_leaves_the_record_as_it_was(lab, tmp_path):
    state = tmp_path / "sw0.json"
    first = [TcMirror("p0", "ingress", "m0")]
    apply_recorded("sw0", first, state, netns=lab.sw)
    text = state.read_text()
    with pytest.raises(NetlinkError):
        apply_recorded("sw0", [TcMirror("p1", "ingress", "m1"), TcMirror("p2", "ingress", "nope0")], state,
                       netns=lab.sw)
    assert state.read_text() == text
    assert targets(lab, first[0]) == {ifindex(lab, "m0")}
    teardown_recorded(state)


def test_teardown_without_a_record_says_so(tmp_path):
    with pytest.raises(ConfigError, match="no record of applied mirrors here"):
        teardown_recorded(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not a record of applied mirrors"):
        load_record(tmp_path / "bad.json")


def test_a_recorded_interface_that_is_gone_is_nothing_to_remove(lab, tmp_path):
    state = tmp_path / "sw0.json"
    apply_recorded("sw0", [TcMirror("p3", "ingress", "m0")], state, netns=lab.sw)
    with NetNS(lab.sw) as sw:
        sw.link("del", index=sw.link_lookup(ifname="p3")[0])
    new = [TcMirror("p0", "ingress", "m1")]
    result = apply_recorded("sw0", new, state, netns=lab.sw)
    assert result.stale_removed == [] and load_record(state).mirrors == new
    _, teardown = teardown_recorded(state)
    assert teardown.removed == new
