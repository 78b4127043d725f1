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

globals().update(BTH.constants())

pack = BTH.pack
unpack = BTH.unpack
