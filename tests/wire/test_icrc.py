"""ICRC: the real captures validate (and their 0xaa frames do not), scapy agrees, the slow
twin agrees, ISA-L's CRC equals zlib's, the payload's own CRC made beside the ICRC equals
zlib's, and the code runs without the JIT."""

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from scapy.contrib.roce import AETH, BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Raw

from gradtap.capture.pcap import read_pcap
from gradtap.wire.headers import bth, ipv4, ipv6, opcodes, udp
from gradtap.wire.icrc import ICRC_LEN, ROCE_MTUS, compute_icrc, crc32_shift, crc32_update, icrc_and_payload_crc, \
    icrc_frame, icrc_ok, locate_icrc
from tests.wire.naive_icrc import naive_icrc
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURES = GOLDEN_CAPTURES
# RoCEv2 frames per file, from the captures' README.
ROCE_FRAMES = {"allreduce+p2p.pcapng": 150, "allreduce_addstep.pcapng": 156,
               "iter_40000_p2p_iter10.pcapng": 1417, "iter_40000_p2p_iter10_3.pcapng": 665,
               "rdma32.pcapng": 123}


def _roce_frames(name):
    """(batch, [(index, l3, is_ipv6, end, opcode)]) for the RoCEv2 frames of a capture."""
    batch = read_pcap(CAPTURES / name)
    found = []
    for i in range(len(batch)):
        frame = bytes(batch.frame(i))
        try:
            l3, is_ipv6, end = locate_icrc(frame)
        except ValueError:
            continue
        ip_len = ipv6.IPV6_LEN if is_ipv6 else ipv4.unpack(frame, l3)["ihl"] * 4
        opcode = frame[l3 + ip_len + udp.UDP_LEN + bth.BTH_OFF_OPCODE]
        found.append((i, l3, is_ipv6, end, opcode))
    return batch, found


@pytest.mark.parametrize("name", ROCE_FRAMES)
def test_standard_capture_frames_validate_in_place(name):
    batch, found = _roce_frames(name)
    assert len(found) == ROCE_FRAMES[name]
    for i, l3, is_ipv6, end, opcode in found:
        base = int(batch.offsets[i])
        # As the parser calls it: offsets into the whole batch buffer, no copy.
        crc = icrc_frame(batch.data, base + l3, is_ipv6, base + end)
        stored = int.from_bytes(batch.data[base + end - ICRC_LEN:base + end].tobytes(), "little")
        assert (crc == stored) == bool(opcodes.OPCODE_VALID[opcode]), f"frame {i + 1}"
        assert naive_icrc(bytes(batch.frame(i))) == crc


def test_rdma32_opcode_0xaa_frames_fail():
    batch, found = _roce_frames("rdma32.pcapng")
    odd = [i for i, *_, opcode in found if opcode == 0xAA]
    assert len(odd) == 7
    assert not any(icrc_ok(batch.frame(i)) for i in odd)
    assert all(icrc_ok(batch.frame(i)) for i, *_, opcode in found if opcode != 0xAA)


def test_non_roce_frames_are_not_located():
    batch = read_pcap(CAPTURES / "allreduce+p2p.pcapng")
    with pytest.raises(ValueError, match="RoCEv2"):
        locate_icrc(batch.frame(0))  # PTP announce, UDP port 320
    with pytest.raises(ValueError, match="shorter than an Ethernet header"):
        locate_icrc(b"\x00" * 10)


def _scapy_frame(rng, ipv6_family: bool, vlan: bool) -> bytes:
    ether = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    if vlan:
        ether = ether / Dot1Q(vlan=int(rng.integers(4096)), prio=int(rng.integers(8)))
    if ipv6_family:
        ip = IPv6(src="fe80::1", dst="fe80::2", tc=int(rng.integers(256)),
                  fl=int(rng.integers(1 << 20)), hlim=int(rng.integers(256)))
    else:
        ip = IP(src="10.0.0.1", dst="10.0.0.2", tos=int(rng.integers(256)),
                ttl=int(rng.integers(256)), id=int(rng.integers(1 << 16)))
    opcode = int(rng.choice([0x06, 0x07, 0x0A, 0x0B, 0x11]))
    head = BTH(opcode=opcode, padcount=int(rng.integers(4)), fecn=int(rng.integers(2)),
               becn=int(rng.integers(2)), resv6=int(rng.integers(64)),
               dqpn=int(rng.integers(1 << 24)), ackreq=int(rng.integers(2)),
               psn=int(rng.integers(1 << 24)), pkey=int(rng.integers(1 << 16)))
    body = AETH(syndrome=int(rng.integers(256)), msn=int(rng.integers(1 << 24))) \
        if opcode == 0x11 else Raw(rng.bytes(int(rng.integers(0, 1100))))
    return bytes(ether / ip / UDP(sport=int(rng.integers(1 << 16)), dport=4791) / head / body)


@pytest.mark.parametrize("ipv6_family", [False, True], ids=["ipv4", "ipv6"])
def test_agrees_with_scapy(ipv6_family):
    rng = np.random.default_rng(7 + ipv6_family)
    for k in range(150):
        frame = _scapy_frame(rng, ipv6_family, vlan=k % 3 == 0)
        _, _, end = locate_icrc(frame)
        assert compute_icrc(frame) == int.from_bytes(frame[end - ICRC_LEN:end], "little")
        assert icrc_ok(frame)


def _random_frame(rng, after_udp: int | None = None) -> bytes:
    """A RoCEv2-shaped frame with random content everywhere, IPv4 options, VLAN tags and
    Ethernet padding after the packet; ``after_udp`` bytes from the BTH to the ICRC's end
    (default random)."""
    tags = b"".join(b"\x81\x00" + rng.bytes(2) for _ in range(int(rng.integers(0, 3))))
    payload = rng.bytes(12 + int(rng.integers(0, 4200)) + ICRC_LEN if after_udp is None else after_udp)
    if rng.integers(2):
        ethertype, ihl = b"\x86\xdd", 0
        ip = bytes([0x60 | int(rng.integers(16))]) + rng.bytes(3) + \
            (8 + len(payload)).to_bytes(2, "big") + b"\x11" + rng.bytes(33)
    else:
        ethertype, ihl = b"\x08\x00", int(rng.integers(5, 16))
        unfragmented = (0x4000 * int(rng.integers(2))).to_bytes(2, "big")  # DF or not, MF 0
        ip = bytes([0x40 | ihl]) + rng.bytes(5) + unfragmented + rng.bytes(1) + b"\x11" + \
            rng.bytes(ihl * 4 - 10)
    udp_header = rng.bytes(2) + (4791).to_bytes(2, "big") + \
        (8 + len(payload)).to_bytes(2, "big") + rng.bytes(2)
    return rng.bytes(12) + tags + ethertype + ip + udp_header + payload + \
        rng.bytes(int(rng.integers(0, 8)))


@pytest.mark.parametrize("seed", range(4))
def test_fast_path_equals_naive_twin_on_random_frames(seed):
    rng = np.random.default_rng(seed)
    for _ in range(250):
        frame = _random_frame(rng)
        l3, is_ipv6, end = locate_icrc(frame)
        # Embedded in a larger buffer with garbage around it, as in a batch.
        lead, tail = rng.bytes(int(rng.integers(0, 64))), rng.bytes(int(rng.integers(0, 64)))
        buf = np.frombuffer(lead + frame + tail, np.uint8)
        got = icrc_frame(buf, len(lead) + l3, is_ipv6, len(lead) + end)
        assert got == naive_icrc(frame)


def test_a_shifted_crc_concatenates_as_zlib_does():
    """zlib's CRC of ``a + b`` from the CRCs of ``a`` and of ``b``, for ``b`` of each path MTU."""
    rng = np.random.default_rng(11)
    for m, n in enumerate(ROCE_MTUS):
        for _ in range(40):
            a, b = rng.bytes(int(rng.integers(0, 200))), rng.bytes(n)
            assert crc32_shift(zlib.crc32(a), m) ^ zlib.crc32(b) == zlib.crc32(a + b)


def _frame_with_payload(rng, payload_len: int) -> tuple[bytes, int]:
    """A random RoCEv2-shaped frame (as :func:`_random_frame`) whose BTH is followed by 0, 4
    or 16 bytes of extension headers, then ``payload_len`` bytes of payload and a pad of 0-3;
    and the payload's offset in the frame."""
    ext, pad = int(rng.choice([0, 4, 16])), int(rng.integers(0, 4))
    frame = _random_frame(rng, 12 + ext + payload_len + pad + ICRC_LEN)
    end = locate_icrc(frame)[2]
    return frame, end - ICRC_LEN - pad - payload_len


@pytest.mark.parametrize("seed", range(3))
def test_the_payload_crc_comes_with_the_icrc(seed):
    """``icrc_and_payload_crc``: the naive twin's ICRC, and zlib's CRC of the payload when
    its length is a path MTU (-1 otherwise), wherever the frame lies in a batch."""
    rng = np.random.default_rng(100 + seed)
    for k in range(120):
        length = ROCE_MTUS[k % 5] if k % 3 else int(rng.integers(0, 4200))
        frame, payload_off = _frame_with_payload(rng, length)
        l3, is_ipv6, end = locate_icrc(frame)
        lead = rng.bytes(int(rng.integers(0, 64)))
        buf = np.frombuffer(lead + frame + rng.bytes(int(rng.integers(0, 64))), np.uint8)
        icrc, payload_crc = icrc_and_payload_crc(buf, len(lead) + l3, is_ipv6, len(lead) + payload_off, length,
                                                 len(lead) + end)
        assert icrc == naive_icrc(frame)
        payload = frame[payload_off:payload_off + length]
        assert payload_crc == (zlib.crc32(payload) if length in ROCE_MTUS else -1)


def test_crc32_update_equals_zlib():
    rng = np.random.default_rng(3)
    buf = np.frombuffer(rng.bytes(10000), np.uint8)
    for _ in range(300):
        start = int(rng.integers(0, 10000))
        stop = int(rng.integers(start, 10001))
        init = int(rng.integers(0, 1 << 32))
        assert crc32_update(init, buf, start, stop) == zlib.crc32(buf[start:stop].tobytes(), init)
    # Chaining, as icrc_frame does: prefix then rest.
    whole = zlib.crc32(buf.tobytes())
    assert crc32_update(crc32_update(0, buf, 0, 77), buf, 77, len(buf)) == whole


NO_JIT_SCRIPT = """
import numba
from pathlib import Path
from gradtap.capture.pcap import read_pcap
from gradtap.wire.icrc import icrc_ok, locate_icrc
from tests.golden import CAPTURES as GOLDEN_CAPTURES
assert numba.config.DISABLE_JIT
good = bad = 0
for path in sorted(GOLDEN_CAPTURES.glob("*.pcapng")):
    batch = read_pcap(path)
    for i in range(len(batch)):
        try:
            locate_icrc(batch.frame(i))
        except ValueError:
            continue
        if icrc_ok(batch.frame(i)):
            good += 1
        else:
            bad += 1
print(good, bad)
"""


@pytest.mark.slow
def test_captures_validate_without_jit():
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", NO_JIT_SCRIPT], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(sum(ROCE_FRAMES.values()) - 7), "7"]
