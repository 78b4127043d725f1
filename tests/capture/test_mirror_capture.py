"""Capture off a switch mirror, the way the appliance sees traffic: a Linux bridge plays the
leaf switch, ``gradtap.netconfig.linux_mirror`` mirrors what node 0 sends (tc clsact + mirred) to a
port into the CPU-node namespace, and each live source there, in its own worker process,
must deliver exactly node 0's frames, byte-identical and in order -- none of node 1's."""

from __future__ import annotations

import os
import time

import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.ring import FrameRing
from gradtap.capture.sender import FrameSender
from gradtap.capture.worker import CaptureWorker, SourceSpec
from gradtap.netconfig.linux_mirror import apply_mirrors, teardown_mirrors
from gradtap.netconfig.vendors.linux import TcMirror
from tests.capture.netlab import ETHERTYPE, BridgeLab

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces, tc and AF_XDP")]

MTU = 9000


def mac(i: int) -> bytes:
    return bytes([2, 0, 0, 0, 0x0C, i + 1])


class MirrorLab(BridgeLab):
    """Nodes ``n0`` and ``n1`` on the bridge, one mirror port m0 into the CPU node (c0)."""

    def __init__(self, tag: str):
        super().__init__(f"gtm{os.getpid()}{tag}", [mac(0).hex(":"), mac(1).hex(":")], 1, MTU)


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
