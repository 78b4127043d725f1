"""Base Transport Header, IBTA Vol 1 Release 1.4 §9.2 (12 bytes, after UDP in RoCEv2).

Byte 4 holds FECN/BECN (congestion notification, IBTA Annex A10 and the RoCEv2 congestion
management of Annex A17) and six reserved bits; the Linux rxe driver calls the whole byte
``resv8a``. The ICRC treats that byte as variant (see ``wire/icrc.py``). The 24-bit DestQP
and PSN share their 32-bit words with that byte and with AckReq + 7 reserved bits. PSN
arithmetic (modulo 2**24, from this table) is in ``wire/psn.py``.
"""

from gradtap.wire.headers.layout import Bits, Layout

BTH = Layout("BTH", "IBTA Vol 1 Rel 1.4 §9.2; FECN/BECN per Annex A10/A17", (
    ("opcode", "B", 0),
    (Bits(("se", 1), ("m", 1), ("padcnt", 2), ("tver", 4)), "B", 0),
    ("pkey", "H", 0xFFFF),
    (Bits(("fecn", 1), ("becn", 1), ("resv6", 6), ("destqp", 24)), "I", 0),
    (Bits(("ackreq", 1), ("resv7", 7), ("psn", 24)), "I", 0),
))

# Derived from the BTH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to BTH.constants().
BTH_LEN = 12
BTH_OFF_OPCODE = 0
BTH_SIZE_OPCODE = 1
BTH_OPCODE_MASK = 0xff
BTH_OPCODE_SHIFT = 0
BTH_OFF_SE = 1
BTH_SIZE_SE = 1
BTH_SE_MASK = 0x80
BTH_SE_SHIFT = 7
BTH_OFF_M = 1
BTH_SIZE_M = 1
BTH_M_MASK = 0x40
BTH_M_SHIFT = 6
BTH_OFF_PADCNT = 1
BTH_SIZE_PADCNT = 1
BTH_PADCNT_MASK = 0x30
BTH_PADCNT_SHIFT = 4
BTH_OFF_TVER = 1
BTH_SIZE_TVER = 1
BTH_TVER_MASK = 0xf
BTH_TVER_SHIFT = 0
BTH_OFF_PKEY = 2
BTH_SIZE_PKEY = 2
BTH_PKEY_MASK = 0xffff
BTH_PKEY_SHIFT = 0
BTH_OFF_FECN = 4
BTH_SIZE_FECN = 4
BTH_FECN_MASK = 0x80000000
BTH_FECN_SHIFT = 31
BTH_OFF_BECN = 4
BTH_SIZE_BECN = 4
BTH_BECN_MASK = 0x40000000
BTH_BECN_SHIFT = 30
BTH_OFF_RESV6 = 4
BTH_SIZE_RESV6 = 4
BTH_RESV6_MASK = 0x3f000000
BTH_RESV6_SHIFT = 24
BTH_OFF_DESTQP = 4
BTH_SIZE_DESTQP = 4
BTH_DESTQP_MASK = 0xffffff
BTH_DESTQP_SHIFT = 0
BTH_OFF_ACKREQ = 8
BTH_SIZE_ACKREQ = 4
BTH_ACKREQ_MASK = 0x80000000
BTH_ACKREQ_SHIFT = 31
BTH_OFF_RESV7 = 8
BTH_SIZE_RESV7 = 4
BTH_RESV7_MASK = 0x7f000000
BTH_RESV7_SHIFT = 24
BTH_OFF_PSN = 8
BTH_SIZE_PSN = 4
BTH_PSN_MASK = 0xffffff
BTH_PSN_SHIFT = 0

pack = BTH.pack
unpack = BTH.unpack
