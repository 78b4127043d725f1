"""FrameSender: a batch sent through the TX ring, in bursts and paced, arrives on the far
side of a veth pair whole, byte-identical and in order."""

from __future__ import annotations

import os

import pytest

from gradtap.capture.af_packet import AfPacketSource
from gradtap.capture.frames import FrameBatch
from gradtap.capture.ring import FrameRing
from gradtap.capture.sender import FrameSender
from gradtap.core.errors import CaptureError
from tests.capture.netlab import collect, mixed_frames, veth_lab

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and raw sockets")]


@pytest.mark.parametrize("rate,burst", [(None, 32), (20000.0, 7)])
def test_a_batch_arrives_whole_and_in_order(rate, burst):
    sent = mixed_frames(500, 9000)
    with veth_lab("s") as lab, FrameRing.create(1024, 9216, hugepages="off") as ring, \
            AfPacketSource("rx0", netns=lab.rx) as source:
        with FrameSender("tx0", netns=lab.tx, slots=64) as sender:
            sender.send(FrameBatch.from_frames(sent), rate=rate, burst=burst)
            assert (sender.sent, sender.refused) == (500, 0)
        got = collect(source, ring, len(sent))
    assert [g[0] for g in got] == sent


def test_a_missing_interface_is_named():
    with veth_lab("s") as lab:
        with pytest.raises(CaptureError, match="no interface 'nope0'"):
            FrameSender("nope0", netns=lab.tx).open()
