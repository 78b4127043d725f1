"""A hostile capture: many RoCEv2 flows of one frame each (issue 11, "Resources and the disk").

Each frame is ``tests.parser.test_decode.roce_frame``'s RDMA WRITE ONLY with immediate (16
bytes of payload, a correct ICRC) from ``src`` to ``dst``, with its own destination QP, so
each is a flow of its own. Used by the inspect tests and ``benchmarks/inspect.py``.
"""

from __future__ import annotations

import ipaddress
import struct

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapWriter
from tests.parser.test_decode import BTH_WRITE_ONLY_IMM, IP4, roce_frame

CHUNK = 1 << 16


def one_frame_flow_batches(n: int, src: str = "198.18.0.1", dst: str = "198.18.1.1", first_qp: int = 0x100,
                           start_ns: int = 0, gap_ns: int = 1000):
    """Batches of ``n`` one-frame flows (destination QPs ``first_qp ..``, below 2^24) from
    ``start_ns`` on, ``gap_ns`` apart."""
    if first_qp + n > 1 << 24:
        raise ValueError(f"{n} flows from QP {first_qp:#x} do not fit the 24-bit QPN")
    ip = IP4[:12] + ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address(dst).packed
    for lo in range(0, n, CHUNK):
        qps = range(first_qp + lo, first_qp + min(n, lo + CHUNK))
        frames = [roce_frame(ip=ip, bth=BTH_WRITE_ONLY_IMM[:4] + struct.pack("!II", qp, qp & 0xFFFFFF))
                  for qp in qps]
        yield FrameBatch.from_frames(frames, ts_ns=[start_ns + gap_ns * (lo + k) for k in range(len(frames))])


def one_frame_flows(path, n: int, **where) -> None:
    """Write :func:`one_frame_flow_batches` to the pcap ``path``."""
    with PcapWriter(path) as writer:
        for batch in one_frame_flow_batches(n, **where):
            writer.write_batch(batch)
