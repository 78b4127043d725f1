"""The record stage 1 (``parser/decode.py``) writes for every frame, and stage 2 reads.

One row per input frame, in arrival order. ``event`` is ``DECODE_OK`` for a complete RoCEv2
packet whose fields below are then all valid, or the ``decode.*``/``other.*`` code of why
the frame stops there (see ``wire/events.py``). Addresses are 16 bytes: IPv6 as is, IPv4
as ``::ffff:a.b.c.d`` (RFC 4291 §2.5.5.2), so one comparison serves both families.

A frame that arrived encapsulated in GRE/ERSPAN (``wire/headers/gre.py``, ``erspan.py``) is
decoded from the Ethernet frame it carries: every field from ``ip_version`` to
``payload_crc`` describes that inner frame (its VLAN tag, addresses, RoCEv2 headers;
``payload_off`` points into it). The last three fields are the encapsulation's, so that
mirror loss can be counted from GRE sequence gaps per ERSPAN session: they are filled as far
as the GRE and ERSPAN headers were read, whatever the event.
"""

import numpy as np

ICRC_UNCHECKED, ICRC_OK, ICRC_BAD = 0, 1, 2
# A complete packet whose ICRC stage 1 was asked to leave to stage 2, which checks it just
# before it reads the payload (``parser/decode.py``: ``settle_icrc``).
ICRC_DEFERRED = 3

FRAME_DTYPE = np.dtype([
    ("event", "u1"),
    ("ip_version", "u1"),      # 4 or 6
    ("opcode", "u1"),
    ("padcnt", "u1"),
    ("ackreq", "u1"),
    ("icrc", "u1"),            # ICRC_UNCHECKED / ICRC_OK / ICRC_BAD / ICRC_DEFERRED
    ("vlan", "u2"),            # outermost VLAN id, 0 if untagged
    ("udp_sport", "u2"),
    ("dest_qp", "u4"),
    ("psn", "u4"),
    ("src_ip", "u1", 16),
    ("dst_ip", "u1", 16),
    ("reth_va", "u8"),
    ("reth_rkey", "u4"),
    ("reth_len", "u4"),
    ("imm", "u4"),             # ImmDt, the four wire bytes read big-endian
    ("aeth", "u4"),            # syndrome << 24 | MSN
    ("l3_off", "i8"),          # first byte of the UDP datagram's IP header in the batch's data array (-1: none)
    ("payload_off", "i8"),     # first payload byte in the batch's data array
    ("payload_len", "i4"),     # payload bytes (no headers, pad or ICRC)
    ("payload_crc", "i8"),     # zlib CRC-32 of the payload, made with a good ICRC of a path-MTU payload (-1: none)
    ("ts_ns", "i8"),
    ("erspan_type", "u1"),     # ERSPAN_NONE (0: not encapsulated), ERSPAN_TYPE_I/II/III (1/2/3)
    ("erspan_session", "i2"),  # 10-bit ERSPAN session id, -1 without an ERSPAN header (plain, type I)
    ("gre_seq", "i8"),         # GRE sequence number (32 bits), -1 when the GRE header carries none
])
