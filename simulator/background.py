"""Traffic on a mirrored port that is not the ring allreduce.

A real mirror port carries more than NCCL's ring: pipeline-parallel p2p RDMA writes to
ranks outside the ring, the TCP of the rendezvous store, ARP, and connection-manager MADs
(64-byte UD SENDs to QP 1). The parser must count all of it and keep none. Each mirrored rank gets a
few of each per iteration, at fixed points of the iteration's timeline.
"""

from __future__ import annotations

import ipaddress
import struct

import numpy as np

from gradtap.simulator.frames import PACKET_DTYPE, Routes
from gradtap.simulator.traffic import ACK_SYNDROME
from gradtap.wire.headers import aeth, eth, ipv4, ipv6
from gradtap.wire.headers import opcodes as op
from gradtap.wire.psn import PSN_MODULUS, psn_add
from gradtap.workload.nccl import era_facts
from gradtap.workload.spec import JobSpec

P2P_BYTES = (40000, 15424, 24576)   # the p2p message sizes seen in the real captures
P2P_QPN = 0x7000
TCP_STORE_PORT = 29500
CM_QPN = 1                           # the GSI QP that carries connection-manager MADs
CM_BYTES = 64                        # the size of the UD datagrams to QP 1 in the real captures


def _peer(job: JobSpec, position: int) -> tuple[str, str]:
    """Address and MAC of a pipeline neighbour outside the ring (not a ring rank)."""
    ip = ipaddress.ip_address(job.ring.ranks[position].ip)
    ring = {r.ip for r in job.ring.ranks}
    peer = ip + 0x10000
    while str(peer) in ring:
        peer += 0x10000
    return str(peer), f"02:00:00:00:ff:{position & 0xFF:02x}"


class Background:
    """Per iteration: one p2p RDMA message each way, one CM MAD, one TCP segment, one ARP."""

    def __init__(self, job: JobSpec, routes: Routes, positions: set[int], rng: np.random.Generator):
        self.job, self.rng = job, rng
        self.big_endian_imm = era_facts(job.nccl).imm_big_endian
        self.positions = sorted(positions)
        ranks = job.ring.ranks
        self.routes = {}
        for p in self.positions:
            peer_ip, peer_mac = _peer(job, p)
            out = routes.add(ranks[p].mac, peer_mac, ranks[p].ip, peer_ip, 50000 + p)
            back = routes.add(peer_mac, ranks[p].mac, peer_ip, ranks[p].ip, 50000 + p)
            cm = routes.add(ranks[p].mac, peer_mac, ranks[p].ip, peer_ip, 50100 + p)
            self.routes[p] = (out, back, cm)
        self.arena = np.concatenate([self.rng.integers(0, 256, max(P2P_BYTES), dtype=np.uint8),
                                     self.rng.integers(0, 256, CM_BYTES, dtype=np.uint8)])
        self.psn = {p: int(self.rng.integers(0, PSN_MODULUS)) for p in self.positions}

    def packets(self, t0: int, mtu: int, arena_base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """RoCE packets (p2p and CM) of one iteration starting at ``t0``; payload offsets
        are relative to ``arena_base`` where :attr:`arena` will be placed."""
        rows, src, dst = [], [], []
        for p in self.positions:
            out, back, cm = self.routes[p]
            size = int(self.rng.choice(P2P_BYTES))
            npk = -(-size // mtu)
            pk = np.zeros(npk + 1, PACKET_DTYPE)
            k = np.arange(npk)
            pk["route"][:npk] = out
            pk["opcode"][:npk] = np.where(k == 0, op.RC_RDMA_WRITE_FIRST, op.RC_RDMA_WRITE_MIDDLE)
            pk["opcode"][npk - 1] = op.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE if npk > 1 else op.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE
            pk["dest_qpn"][:npk] = P2P_QPN + p
            pk["psn"][:npk] = psn_add(self.psn[p], k)
            pk["reth_va"][:npk] = 0x7E0000000000
            pk["reth_rkey"][:npk] = 0xBEEF
            pk["reth_len"][:npk] = size
            # NCCL's ImmDt is the size, byte-swapped on the wire before 2.29 (docs/wire-format.md).
            pk["imm"][:npk] = size if self.big_endian_imm else int.from_bytes(size.to_bytes(4, "little"), "big")
            pk["payload_off"][:npk] = arena_base + k * mtu
            pk["payload_len"][:npk] = np.minimum(mtu, size - k * mtu)
            pk["ts_ns"][:npk] = t0 + 1000 + k * 100
            pk["ackreq"][npk - 1] = 1
            # The peer's ACK.
            pk["route"][npk] = back
            pk["opcode"][npk] = op.RC_ACKNOWLEDGE
            pk["dest_qpn"][npk] = P2P_QPN + 0x100 + p
            pk["psn"][npk] = pk["psn"][npk - 1]
            pk["aeth"][npk] = aeth.word(ACK_SYNDROME, 0)
            pk["ts_ns"][npk] = pk["ts_ns"][npk - 1] + 2000
            self.psn[p] = psn_add(self.psn[p], npk)
            mad = np.zeros(1, PACKET_DTYPE)
            mad["route"] = cm
            mad["opcode"] = op.UD_SEND_ONLY
            mad["dest_qpn"] = CM_QPN
            mad["payload_off"] = arena_base + max(P2P_BYTES)
            mad["payload_len"] = CM_BYTES
            mad["ts_ns"] = t0 + 500
            rows += [pk, mad]
            src += [np.r_[np.full(npk, p), -1, p]]
            dst += [np.r_[np.full(npk, -1), p, -1]]
        if not rows:
            return np.zeros(0, PACKET_DTYPE), np.zeros(0, np.int16), np.zeros(0, np.int16)
        return np.concatenate(rows), np.concatenate(src).astype(np.int16), np.concatenate(dst).astype(np.int16)

    def raw_frames(self, t0: int) -> list[tuple[int, int, int, bytes]]:
        """Non-RoCE frames of one iteration: ``(ts_ns, src, dst, frame)``."""
        out = []
        ranks = self.job.ring.ranks
        for p in self.positions:
            peer_ip, peer_mac = _peer(self.job, p)
            mac = bytes.fromhex(ranks[p].mac.replace(":", ""))
            pmac = bytes.fromhex(peer_mac.replace(":", ""))
            out.append((t0 + 200, p, -1, _tcp(mac, pmac, ranks[p].ip, peer_ip, b"gradtap-store-heartbeat")))
            out.append((t0 + 300, p, -1, _arp(mac, ranks[p].ip, peer_ip)))
        return out


def _tcp(src_mac: bytes, dst_mac: bytes, src_ip: str, dst_ip: str, payload: bytes) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", 40000, TCP_STORE_PORT, 1, 1, 5 << 4, 0x18, 502, 0, 0) + payload
    a, b = ipaddress.ip_address(src_ip), ipaddress.ip_address(dst_ip)
    if a.version == 4:
        pseudo = a.packed + b.packed + struct.pack("!BBH", 0, 6, len(tcp))
        tcp = tcp[:16] + struct.pack("!H", ipv4.checksum(pseudo + tcp + b"\0" * (len(tcp) % 2))) + tcp[18:]
        ip = ipv4.pack(total_length=20 + len(tcp), flags=2, proto=6, src=a.packed, dst=b.packed)
        return eth.pack(dst=dst_mac, src=src_mac, type=eth.ETHERTYPE_IPV4) + ip + tcp
    pseudo = a.packed + b.packed + struct.pack("!I3xB", len(tcp), 6)
    tcp = tcp[:16] + struct.pack("!H", ipv4.checksum(pseudo + tcp + b"\0" * (len(tcp) % 2))) + tcp[18:]
    ip = ipv6.pack(payload_length=len(tcp), next_header=6, src=a.packed, dst=b.packed)
    return eth.pack(dst=dst_mac, src=src_mac, type=eth.ETHERTYPE_IPV6) + ip + tcp


def _arp(src_mac: bytes, src_ip: str, target_ip: str) -> bytes:
    a, b = ipaddress.ip_address(src_ip), ipaddress.ip_address(target_ip)
    if a.version == 6:
        # IPv6 has no ARP; a link-local host resolves with ICMPv6 neighbour discovery,
        # which is just more non-RoCE traffic to the parser. Keep the frame ARP-shaped.
        a, b = ipaddress.ip_address("169.254.0.1"), ipaddress.ip_address("169.254.0.2")
    body = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, src_mac, a.packed, b"\0" * 6, b.packed)
    return eth.pack(dst=b"\xff" * 6, src=src_mac, type=eth.ETHERTYPE_ARP) + body
