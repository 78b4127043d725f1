"""Stage 1 of the parser: every frame of a batch to one :data:`FRAME_DTYPE` record and one event.

The walk follows the wire, one declared header at a time (``wire/headers``): Ethernet II,
any number of 802.1Q/802.1ad tags, IPv4 (unfragmented) or IPv6, UDP to port 4791, the BTH,
then the extended transport headers the opcode carries (``OPCODE_*`` tables), the pad and the
ICRC. Every offset and mask comes from those declarations.

Encapsulation. With ``decapsulate`` (a mirror stream that arrives over L3), an IP packet of
protocol 47 is opened: its GRE header (``gre.py``: optional checksum, key and sequence number)
and, after GRE protocol 0x88BE or 0x22EB, the ERSPAN header (``erspan.py``: none for type I,
type II, type III with its optional subheader). The Ethernet frame it carries is then walked
exactly as a plain frame from its first byte, ending where the outer IP datagram ends; the
record describes that inner frame, plus ``erspan_type``, ``erspan_session`` and ``gre_seq``.
The inner frame counts as cut short when the outer one was cut inside it or the ERSPAN header
says the switch truncated it (``t``). Only one level is opened: GRE inside the inner frame is
``other.non_udp``, as is every GRE packet without ``decapsulate``. A plain frame pays nothing
for this: the GRE test sits behind the IP protocol's test for UDP.

Mirrored frames are untrusted. Every read is checked against the frame's captured end
(``offsets[i] + caplens[i]``) before it happens; length fields are only ever compared, never
used to read past that end. A frame ends in exactly one event of ``wire/events.py``:

- ``decode.ok``: a complete RoCEv2 packet; every field of the record is valid and the ICRC
  matched (or was not checked: ``icrc`` is then ``ICRC_UNCHECKED``; or its check was left to
  stage 2, ``defer_icrc``: ``ICRC_DEFERRED`` until :func:`settle_icrc`).
- ``decode.icrc_bad``: the same, but the ICRC did not match (fields filled all the same).
- ``other.*``: a well-formed frame that is not RoCEv2 (ARP, TCP, UDP to another port ...).
- ``decode.*``: malformed at the layer the event names.

Truncation. A frame whose captured length is shorter than its length on the wire (a snap
length, a mirror that cuts frames) is ``decode.frame_truncated`` as soon as a header it needs
lies past the captured bytes, or when its RoCEv2 packet ends past them; it is
``other.*`` if the captured bytes already show it is not RoCEv2, and a malformation visible in
the captured bytes keeps its own event. The IP and UDP lengths of such a frame are checked
against each other, not against the captured length. Its record holds what was captured:
when the BTH was, ``payload_off``/``payload_len`` describe the payload as the UDP length
declares it (not all of it is in ``data``). ``decode.*_truncated`` for a layer means the
frame was captured whole and its own length fields do not fit.

Which frames are RoCEv2 (:func:`is_roce`): those whose BTH was read, i.e. ``payload_off >= 0``
(every record starts with ``payload_off = -1``). That includes unknown opcodes (0xaa in
``rdma32.pcapng``), bad ICRCs and truncated packets, as tshark counts them. For an unknown
opcode no extension header is known, so ``payload_off`` is the byte after the BTH.

The ICRC is checked on every complete RoCEv2 packet, unknown opcodes included (so 0xaa
frames show ``icrc == ICRC_BAD``), unless ``verify_icrc`` is off.

Three layers (stumpy style): :func:`decode_frame` (serial, one frame), :func:`decode_parts`
(``prange`` over contiguous parts of the batch, each part with its own counter row) and
:func:`decode_batch`, which validates its input (:func:`check_batch`).
"""

from __future__ import annotations

import ipaddress

import numba
import numpy as np
from numba import njit, prange

from gradtap.capture.frames import LINKTYPE_ETHERNET, FrameBatch
from gradtap.core.bytes import read_be, read_be_u64, read_le
from gradtap.core.jit import JIT, JIT_NO_REFCOUNT, JIT_PARALLEL
from gradtap.core.memory import CACHE_LINE, prefetch_bytes
from gradtap.wire.crc_fold import FOLDS
from gradtap.wire.events import (DECODE_BAD_PADDING, DECODE_BTH_TRUNCATED, DECODE_BTH_UNKNOWN_OPCODE,
                           DECODE_ERSPAN_BAD_VERSION, DECODE_ERSPAN_TRUNCATED, DECODE_ERSPAN_UNSUPPORTED,
                           DECODE_ETH_TRUNCATED, DECODE_EXT_TRUNCATED, DECODE_FRAME_TRUNCATED,
                           DECODE_GRE_TRUNCATED, DECODE_GRE_UNSUPPORTED,
                           DECODE_ICRC_BAD, DECODE_IPV4_BAD_HEADER, DECODE_IPV4_FRAGMENT,
                           DECODE_IPV4_TRUNCATED, DECODE_IPV6_BAD_HEADER, DECODE_IPV6_TRUNCATED,
                           DECODE_OK, DECODE_PAYLOAD_UNEXPECTED, DECODE_UDP_BAD_LENGTH,
                           DECODE_UDP_TRUNCATED, N_EVENTS, OTHER_NON_IP, OTHER_NON_ROCE,
                           OTHER_NON_UDP)
from gradtap.wire.frame_record import FRAME_DTYPE, ICRC_BAD, ICRC_DEFERRED, ICRC_OK, ICRC_UNCHECKED
from gradtap.wire.headers.aeth import AETH_OFF_SYNDROME, AETH_SIZE_SYNDROME
from gradtap.wire.headers.bth import (BTH_ACKREQ_MASK, BTH_ACKREQ_SHIFT, BTH_DESTQP_MASK,
                                BTH_DESTQP_SHIFT, BTH_LEN, BTH_OFF_ACKREQ, BTH_OFF_DESTQP,
                                BTH_OFF_OPCODE, BTH_OFF_PADCNT, BTH_OFF_PSN, BTH_PADCNT_MASK,
                                BTH_PADCNT_SHIFT, BTH_PSN_MASK, BTH_PSN_SHIFT, BTH_SIZE_ACKREQ,
                                BTH_SIZE_DESTQP, BTH_SIZE_OPCODE, BTH_SIZE_PADCNT, BTH_SIZE_PSN)
from gradtap.wire.headers.erspan import (ERSPAN2_LEN, ERSPAN2_OFF_SESSION, ERSPAN2_OFF_T,
                                   ERSPAN2_OFF_VERSION, ERSPAN2_SESSION_MASK, ERSPAN2_SESSION_SHIFT,
                                   ERSPAN2_SIZE_SESSION, ERSPAN2_SIZE_T, ERSPAN2_SIZE_VERSION,
                                   ERSPAN2_T_MASK, ERSPAN2_T_SHIFT, ERSPAN2_VERSION_MASK,
                                   ERSPAN2_VERSION_SHIFT, ERSPAN3_FT_MASK, ERSPAN3_FT_SHIFT,
                                   ERSPAN3_LEN, ERSPAN3_O_MASK, ERSPAN3_O_SHIFT, ERSPAN3_OFF_FT,
                                   ERSPAN3_OFF_O, ERSPAN3_OFF_SESSION, ERSPAN3_OFF_T,
                                   ERSPAN3_OFF_VERSION, ERSPAN3_SESSION_MASK, ERSPAN3_SESSION_SHIFT,
                                   ERSPAN3_SIZE_FT, ERSPAN3_SIZE_O, ERSPAN3_SIZE_SESSION,
                                   ERSPAN3_SIZE_T, ERSPAN3_SIZE_VERSION, ERSPAN3_SUB_LEN,
                                   ERSPAN3_T_MASK, ERSPAN3_T_SHIFT, ERSPAN3_VERSION_MASK,
                                   ERSPAN3_VERSION_SHIFT, ERSPAN_FT_ETHERNET, ERSPAN_NONE,
                                   ERSPAN_TYPE_I, ERSPAN_TYPE_II, ERSPAN_TYPE_III, ERSPAN_VERSION_II,
                                   ERSPAN_VERSION_III)
from gradtap.wire.headers.eth import (ETH_LEN, ETH_OFF_TYPE, ETH_SIZE_TYPE, ETHERTYPE_IPV4,
                                ETHERTYPE_IPV6, ETHERTYPE_QINQ, ETHERTYPE_VLAN, VLAN_LEN,
                                VLAN_OFF_TYPE, VLAN_OFF_VID, VLAN_SIZE_TYPE, VLAN_SIZE_VID,
                                VLAN_VID_MASK, VLAN_VID_SHIFT)
from gradtap.wire.headers.gre import (GRE_C_MASK, GRE_C_SHIFT, GRE_CHECKSUM_LEN, GRE_K_MASK,
                                GRE_K_SHIFT, GRE_KEY_LEN, GRE_LEN, GRE_OFF_C, GRE_OFF_K,
                                GRE_OFF_PROTO, GRE_OFF_R, GRE_OFF_S, GRE_OFF_VERSION,
                                GRE_PROTO_ERSPAN2, GRE_PROTO_ERSPAN3, GRE_R_MASK, GRE_R_SHIFT,
                                GRE_S_MASK, GRE_S_SHIFT, GRE_SEQ_LEN, GRE_SEQ_OFF_SEQ,
                                GRE_SEQ_SIZE_SEQ, GRE_SIZE_C, GRE_SIZE_K, GRE_SIZE_PROTO,
                                GRE_SIZE_R, GRE_SIZE_S, GRE_SIZE_VERSION, GRE_VERSION_MASK,
                                GRE_VERSION_SHIFT, IPPROTO_GRE)
from gradtap.wire.headers.immdt import IMMDT_OFF_IMM, IMMDT_SIZE_IMM
from gradtap.wire.headers.ipv4 import (IPPROTO_UDP, IPV4_FLAGS_MASK, IPV4_FLAGS_SHIFT,
                                 IPV4_FRAG_OFFSET_MASK, IPV4_FRAG_OFFSET_SHIFT, IPV4_IHL_MASK,
                                 IPV4_IHL_SHIFT, IPV4_LEN, IPV4_OFF_DST, IPV4_OFF_FLAGS,
                                 IPV4_OFF_FRAG_OFFSET, IPV4_OFF_IHL, IPV4_OFF_PROTO, IPV4_OFF_SRC,
                                 IPV4_OFF_TOTAL_LENGTH, IPV4_OFF_VERSION, IPV4_SIZE_DST,
                                 IPV4_SIZE_FLAGS, IPV4_SIZE_SRC, IPV4_SIZE_FRAG_OFFSET, IPV4_SIZE_IHL,
                                 IPV4_SIZE_PROTO, IPV4_SIZE_TOTAL_LENGTH, IPV4_SIZE_VERSION,
                                 IPV4_VERSION_MASK, IPV4_VERSION_SHIFT)
from gradtap.wire.headers.ipv6 import (IPV6_LEN, IPV6_OFF_DST, IPV6_OFF_NEXT_HEADER,
                                 IPV6_OFF_PAYLOAD_LENGTH, IPV6_OFF_SRC, IPV6_OFF_VERSION,
                                 IPV6_SIZE_DST, IPV6_SIZE_NEXT_HEADER, IPV6_SIZE_PAYLOAD_LENGTH,
                                 IPV6_SIZE_SRC, IPV6_SIZE_VERSION, IPV6_VERSION_MASK, IPV6_VERSION_SHIFT)
from gradtap.wire.headers.opcodes import (OPCODE_AETH_OFF, OPCODE_EXT_LEN, OPCODE_IMMDT_OFF,
                                    OPCODE_PAYLOAD, OPCODE_RETH_OFF, OPCODE_VALID)
from gradtap.wire.headers.reth import (RETH_OFF_DMA_LENGTH, RETH_OFF_RKEY, RETH_OFF_VA,
                                 RETH_SIZE_DMA_LENGTH, RETH_SIZE_RKEY, RETH_SIZE_VA)
from gradtap.wire.headers.udp import (ROCEV2_UDP_PORT, UDP_LEN, UDP_OFF_DPORT, UDP_OFF_LENGTH,
                                UDP_OFF_SPORT, UDP_SIZE_DPORT, UDP_SIZE_LENGTH, UDP_SIZE_SPORT)
from gradtap.wire.icrc import ICRC_LEN, icrc_and_payload_crc

IPV4_WORD = 4      # RFC 791 §3.1: the IHL counts 32-bit words
IPV4_FLAG_MF = 1   # RFC 791 §3.1: "More Fragments", the last of the three flag bits
# What stage 1 does with the ICRC of a complete packet: nothing, check it, or leave a
# ``decode.ok`` packet's to stage 2 (``ICRC_DEFERRED``; :func:`settle_icrc`).
VERIFY_OFF, VERIFY_NOW, VERIFY_LATER = 0, 1, 2
# Frames ahead fetched into the cache while this one is decoded, when its ICRC is checked
# here: the ICRC reads the whole frame from memory first, and the hardware's stream
# prefetchers stop at every 4 KiB page, so each frame began with a full memory latency. One
# stream of GPT-2 small from memory, ICRC on, 2 threads: 0.103-0.106 s without, 0.092-0.093
# two frames ahead (3 alternations). Where the ICRC runs in gradtap's own fold
# (``wire/crc_fold.py``: hosts with AVX2 and vpclmulqdq), the fold asks for the lines 4 KiB ahead
# as it goes, the next frame included, and 64 more requests at once only crowd them (as in
# stage 2, ``parser/assemble.py``'s ``AHEAD``): the same stream (``r0-egress`` of
# ``benchmarks.replay``'s capture, 1.74 GB of payload, 2 threads, AMD EPYC Zen 3; alternated 5
# times, the best of 5 each) decoded in 0.111-0.141 s asking only for the frame at hand
# (``AHEAD`` 0) against 0.145-0.179 s two ahead, and parsed whole (stages 1 and 2) in
# 0.224-0.274 s against 0.260-0.299 s. Asking for nothing at all was no better (alternated
# twice: 0.138-0.142 s and 0.263-0.278 s, against 0.122-0.134 s and 0.250-0.267 s).
AHEAD = 0 if FOLDS else 2
# Without the check (off, or left to stage 2), a frame's headers alone are read: the first
# two cache lines of the frame ``HEADERS_AHEAD`` ahead are fetched instead. On a Xeon (family
# 6 model 207, KVM) one stream of GPT-2 small, walked and decoded in batches of 8192 frames,
# took 0.067-0.070 s against 0.076-0.086 without (2 alternations; 8 or 16 ahead: the same),
# and the parse of the GPT-2 replay's 2 iterations 1.009-1.058 thread-s against 1.016-1.202
# (median of 4 replays, 3 alternations). On an AMD EPYC (Zen 5) it gained nothing: 0.063-0.064
# s against 0.064-0.065.
HEADERS_AHEAD = 4
HEADER_BYTES = 2 * CACHE_LINE
# RFC 4291 §2.5.5.2: an IPv4 address a.b.c.d is stored as the IPv6 address ::ffff:a.b.c.d.
V4_MAPPED_PREFIX = np.frombuffer(ipaddress.IPv6Address("::ffff:0.0.0.0").packed, np.uint8)[
    :IPV6_SIZE_DST - IPV4_SIZE_DST].copy()


@njit(**JIT, inline="always")
def _field(data, pos, size, mask, shift):
    """A bit-field declared in a header layout: ``(word & mask) >> shift``."""
    return (read_be(data, pos, size) & mask) >> shift


@njit(**JIT, inline="always")
def _short(cut, event):
    """A header lies past the captured bytes: the frame was cut short if the wire says so,
    otherwise its own length fields are wrong (``event``)."""
    return DECODE_FRAME_TRUNCATED if cut else event


@njit(**JIT, inline="always")
def _clear(rec):
    rec["event"] = 0
    rec["ip_version"] = 0
    rec["opcode"] = 0
    rec["padcnt"] = 0
    rec["ackreq"] = 0
    rec["icrc"] = ICRC_UNCHECKED
    rec["vlan"] = 0
    rec["udp_sport"] = 0
    rec["dest_qp"] = 0
    rec["psn"] = 0
    for k in range(IPV6_SIZE_SRC):
        rec["src_ip"][k] = 0
        rec["dst_ip"][k] = 0
    rec["reth_va"] = 0
    rec["reth_rkey"] = 0
    rec["reth_len"] = 0
    rec["imm"] = 0
    rec["aeth"] = 0
    rec["l3_off"] = -1
    rec["payload_off"] = -1
    rec["payload_len"] = 0
    rec["payload_crc"] = -1
    rec["erspan_type"] = ERSPAN_NONE
    rec["erspan_session"] = -1
    rec["gre_seq"] = -1


@njit(**JIT, inline="always")
def _clear_outer(rec):
    """Forget the outer frame's tag and addresses: the record describes the inner frame."""
    rec["vlan"] = 0
    rec["ip_version"] = 0
    for k in range(IPV6_SIZE_SRC):
        rec["src_ip"][k] = 0
        rec["dst_ip"][k] = 0


@njit(**JIT, inline="always")
def _bounded(end, ip_end, cap_end, event):
    """A header ending at ``end``: ``event`` when the IP datagram ends before it, frame
    truncation when only the captured bytes do, else DECODE_OK."""
    if end > ip_end:
        return event
    if end > cap_end:
        return DECODE_FRAME_TRUNCATED
    return DECODE_OK


@njit(**JIT)
def _open_gre(data, gre, ip_end, cap_end, rec):
    """The GRE header at ``gre`` and the ERSPAN header its protocol names.

    Returns ``(event, inner, truncated)``: ``DECODE_OK``, the first byte of the Ethernet
    frame they carry and whether the switch truncated it (ERSPAN ``t``), or the event that
    stops the frame. ``ip_end`` ends the outer IP datagram, ``cap_end`` the captured bytes.
    """
    event = _bounded(gre + GRE_LEN, ip_end, cap_end, DECODE_GRE_TRUNCATED)
    if event != DECODE_OK:
        return event, 0, False
    proto = read_be(data, gre + GRE_OFF_PROTO, GRE_SIZE_PROTO)
    if _field(data, gre + GRE_OFF_VERSION, GRE_SIZE_VERSION, GRE_VERSION_MASK, GRE_VERSION_SHIFT) != 0 \
            or _field(data, gre + GRE_OFF_R, GRE_SIZE_R, GRE_R_MASK, GRE_R_SHIFT) \
            or (proto != GRE_PROTO_ERSPAN2 and proto != GRE_PROTO_ERSPAN3):
        return DECODE_GRE_UNSUPPORTED, 0, False
    has_seq = _field(data, gre + GRE_OFF_S, GRE_SIZE_S, GRE_S_MASK, GRE_S_SHIFT)
    # The optional words, in wire order: checksum + reserved1, key, sequence number.
    erspan = gre + GRE_LEN \
        + GRE_CHECKSUM_LEN * _field(data, gre + GRE_OFF_C, GRE_SIZE_C, GRE_C_MASK, GRE_C_SHIFT) \
        + GRE_KEY_LEN * _field(data, gre + GRE_OFF_K, GRE_SIZE_K, GRE_K_MASK, GRE_K_SHIFT) \
        + GRE_SEQ_LEN * has_seq
    event = _bounded(erspan, ip_end, cap_end, DECODE_GRE_TRUNCATED)
    if event != DECODE_OK:
        return event, 0, False
    if has_seq:
        rec["gre_seq"] = read_be(data, erspan - GRE_SEQ_LEN + GRE_SEQ_OFF_SEQ, GRE_SEQ_SIZE_SEQ)
    if proto == GRE_PROTO_ERSPAN2:
        if not has_seq:
            rec["erspan_type"] = ERSPAN_TYPE_I     # no ERSPAN header: the frame follows GRE
            return DECODE_OK, erspan, False
        rec["erspan_type"] = ERSPAN_TYPE_II
        inner = erspan + ERSPAN2_LEN
        event = _bounded(inner, ip_end, cap_end, DECODE_ERSPAN_TRUNCATED)
        if event != DECODE_OK:
            return event, 0, False
        if _field(data, erspan + ERSPAN2_OFF_VERSION, ERSPAN2_SIZE_VERSION, ERSPAN2_VERSION_MASK,
                  ERSPAN2_VERSION_SHIFT) != ERSPAN_VERSION_II:
            return DECODE_ERSPAN_BAD_VERSION, 0, False
        rec["erspan_session"] = _field(data, erspan + ERSPAN2_OFF_SESSION, ERSPAN2_SIZE_SESSION,
                                       ERSPAN2_SESSION_MASK, ERSPAN2_SESSION_SHIFT)
        return DECODE_OK, inner, _field(data, erspan + ERSPAN2_OFF_T, ERSPAN2_SIZE_T, ERSPAN2_T_MASK,
                                        ERSPAN2_T_SHIFT) != 0
    rec["erspan_type"] = ERSPAN_TYPE_III
    inner = erspan + ERSPAN3_LEN
    event = _bounded(inner, ip_end, cap_end, DECODE_ERSPAN_TRUNCATED)
    if event != DECODE_OK:
        return event, 0, False
    if _field(data, erspan + ERSPAN3_OFF_VERSION, ERSPAN3_SIZE_VERSION, ERSPAN3_VERSION_MASK,
              ERSPAN3_VERSION_SHIFT) != ERSPAN_VERSION_III:
        return DECODE_ERSPAN_BAD_VERSION, 0, False
    rec["erspan_session"] = _field(data, erspan + ERSPAN3_OFF_SESSION, ERSPAN3_SIZE_SESSION,
                                   ERSPAN3_SESSION_MASK, ERSPAN3_SESSION_SHIFT)
    if _field(data, erspan + ERSPAN3_OFF_FT, ERSPAN3_SIZE_FT, ERSPAN3_FT_MASK,
              ERSPAN3_FT_SHIFT) != ERSPAN_FT_ETHERNET:
        return DECODE_ERSPAN_UNSUPPORTED, 0, False
    if _field(data, erspan + ERSPAN3_OFF_O, ERSPAN3_SIZE_O, ERSPAN3_O_MASK, ERSPAN3_O_SHIFT):
        inner += ERSPAN3_SUB_LEN    # the platform-specific subheader
        event = _bounded(inner, ip_end, cap_end, DECODE_ERSPAN_TRUNCATED)
        if event != DECODE_OK:
            return event, 0, False
    return DECODE_OK, inner, _field(data, erspan + ERSPAN3_OFF_T, ERSPAN3_SIZE_T, ERSPAN3_T_MASK,
                                    ERSPAN3_T_SHIFT) != 0


@njit(**JIT, inline="always")
def _check_icrc(data, l3, is_ipv6, end, rec):
    """Check the ICRC of a record's frame whose payload is located; a good one leaves the
    payload's own CRC in the record, for comparing copies of it (``parser/assemble.py``)."""
    crc, payload_crc = icrc_and_payload_crc(data, l3, is_ipv6, rec["payload_off"], rec["payload_len"], end)
    ok = crc == read_le(data, end - ICRC_LEN, ICRC_LEN)
    rec["icrc"] = ICRC_OK if ok else ICRC_BAD
    rec["payload_crc"] = payload_crc if ok else -1


@njit(**JIT)
def _walk(data, start, caplen, wirelen, verify_icrc, decapsulate, rec):
    """The body of :func:`decode_frame`; returns the event at the first thing that stops it."""
    cap_end = start + caplen
    cut = caplen < wirelen
    # One round per Ethernet frame: the captured one, then (``decapsulate``) the one that
    # GRE/ERSPAN carries; a plain frame leaves at its UDP header in the first round.
    while True:
        if start + ETH_LEN > cap_end:
            return _short(cut, DECODE_ETH_TRUNCATED)
        ethertype = read_be(data, start + ETH_OFF_TYPE, ETH_SIZE_TYPE)
        pos = start + ETH_LEN
        tagged = False
        # Each tag moves ``pos`` on by VLAN_LEN, so the loop ends within caplen / VLAN_LEN rounds.
        while ethertype == ETHERTYPE_VLAN or ethertype == ETHERTYPE_QINQ:
            if pos + VLAN_LEN > cap_end:
                return _short(cut, DECODE_ETH_TRUNCATED)
            if not tagged:
                rec["vlan"] = _field(data, pos + VLAN_OFF_VID, VLAN_SIZE_VID, VLAN_VID_MASK,
                                  VLAN_VID_SHIFT)
                tagged = True
            ethertype = read_be(data, pos + VLAN_OFF_TYPE, VLAN_SIZE_TYPE)
            pos += VLAN_LEN

        l3 = pos
        is_ipv6 = ethertype == ETHERTYPE_IPV6
        if ethertype == ETHERTYPE_IPV4:
            if l3 + IPV4_LEN > cap_end:
                return _short(cut, DECODE_IPV4_TRUNCATED)
            hlen = IPV4_WORD * _field(data, l3 + IPV4_OFF_IHL, IPV4_SIZE_IHL, IPV4_IHL_MASK,
                                      IPV4_IHL_SHIFT)
            if _field(data, l3 + IPV4_OFF_VERSION, IPV4_SIZE_VERSION, IPV4_VERSION_MASK,
                      IPV4_VERSION_SHIFT) != 4 or hlen < IPV4_LEN:
                return DECODE_IPV4_BAD_HEADER
            total = read_be(data, l3 + IPV4_OFF_TOTAL_LENGTH, IPV4_SIZE_TOTAL_LENGTH)
            if total < hlen:
                return DECODE_IPV4_BAD_HEADER
            ip_end = l3 + total
            if ip_end > cap_end and not cut:
                return DECODE_IPV4_TRUNCATED
            if l3 + hlen > cap_end:
                return DECODE_FRAME_TRUNCATED  # options cut off (only a cut frame gets here)
            flags = _field(data, l3 + IPV4_OFF_FLAGS, IPV4_SIZE_FLAGS, IPV4_FLAGS_MASK,
                           IPV4_FLAGS_SHIFT)
            if flags & IPV4_FLAG_MF or _field(data, l3 + IPV4_OFF_FRAG_OFFSET, IPV4_SIZE_FRAG_OFFSET,
                                              IPV4_FRAG_OFFSET_MASK, IPV4_FRAG_OFFSET_SHIFT):
                return DECODE_IPV4_FRAGMENT
            rec["ip_version"] = 4
            prefix = len(V4_MAPPED_PREFIX)
            for k in range(prefix):
                rec["src_ip"][k] = V4_MAPPED_PREFIX[k]
                rec["dst_ip"][k] = V4_MAPPED_PREFIX[k]
            for k in range(IPV4_SIZE_SRC):
                rec["src_ip"][prefix + k] = data[l3 + IPV4_OFF_SRC + k]
                rec["dst_ip"][prefix + k] = data[l3 + IPV4_OFF_DST + k]
            proto = read_be(data, l3 + IPV4_OFF_PROTO, IPV4_SIZE_PROTO)
            l4 = l3 + hlen
        elif is_ipv6:
            if l3 + IPV6_LEN > cap_end:
                return _short(cut, DECODE_IPV6_TRUNCATED)
            if _field(data, l3 + IPV6_OFF_VERSION, IPV6_SIZE_VERSION, IPV6_VERSION_MASK,
                      IPV6_VERSION_SHIFT) != 6:
                return DECODE_IPV6_BAD_HEADER
            ip_end = l3 + IPV6_LEN + read_be(data, l3 + IPV6_OFF_PAYLOAD_LENGTH, IPV6_SIZE_PAYLOAD_LENGTH)
            if ip_end > cap_end and not cut:
                return DECODE_IPV6_TRUNCATED
            rec["ip_version"] = 6
            for k in range(IPV6_SIZE_SRC):
                rec["src_ip"][k] = data[l3 + IPV6_OFF_SRC + k]
                rec["dst_ip"][k] = data[l3 + IPV6_OFF_DST + k]
            # RoCEv2 (and GRE here) follows the fixed header; an extension header is neither.
            proto = read_be(data, l3 + IPV6_OFF_NEXT_HEADER, IPV6_SIZE_NEXT_HEADER)
            l4 = l3 + IPV6_LEN
        else:
            return OTHER_NON_IP
        if proto == IPPROTO_UDP:
            rec["l3_off"] = l3
            break
        if proto != IPPROTO_GRE or not decapsulate or rec["erspan_type"] != ERSPAN_NONE:
            return OTHER_NON_UDP
        event, start, truncated = _open_gre(data, l4, ip_end, cap_end, rec)
        if event != DECODE_OK:
            return event
        # The inner frame ends with the datagram that carries it; it was cut short if the
        # capture cut into it or the switch truncated it.
        cut = (cut and ip_end > cap_end) or truncated
        cap_end = min(cap_end, ip_end)
        _clear_outer(rec)

    if l4 + UDP_LEN > ip_end:
        return DECODE_UDP_TRUNCATED
    if l4 + UDP_LEN > cap_end:
        return DECODE_FRAME_TRUNCATED
    rec["udp_sport"] = read_be(data, l4 + UDP_OFF_SPORT, UDP_SIZE_SPORT)
    if read_be(data, l4 + UDP_OFF_DPORT, UDP_SIZE_DPORT) != ROCEV2_UDP_PORT:
        return OTHER_NON_ROCE
    udp_len = read_be(data, l4 + UDP_OFF_LENGTH, UDP_SIZE_LENGTH)
    if udp_len < UDP_LEN or l4 + udp_len > ip_end:
        return DECODE_UDP_BAD_LENGTH
    end = l4 + udp_len  # one past the ICRC
    bth = l4 + UDP_LEN
    if end - bth < BTH_LEN + ICRC_LEN:
        return DECODE_BTH_TRUNCATED
    if bth + BTH_LEN > cap_end:
        return DECODE_FRAME_TRUNCATED

    opcode = read_be(data, bth + BTH_OFF_OPCODE, BTH_SIZE_OPCODE)
    padcnt = _field(data, bth + BTH_OFF_PADCNT, BTH_SIZE_PADCNT, BTH_PADCNT_MASK, BTH_PADCNT_SHIFT)
    rec["opcode"] = opcode
    rec["padcnt"] = padcnt
    rec["ackreq"] = _field(data, bth + BTH_OFF_ACKREQ, BTH_SIZE_ACKREQ, BTH_ACKREQ_MASK,
                        BTH_ACKREQ_SHIFT)
    rec["dest_qp"] = _field(data, bth + BTH_OFF_DESTQP, BTH_SIZE_DESTQP, BTH_DESTQP_MASK,
                         BTH_DESTQP_SHIFT)
    rec["psn"] = _field(data, bth + BTH_OFF_PSN, BTH_SIZE_PSN, BTH_PSN_MASK, BTH_PSN_SHIFT)
    complete = end <= cap_end
    ext = bth + BTH_LEN
    payload_end = end - ICRC_LEN - padcnt
    if not OPCODE_VALID[opcode]:
        rec["payload_off"] = ext
        rec["payload_len"] = max(payload_end - ext, 0)
        if complete and verify_icrc:
            _check_icrc(data, l3, is_ipv6, end, rec)
        return DECODE_BTH_UNKNOWN_OPCODE

    payload_off = ext + OPCODE_EXT_LEN[opcode]
    payload_len = payload_end - payload_off
    rec["payload_off"] = payload_off
    rec["payload_len"] = max(payload_len, 0)
    if payload_off > end - ICRC_LEN:
        return DECODE_EXT_TRUNCATED
    if payload_off <= cap_end:
        if OPCODE_RETH_OFF[opcode] >= 0:
            reth = ext + OPCODE_RETH_OFF[opcode]
            rec["reth_va"] = read_be_u64(data, reth + RETH_OFF_VA, RETH_SIZE_VA)
            rec["reth_rkey"] = read_be(data, reth + RETH_OFF_RKEY, RETH_SIZE_RKEY)
            rec["reth_len"] = read_be(data, reth + RETH_OFF_DMA_LENGTH, RETH_SIZE_DMA_LENGTH)
        if OPCODE_IMMDT_OFF[opcode] >= 0:
            rec["imm"] = read_be(data, ext + OPCODE_IMMDT_OFF[opcode] + IMMDT_OFF_IMM, IMMDT_SIZE_IMM)
        if OPCODE_AETH_OFF[opcode] >= 0:
            # The record keeps the whole word: syndrome << 24 | MSN.
            rec["aeth"] = read_be(data, ext + OPCODE_AETH_OFF[opcode] + AETH_OFF_SYNDROME,
                           AETH_SIZE_SYNDROME)
    if payload_len < 0:
        return DECODE_BAD_PADDING
    if not OPCODE_PAYLOAD[opcode] and payload_len != 0:
        return DECODE_PAYLOAD_UNEXPECTED
    if not complete:
        return DECODE_FRAME_TRUNCATED
    if verify_icrc == VERIFY_LATER:
        rec["icrc"] = ICRC_DEFERRED
    elif verify_icrc:
        _check_icrc(data, l3, is_ipv6, end, rec)
        if rec["icrc"] == ICRC_BAD:
            return DECODE_ICRC_BAD
    return DECODE_OK


@njit(**JIT)
def settle_icrc(data, rec):
    """Check the ICRC stage 1 left to stage 2 (``rec["icrc"] == ICRC_DEFERRED``, a
    ``decode.ok`` record of a frame in ``data``); a bad one turns the record into
    ``decode.icrc_bad``, as stage 1 would have. Returns the record's event."""
    if rec["icrc"] == ICRC_DEFERRED:
        end = rec["payload_off"] + rec["payload_len"] + rec["padcnt"] + ICRC_LEN
        _check_icrc(data, rec["l3_off"], rec["ip_version"] == 6, end, rec)
        if rec["icrc"] == ICRC_BAD:
            rec["event"] = DECODE_ICRC_BAD
    return rec["event"]


@njit(**JIT)
def decode_frame(data, start, caplen, wirelen, verify_icrc, decapsulate, rec):
    """Decode the frame ``data[start:start + caplen]`` into ``rec`` and return its event.

    Parameters
    ----------
    data:
        ``uint8[m]``, C-contiguous; the frame must lie inside it (the caller checks).
    start, caplen, wirelen:
        The frame's first byte, its captured length and its length on the wire (bytes).
    verify_icrc:
        ``VERIFY_OFF``, ``VERIFY_NOW`` (check the ICRC of complete RoCEv2 packets) or
        ``VERIFY_LATER`` (as ``VERIFY_NOW``, but a ``decode.ok`` packet's check is left to
        :func:`settle_icrc`).
    decapsulate:
        Open GRE/ERSPAN packets and decode the Ethernet frame they carry.
    rec:
        One :data:`FRAME_DTYPE` record, overwritten (all fields but ``ts_ns``).
    """
    _clear(rec)
    event = _walk(data, start, caplen, wirelen, verify_icrc, decapsulate, rec)
    rec["event"] = event
    return event


@njit(**JIT_NO_REFCOUNT)
def decode_run(data, offsets, caplens, wirelens, ts_ns, verify_icrc, decapsulate, out, counts, start, stop):
    """Decode frames ``start:stop`` of a batch checked by :func:`check_batch` into the same rows
    of ``out``, on the calling thread, counting their events in ``counts`` (``int64[N_EVENTS]``).
    Without reference counting (``core/jit.py``): the arrays pass to every frame's call."""
    for i in range(start, stop):
        if verify_icrc == VERIFY_NOW:
            if i + AHEAD < stop:
                prefetch_bytes(data, offsets[i + AHEAD], offsets[i + AHEAD] + caplens[i + AHEAD])
        elif i + HEADERS_AHEAD < stop:
            j = i + HEADERS_AHEAD
            prefetch_bytes(data, offsets[j], offsets[j] + min(caplens[j], HEADER_BYTES))
        rec = out[i]
        event = decode_frame(data, offsets[i], caplens[i], wirelens[i], verify_icrc, decapsulate, rec)
        rec["ts_ns"] = ts_ns[i]
        counts[event] += 1


@njit(**JIT_PARALLEL)
def decode_parts(data, offsets, caplens, wirelens, ts_ns, verify_icrc, decapsulate, out, counters):
    """Decode every frame of a batch checked by :func:`check_batch` into ``out`` (one
    :data:`FRAME_DTYPE` record each); part ``p`` of ``counters.shape[0]`` contiguous parts counts
    its events in ``counters[p]`` only, so threads never share a counter."""
    n = len(offsets)
    parts = counters.shape[0]
    for p in prange(parts):
        decode_run(data, offsets, caplens, wirelens, ts_ns, verify_icrc, decapsulate, out, counters[p],
                   p * n // parts, (p + 1) * n // parts)


def decode_batch(batch: FrameBatch, verify_icrc: bool = True, out: np.ndarray | None = None, *,
                 decapsulate: bool = False, defer_icrc: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1 over a batch: one record per frame, in order, and the event counters.

    Parameters
    ----------
    batch:
        Ethernet frames (:class:`~capture.frames.FrameBatch`).
    verify_icrc:
        Check the ICRC of every complete RoCEv2 packet (a job may switch it off).
    out:
        Optional :data:`FRAME_DTYPE` array of at least ``len(batch)`` rows to fill (reused
        across batches); the first ``len(batch)`` rows are returned.
    decapsulate:
        Open GRE/ERSPAN (types I, II, III) and decode the Ethernet frame inside: for a mirror
        stream that arrives over L3 (``MirrorSpec.encapsulation`` ``erspan2``/``erspan3``).
        Plain frames decode the same either way; without it GRE is ``other.non_udp``.
    defer_icrc:
        With ``verify_icrc``, leave the check of every ``decode.ok`` packet to the consumer
        (:func:`settle_icrc`, frame by frame, just before it reads the payload: one read of
        the payload from memory instead of two). Such records have ``icrc ==
        ICRC_DEFERRED``, and one whose ICRC is bad is ``decode.ok`` until settled.

    Returns
    -------
    ``(records, counters)``: ``FRAME_DTYPE[n]`` and ``int64[N_EVENTS]`` (frames per event
    code; they add up to ``n``). ``payload_off`` indexes ``batch.data``.
    """
    check_batch(batch)
    n = len(batch)
    if out is None:
        out = np.empty(n, FRAME_DTYPE)
    elif not isinstance(out, np.ndarray) or out.dtype != FRAME_DTYPE or out.ndim != 1:
        raise TypeError(f"out must be a 1-D FRAME_DTYPE array, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    elif len(out) < n or not out.flags.writeable:
        raise ValueError(f"out has {len(out)} rows (writeable: {out.flags.writeable}); "
                         f"the batch needs {n} writeable rows")
    out = out[:n]
    counters = part_counters(n)
    decode_parts(batch.data, batch.offsets, batch.caplens, batch.wirelens, batch.ts_ns,
                 verify_mode(verify_icrc, defer_icrc), bool(decapsulate), out, counters)
    return out, counters.sum(axis=0)


def verify_mode(verify_icrc: bool, defer_icrc: bool) -> int:
    """What stage 1 does with a complete packet's ICRC (the kernels' ``verify_icrc``)."""
    return VERIFY_OFF if not verify_icrc else VERIFY_LATER if defer_icrc else VERIFY_NOW


def part_counters(frames: int) -> np.ndarray:
    """The counters :func:`decode_parts` takes for ``frames`` frames: a row for each part they
    are cut in, one per Numba thread of the caller (at most one per frame)."""
    return np.zeros((max(1, min(numba.get_num_threads(), frames)), N_EVENTS), np.int64)


def check_batch(batch: FrameBatch) -> None:
    """Refuse what the stage-1 kernels cannot take: anything but a batch of Ethernet frames, or
    frames outside its data (``FrameBatch`` checks that when built, but its arrays are mutable,
    and the kernels trust it)."""
    if not isinstance(batch, FrameBatch):
        raise TypeError(f"decode_batch needs a FrameBatch, got {type(batch).__name__}")
    if batch.linktype != LINKTYPE_ETHERNET:
        raise ValueError(f"batch link type {batch.linktype} is not Ethernet "
                         f"(LINKTYPE_ETHERNET = {LINKTYPE_ETHERNET})")
    if len(batch) and (batch.offsets.min() < 0 or batch.caplens.min() < 0
                       or (batch.offsets + batch.caplens).max() > len(batch.data)):
        raise ValueError("FrameBatch frames reach outside data")


def is_roce(records: np.ndarray) -> np.ndarray:
    """Which records are RoCEv2 packets (their BTH was read), as tshark counts them."""
    return records["payload_off"] >= 0
