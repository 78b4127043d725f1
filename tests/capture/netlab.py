"""Network namespaces for the capture tests: two namespaces joined by a veth pair.

``<prefix>-tx`` holds ``tx0``, ``<prefix>-rx`` holds ``rx0``; IPv6 is off in both before the
links come up, so the receiver sees only the frames a test sends (no router or neighbour
solicitations). :func:`veth_lab` removes both namespaces even when the test fails.
"""

from __future__ import annotations

import os
import re
import socket
import time
from contextlib import contextmanager

from pyroute2 import NetNS, netns

ETHERTYPE = 0x88B5      # IEEE 802 local experimental: frames no stack reacts to
TX_MAC = bytes.fromhex("020000000a01")
RX_MAC = bytes.fromhex("020000000b01")


@contextmanager
def in_netns(name: str):
    netns.pushns(name)
    try:
        yield
    finally:
        netns.popns()


def sysctl(ns: str, path: str, value: str) -> None:
    with in_netns(ns), open(f"/proc/sys/{path}", "w") as f:
        f.write(value)


def quiet_netns(name: str) -> None:
    """Create namespace ``name`` with IPv6 off before any link comes up (no router or
    neighbour solicitations: its links carry only what a test sends)."""
    netns.create(name)
    for conf in ("all", "default"):
        sysctl(name, f"net/ipv6/conf/{conf}/disable_ipv6", "1")


class VethLab:
    def __init__(self, prefix: str, mtu: int = 9000):
        self.tx, self.rx = f"{prefix}-tx", f"{prefix}-rx"
        self.mtu = mtu

    def build(self) -> None:
        for name in (self.tx, self.rx):
            quiet_netns(name)
        with NetNS(self.tx) as ns:
            ns.link("add", ifname="tx0", kind="veth", peer={"ifname": "rx0", "net_ns_fd": self.rx})
            ns.link("set", index=ns.link_lookup(ifname="tx0")[0], address=TX_MAC.hex(":"), mtu=self.mtu,
                    state="up")
        with NetNS(self.rx) as ns:
            ns.link("set", index=ns.link_lookup(ifname="rx0")[0], address=RX_MAC.hex(":"), mtu=self.mtu,
                    state="up")

    def destroy(self) -> None:
        for name in (self.tx, self.rx):
            if name in netns.listnetns():
                netns.remove(name)

    def sender(self) -> socket.socket:
        """A raw AF_PACKET socket on ``tx0``: ``send(frame)`` puts one frame on the veth."""
        with in_netns(self.tx):
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        sock.bind(("tx0", 0))
        return sock

    def xdp_state(self) -> dict:
        """The IFLA_XDP attributes of ``rx0`` (empty apart from 'attached: None' when none)."""
        with NetNS(self.rx) as ns:
            link = ns.get_links(ns.link_lookup(ifname="rx0")[0])[0]
            xdp = link.get_attr("IFLA_XDP")
            return dict(xdp["attrs"]) if xdp else {}


def remove_stale() -> None:
    """Remove namespaces of earlier test runs that were killed before their own clean-up
    could run: every test names its namespaces ``gt<letters><pid>…`` (``gtc``, ``gtm``,
    ``gtl``, ``gtnc``, ``gtrun``, ``gtsig``), and these are the ones whose process is gone."""
    for name in netns.listnetns():
        match = re.match(r"gt[a-z]+(\d+)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            netns.remove(name)


@contextmanager
def veth_lab(tag: str, mtu: int = 9000):
    remove_stale()
    lab = VethLab(f"gtc{os.getpid()}{tag}", mtu)
    try:
        lab.build()
        yield lab
    finally:
        lab.destroy()


def frame(seq: int, size: int) -> bytes:
    """An Ethernet frame of ``size`` bytes to RX_MAC carrying ``seq`` and a pattern from it."""
    body = seq.to_bytes(4, "big") + bytes((seq + k) & 0xFF for k in range(size - 18))
    return RX_MAC + TX_MAC + ETHERTYPE.to_bytes(2, "big") + body


def vlan(frame_: bytes, tpid: int, tci: int) -> bytes:
    """``frame_`` with an 802.1Q/802.1ad tag inserted after its MAC addresses."""
    return frame_[:12] + tpid.to_bytes(2, "big") + tci.to_bytes(2, "big") + frame_[12:]


def mixed_frames(count: int, max_size: int) -> list[bytes]:
    """``count`` frames of sizes from 60 to ``max_size`` bytes, every seventh one tagged
    (802.1Q, 802.1ad, or both: the kernel strips the outer tag, capture must restore it)."""
    out = []
    for i in range(count):
        size = 60 + (i * 977) % (max_size - 60 - 8 + 1)
        f = frame(i, size)
        if i % 7 == 3:
            f = vlan(f, 0x8100, 0x2000 | i % 4096)
        elif i % 7 == 5:
            f = vlan(vlan(f, 0x8100, 100), 0x88A8, 7)
        out.append(f)
    return out


def collect(source, ring, count: int, seconds: float = 5.0) -> list[tuple[bytes, int, int]]:
    """Let ``source`` receive until it has taken ``count`` frames (or ``seconds`` pass), then
    return ``(bytes, wirelen, ts_ns)`` of every frame in the ring, copied out."""
    deadline = time.monotonic() + seconds
    while source.stats()["received"] < count and time.monotonic() < deadline:
        source.receive(ring, 0.05)
    out = []
    while True:
        batch = ring.read(4096, timeout=0)
        if not len(batch):
            return out
        out += [(bytes(batch.frame(i)), int(batch.wirelens[i]), int(batch.ts_ns[i])) for i in range(len(batch))]


class BridgeLab:
    """A leaf switch made of namespaces: ``<prefix>-sw`` holds bridge br0 with ports
    p0..p{n-1} and mirror ports m0..m{k-1}; node i (``<prefix>-n{i}``) has eth0 into p{i} with
    MAC ``macs[i]``; the CPU node (``<prefix>-cpu``) has c0..c{k-1}, the peers of the mirror
    ports. IPv6 is off everywhere. Every namespace is removed on exit, even after a failure."""

    def __init__(self, prefix: str, macs: list[str], mirror_ports: int, mtu: int = 9000):
        self.sw, self.cpu = f"{prefix}-sw", f"{prefix}-cpu"
        self.nodes = [f"{prefix}-n{i}" for i in range(len(macs))]
        self.macs, self.mirror_ports, self.mtu = macs, mirror_ports, mtu

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _build(self) -> None:
        remove_stale()
        for name in (self.sw, self.cpu, *self.nodes):
            quiet_netns(name)
        with NetNS(self.sw) as sw:
            sw.link("add", ifname="br0", kind="bridge")
            bridge = sw.link_lookup(ifname="br0")[0]
            for i, node in enumerate(self.nodes):
                sw.link("add", ifname=f"p{i}", kind="veth", peer={"ifname": "eth0", "net_ns_fd": node})
                sw.link("set", index=sw.link_lookup(ifname=f"p{i}")[0], master=bridge, mtu=self.mtu, state="up")
            for k in range(self.mirror_ports):
                sw.link("add", ifname=f"m{k}", kind="veth", peer={"ifname": f"c{k}", "net_ns_fd": self.cpu})
                sw.link("set", index=sw.link_lookup(ifname=f"m{k}")[0], mtu=self.mtu, state="up")
            sw.link("set", index=bridge, mtu=self.mtu, state="up")
        for node, mac in zip(self.nodes, self.macs):
            with NetNS(node) as ns:
                ns.link("set", index=ns.link_lookup(ifname="eth0")[0], address=mac, mtu=self.mtu, state="up")
        with NetNS(self.cpu) as ns:
            for k in range(self.mirror_ports):
                ns.link("set", index=ns.link_lookup(ifname=f"c{k}")[0], mtu=self.mtu, state="up")

    def __exit__(self, *exc):
        for name in (self.sw, self.cpu, *self.nodes):
            if name in netns.listnetns():
                netns.remove(name)
