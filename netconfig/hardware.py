"""The cluster's hardware as a topology file lists it: leaf switches and their ports, GPU nodes
and the leaf port of each GPU's NIC, CPU mirror nodes and where their NIC ports are cabled.

These records are shared by :mod:`gradtap.netconfig.topology` (which holds them in a
:class:`~gradtap.netconfig.topology.Topology`) and :mod:`gradtap.netconfig.rail_fabric` (which
generates them from a compact ``rail_fabric`` section). Living here, they let ``rail_fabric``
depend on this module alone and ``topology`` on both, without an import cycle.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Vendor = Literal["sonic", "eos", "nxos", "comware", "junos", "nvue", "linux"]

NAME = r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$"
PORT_NAME = r"^[A-Za-z0-9][-A-Za-z0-9_./:]{0,63}$"
# The kernel's dev_valid_name() (net/core/dev.c): 1..15 bytes (IFNAMSIZ 16 with its NUL), not
# "." or "..", no '/', ':' or whitespace. gradtap narrows that to letters, digits and "_.@+-",
# so a name can never carry a shell metacharacter into a rendered script.
LINUX_IFNAME = (r"^([A-Za-z0-9_@+-]|\.[A-Za-z0-9_@+-]|[A-Za-z0-9_@+-][A-Za-z0-9_.@+-]"   # 1 or 2, not . or ..
                r"|[A-Za-z0-9_.@+-]{3,15})$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SwitchPort(_Model):
    name: str = Field(pattern=PORT_NAME)
    speed_gbps: float = Field(gt=0)
    #: Cabled to the spine layer: never free for a CPU node.
    uplink: bool = False
    #: The Linux interface that is this port, for the ``linux`` vendor (tc / pyroute2).
    linux_ifname: str | None = Field(None, pattern=LINUX_IFNAME)
    #: For a LAG (port-channel, ``ae``, PortChannel, bond, Bridge-Aggregation): its member ports on
    #: the same switch. A mirror source on a LAG mirrors its members; a LAG is never a destination.
    lag_members: list[str] = []


class LeafSwitch(_Model):
    name: str = Field(pattern=NAME)
    vendor: Vendor
    ports: list[SwitchPort] = Field(min_length=1)
    #: Overrides the vendor's default limit on mirror sessions (the ASIC's real limit).
    max_mirror_sessions: int | None = Field(None, ge=1)
    #: First session number for vendors whose sessions are numbered (NX-OS, Comware, NVUE).
    session_id_base: int | None = Field(None, ge=0)
    #: Source address of ERSPAN packets this switch originates.
    erspan_source_ip: IPv4Address | None = None
    #: The routed uplink ERSPAN packets leave by, for platforms that name it (H3C Comware: the
    #: monitor port of a mirroring group in encapsulation parameter mode, whose address is
    #: ``erspan_source_ip``). Must be one of this switch's ``uplink`` ports.
    erspan_monitor_port: str | None = None
    #: Junos only: the switch runs Enhanced Layer 2 Software (``forwarding-options analyzer``:
    #: QFX, EX4300 and later). False for a non-ELS EX switch (EX2200/3300/4200/4500/6200/8200),
    #: which has ``ethernet-switching-options analyzer`` and a single analyzer.
    junos_els: bool = True


class GpuNic(_Model):
    nic: str = Field(pattern=NAME)
    switch: str
    port: str


class GpuNode(_Model):
    name: str = Field(pattern=NAME)
    #: One entry per GPU, in local GPU order; each GPU's NIC and the leaf port it is cabled to.
    gpus: list[GpuNic] = Field(min_length=1)


class CpuPort(_Model):
    nic: str = Field(pattern=NAME)
    switch: str
    port: str
    #: Address that ERSPAN packets are sent to, if this port may receive ERSPAN.
    ip: IPv4Address | None = None


#: What one CPU node can take in, Gbps, unless its topology says otherwise: the memory bandwidth of a
#: two-socket server with eight DDR5-4800 channels per socket (4th/5th-generation Xeon Scalable:
#: 2 x 8 x 4800 MT/s x 8 B = 614.4 GB/s = 4915.2 Gb/s), halved because every mirrored byte crosses
#: memory at least twice (the NIC's DMA write into the capture ring, the parser's read). An upper
#: bound, not a measurement: the parser's writes and the merger's reads add passes. Its PCIe I/O,
#: 160 PCIe 5.0 lanes = ten x16 links of 504.32 Gb/s (32 GT/s x 16 x 128/130), is higher.
#: docs/netconfig.md, "CPU-node ingest".
DEFAULT_MAX_INGEST_GBPS = 2 * 8 * 4800e6 * 8 * 8 / 1e9 / 2

#: A host name or address where a node's peers reach it (RFC 1123 labels, IPv4, or IPv6).
HOST = r"^([A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*|[0-9a-fA-F:.]+)$"


class CpuNode(_Model):
    name: str = Field(pattern=NAME)
    ports: list[CpuPort] = Field(min_length=1)
    #: How many gradtap appliances this node may host: one per DP group with streams on it.
    max_dp_groups: int = Field(1, ge=1)
    #: Mirrored Gbps the node can take in over all its ports together (its host, not its NICs).
    max_ingest_gbps: float = Field(DEFAULT_MAX_INGEST_GBPS, gt=0)
    #: Where the node's mirror-group peers reach it (rank 0 of a group listens here); unset: its name.
    address: str | None = Field(None, pattern=HOST, max_length=253)
    #: The interface its mirror groups' own traffic (gloo over TCP) uses, e.g. a management link.
    group_interface: str | None = Field(None, pattern=LINUX_IFNAME)
