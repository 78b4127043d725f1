"""Capture off a switch mirror, the way the appliance sees traffic: a Linux bridge plays the
leaf switch, ``netconfig.linux_mirror`` mirrors what node 0 sends (tc clsact + mirred) to a
port into the CPU-node namespace, and each live source there, in its own worker process,
must deliver exactly node 0's frames, byte-identical and in order -- none of node 1's."""

from __future__ import annotations

import os
import time

import pytest
from pyroute2 import NetNS, netns

from capture.frames import FrameBatch
from capture.ring import FrameRing
from capture.sender import FrameSender
from capture.worker import CaptureWorker, SourceSpec
from netconfig.linux_mirror import apply_mirrors, teardown_mirrors
from netconfig.vendors.linux import TcMirror
from tests.capture.netlab import ETHERTYPE, remove_stale, sysctl

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, tc and AF_XDP")]

MTU = 9000


def mac(i: int) -> bytes:
    return bytes([2, 0, 0, 0, 0x0C, i + 1])


class MirrorLab:
    """``sw`` (bridge br0 with ports p0, p1, and mirror port m0), nodes ``n0`` and ``n1``
    (eth0 into p0 and p1), and ``cpu`` (c0, the peer of m0)."""

    def __init__(self, tag: str):
        prefix = f"gtm{os.getpid()}{tag}"
        self.sw, self.cpu, self.nodes = f"{prefix}-sw", f"{prefix}-cpu", [f"{prefix}-n0", f"{prefix}-n1"]

    def __enter__(self):
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self) -> None:
        for name in (self.sw, self.cpu, *self.nodes):
            netns.create(name)
            for conf in ("all", "default"):
                sysctl(name, f"net/ipv6/conf/{conf}/disable_ipv6", "1")
        with NetNS(self.sw) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            bridge = sw.link_lookup(ifname="br0")[0]
            for i, node in enumerate(self.nodes):
                sw.link("add", ifname=f"p{i}", kind="veth", peer={"ifname": "eth0", "net_ns_fd": node})
                sw.link("set", index=sw.link_lookup(ifname=f"p{i}")[0], master=bridge, mtu=MTU, state="up")
            sw.link("add", ifname="m0", kind="veth", peer={"ifname": "c0", "net_ns_fd": self.cpu})
            sw.link("set", index=sw.link_lookup(ifname="m0")[0], mtu=MTU, state="up")
            sw.link("set", index=bridge, mtu=MTU, state="up")
        for i, node in enumerate(self.nodes):
            with NetNS(node) as ns:
                ns.link("set", index=ns.link_lookup(ifname="eth0")[0], address=mac(i).hex(":"), mtu=MTU, state="up")
        with NetNS(self.cpu) as ns:
            ns.link("set", index=ns.link_lookup(ifname="c0")[0], mtu=MTU, state="up")

    def __exit__(self, *exc):
        for name in (self.sw, self.cpu, *self.nodes):
            if name in netns.listnetns():
                netns.remove(name)


def frames_from(node: int, count: int) -> list[bytes]:
    peer = mac(1 - node)
    return [peer + mac(node) + ETHERTYPE.to_bytes(2, "big") + bytes([node]) + i.to_bytes(4, "big")
            + bytes((i + k) & 0xFF for k in range(300 + 37 * i % 4000)) for i in range(count)]


@pytest.mark.parametrize("source", ["af_packet", "af_xdp"])
def test_a_mirrored_port_is_captured_exactly(source):
    with MirrorLab(source[3]) as lab, FrameRing.create(1024, 4352, hugepages="off") as ring:
        mirrors = [TcMirror("p0", "ingress", "m0")]             # what node 0 sends
        apply_mirrors(mirrors, netns=lab.sw)
        worker = CaptureWorker(SourceSpec(source, ("c0",), {"netns": lab.cpu}), ring)
        worker.start()
        try:
            mine, theirs = frames_from(0, 300), frames_from(1, 100)
            # Teach the bridge both MACs first, so no measured frame is flooded.
            for i, node in enumerate(lab.nodes):
                with FrameSender("eth0", netns=node, slots=16) as tx:
                    tx.send(FrameBatch.from_frames([b"\xff" * 6 + mac(i) + ETHERTYPE.to_bytes(2, "big") + b"L"
                                                    + bytes(59)]))
            time.sleep(0.2)
            for node, frames in ((lab.nodes[0], mine), (lab.nodes[1], theirs)):
                with FrameSender("eth0", netns=node, slots=64) as tx:
                    tx.send(FrameBatch.from_frames(frames), rate=20000)
            got, quiet_since = [], time.monotonic()
            while time.monotonic() - quiet_since < 0.5:        # until nothing came for 0.5 s
                batch = ring.read(256, timeout=0.1)
                if len(batch):
                    got += [bytes(batch.frame(i)) for i in range(len(batch))]
                    quiet_since = time.monotonic()
        finally:
            final = worker.stop()
            teardown_mirrors(mirrors, netns=lab.sw)
    assert got[0][14:15] == b"L" and got[1:] == mine            # node 0's learning frame, then its frames
    assert final["kernel_drops"] == final["ring_drops"] == 0
