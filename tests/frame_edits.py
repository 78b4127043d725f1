"""Editing captured RoCEv2 frames the way a lossy or hostile mirror link would: the tests'
own byte offsets (RFC 791, RFC 768, IBTA BTH) and, where an edit must keep the frame valid,
the plain ICRC of ``tests/wire/naive_icrc.py``. Untagged IPv4 frames, as the simulator writes
them. Shared by the fault matrix, the hostile-frame Hypothesis test and the stray-PSN tests."""

from __future__ import annotations

import struct
from pathlib import Path

from gradtap.capture.pcap import PcapWriter, read_pcap
from tests.wire.naive_icrc import naive_icrc

ROCE_PORT = 4791
WRITE_FIRST, WRITES = 6, tuple(range(6, 12))         # RC RDMA WRITE opcodes (IBTA Table 38)


def bth_offset(frame: bytes) -> int | None:
    """Offset of the BTH of an untagged IPv4 RoCEv2 frame, else None."""
    if len(frame) < 14 + 20 + 8 + 12 or frame[12:14] != b"\x08\x00" or frame[23] != 17:
        return None
    udp = 14 + (frame[14] & 0x0F) * 4
    if struct.unpack_from("!H", frame, udp + 2)[0] != ROCE_PORT:
        return None
    return udp + 8


def psn_of(frame: bytes) -> int:
    bth = bth_offset(frame)
    return int.from_bytes(frame[bth + 9:bth + 12], "big")


def writes(frames) -> list[int]:
    """Indices of the RDMA WRITE frames (the job's data and CTS) of ``[(frame, ts)]``."""
    out = []
    for i, (frame, _) in enumerate(frames):
        bth = bth_offset(frame)
        if bth is not None and frame[bth] in WRITES:
            out.append(i)
    return out


def resign(frame: bytearray) -> bytes:
    """The frame with a valid ICRC again."""
    frame[-4:] = struct.pack("<I", naive_icrc(bytes(frame)))
    return bytes(frame)


def fix_ip_checksum(frame: bytearray) -> None:
    ihl = (frame[14] & 0x0F) * 4
    frame[24:26] = b"\0\0"
    s = sum(struct.unpack_from(f"!{ihl // 2}H", frame, 14))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    frame[24:26] = struct.pack("!H", ~s & 0xFFFF)


def read_frames(path: Path) -> list[tuple[bytes, int]]:
    batch = read_pcap(path)
    return [(batch.data[o:o + c].tobytes(), int(t)) for o, c, t in zip(batch.offsets, batch.caplens, batch.ts_ns)]


def write_frames(path: Path, frames) -> None:
    with PcapWriter(path) as w:
        for frame, ts in frames:
            w.write(frame, ts)
