"""What ERSPAN adds to a mirrored frame: the outer packet's size against the path MTU, and the
bandwidth a mirrored stream needs once encapsulated.

A mirrored RoCEv2 frame of ``frame_bytes`` (with its FCS) travels inside::

    outer Ethernet 14 | outer IPv4 20 or IPv6 40 | GRE 8 | ERSPAN header | original frame | FCS 4

- GRE: 4 bytes (RFC 2784) plus the 4-byte sequence number (RFC 2890) that ERSPAN II and III set.
- ERSPAN type II: an 8-byte header; type III: 12 bytes, plus an optional 8-byte
  platform-specific subheader (draft-foschiano-erspan-03, sections 4.1 and 4.2), which is
  counted because a switch may add it.
- Whether a switch keeps the original frame's FCS inside varies by platform; it is counted.

The outer IP packet (IP header onwards) must fit the smallest IP MTU of the routed path, or
the switch drops (or fragments) it. On the wire every frame also costs 8 bytes of preamble and
start delimiter and a 12-byte inter-frame gap (IEEE 802.3 clause 4.4.2), so the encapsulated
stream's rate is the source's times (frame + 20 + overhead) / (frame + 20).
"""

from __future__ import annotations

from gradtap.netconfig.plan import Encapsulation

ETHERNET_HEADER = 14
FCS = 4
#: Preamble + start-of-frame delimiter (8) and the minimum inter-frame gap (12), per frame.
PREAMBLE_AND_GAP = 20
IP_HEADER = {4: 20, 6: 40}
#: RFC 2784 base header + RFC 2890 sequence number.
GRE_WITH_SEQUENCE = 8
ERSPAN_HEADER: dict[str, int] = {"erspan2": 8, "erspan3": 12 + 8}


def outer_ip_bytes(frame_bytes: int, encapsulation: Encapsulation, ip_version: int) -> int:
    """Length of the outer IP packet carrying one mirrored frame of ``frame_bytes`` (with FCS)."""
    return IP_HEADER[ip_version] + GRE_WITH_SEQUENCE + ERSPAN_HEADER[encapsulation] + frame_bytes


def overhead_bytes(encapsulation: Encapsulation, ip_version: int) -> int:
    """Bytes ERSPAN adds to each mirrored frame on the wire (0 for a switch-local mirror)."""
    if encapsulation == "none":
        return 0
    return ETHERNET_HEADER + FCS + IP_HEADER[ip_version] + GRE_WITH_SEQUENCE + ERSPAN_HEADER[encapsulation]


def mirrored_gbps(source_gbps: float, frame_bytes: int, encapsulation: Encapsulation, ip_version: int = 4) -> float:
    """Rate of a stream of ``frame_bytes`` frames at ``source_gbps`` once mirrored with ``encapsulation``."""
    on_wire = frame_bytes + PREAMBLE_AND_GAP
    return source_gbps * (on_wire + overhead_bytes(encapsulation, ip_version)) / on_wire
