"""GRE header, RFC 2784 §2 with the key and sequence number of RFC 2890 §2 (4 to 16 bytes).

How mirrored frames reach a CPU node over L3 (ERSPAN, ``wire/headers/erspan.py``). The first
word holds the flags and the protocol type of the payload; the optional words follow in wire
order, each present when its flag is set: checksum + reserved (C), key (K), sequence number
(S). Bits 1 and 4-12 keep their RFC 1701 §3.1 names: R (routing present) would insert the
offset and source routes of RFC 1701, which RFC 2784 drops, so a receiver of RFC 2784 GRE
refuses it (as Linux's ``gre_parse_header`` does, together with a version other than 0);
strict source route, recursion control and flags are ignored on receipt.
"""

from gradtap.wire.headers.layout import Bits, Layout

IPPROTO_GRE = 47             # IANA protocol number (RFC 2784 §3)
GRE_PROTO_ERSPAN2 = 0x88BE   # ERSPAN types I and II (draft-foschiano-erspan-03; Linux ETH_P_ERSPAN)
GRE_PROTO_ERSPAN3 = 0x22EB   # ERSPAN type III (draft-foschiano-erspan-03; Linux ETH_P_ERSPAN2)
GRE_WORD = 4                 # every optional field is one 32-bit word

GRE = Layout("GRE", "RFC 2784 §2.1; K and S per RFC 2890 §2; R, ssr, recur, flags per RFC 1701 §3.1", (
    (Bits(("c", 1), ("r", 1), ("k", 1), ("s", 1), ("ssr", 1), ("recur", 3), ("flags", 5), ("version", 3)),
     "H", 0),
    ("proto", "H", GRE_PROTO_ERSPAN2),
))

GRE_CHECKSUM = Layout("GRE_CHECKSUM", "RFC 2784 §2.5 (checksum), §2.6 (reserved1)", (
    ("checksum", "H", 0),
    ("reserved1", "H", 0),
))

GRE_KEY = Layout("GRE_KEY", "RFC 2890 §2.1", (
    ("key", "I", 0),
))

GRE_SEQ = Layout("GRE_SEQ", "RFC 2890 §2.2", (
    ("seq", "I", 0),
))

# Derived from the GRE table above and written out so that readers and linters see
# them; tests/parser/test_erspan_headers.py holds them equal to GRE.constants().
GRE_LEN = 4
GRE_OFF_C = 0
GRE_SIZE_C = 2
GRE_C_MASK = 0x8000
GRE_C_SHIFT = 15
GRE_OFF_R = 0
GRE_SIZE_R = 2
GRE_R_MASK = 0x4000
GRE_R_SHIFT = 14
GRE_OFF_K = 0
GRE_SIZE_K = 2
GRE_K_MASK = 0x2000
GRE_K_SHIFT = 13
GRE_OFF_S = 0
GRE_SIZE_S = 2
GRE_S_MASK = 0x1000
GRE_S_SHIFT = 12
GRE_OFF_SSR = 0
GRE_SIZE_SSR = 2
GRE_SSR_MASK = 0x800
GRE_SSR_SHIFT = 11
GRE_OFF_RECUR = 0
GRE_SIZE_RECUR = 2
GRE_RECUR_MASK = 0x700
GRE_RECUR_SHIFT = 8
GRE_OFF_FLAGS = 0
GRE_SIZE_FLAGS = 2
GRE_FLAGS_MASK = 0xf8
GRE_FLAGS_SHIFT = 3
GRE_OFF_VERSION = 0
GRE_SIZE_VERSION = 2
GRE_VERSION_MASK = 0x7
GRE_VERSION_SHIFT = 0
GRE_OFF_PROTO = 2
GRE_SIZE_PROTO = 2
GRE_PROTO_MASK = 0xffff
GRE_PROTO_SHIFT = 0
# Derived from the GRE_CHECKSUM, GRE_KEY and GRE_SEQ tables above, written out likewise.
GRE_CHECKSUM_LEN = 4
GRE_CHECKSUM_OFF_CHECKSUM = 0
GRE_CHECKSUM_SIZE_CHECKSUM = 2
GRE_CHECKSUM_CHECKSUM_MASK = 0xffff
GRE_CHECKSUM_CHECKSUM_SHIFT = 0
GRE_CHECKSUM_OFF_RESERVED1 = 2
GRE_CHECKSUM_SIZE_RESERVED1 = 2
GRE_CHECKSUM_RESERVED1_MASK = 0xffff
GRE_CHECKSUM_RESERVED1_SHIFT = 0
GRE_KEY_LEN = 4
GRE_KEY_OFF_KEY = 0
GRE_KEY_SIZE_KEY = 4
GRE_KEY_KEY_MASK = 0xffffffff
GRE_KEY_KEY_SHIFT = 0
GRE_SEQ_LEN = 4
GRE_SEQ_OFF_SEQ = 0
GRE_SEQ_SIZE_SEQ = 4
GRE_SEQ_SEQ_MASK = 0xffffffff
GRE_SEQ_SEQ_SHIFT = 0


def pack(checksum: int | None = None, key: int | None = None, seq: int | None = None, **fields) -> bytes:
    """The GRE header with the optional words given (``None``: absent, its flag clear).
    ``checksum`` is written as given (no computation: gradtap never checks it)."""
    head = GRE.pack(c=int(checksum is not None), k=int(key is not None), s=int(seq is not None), **fields)
    if checksum is not None:
        head += GRE_CHECKSUM.pack(checksum=checksum)
    if key is not None:
        head += GRE_KEY.pack(key=key)
    if seq is not None:
        head += GRE_SEQ.pack(seq=seq)
    return head


def unpack(buf, offset: int = 0) -> dict:
    """The first word's fields plus ``checksum``/``key``/``seq`` (``None`` when absent) and
    ``length``, the header's bytes."""
    out = GRE.unpack(buf, offset)
    pos = offset + GRE.size
    for flag, layout, name in (("c", GRE_CHECKSUM, "checksum"), ("k", GRE_KEY, "key"), ("s", GRE_SEQ, "seq")):
        out[name] = None
        if out[flag]:
            out[name] = layout.unpack(buf, pos)[name]
            pos += layout.size
    out["length"] = pos - offset
    return out
