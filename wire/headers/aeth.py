"""ACK Extended Transport Header, IBTA Vol 1 Release 1.4 §9.3.5 (4 bytes).

Carried by Acknowledge, ATOMIC Acknowledge and RDMA READ Response First/Last/Only. The
8-bit syndrome is itself a small declared layout (§9.3.5.1): a reserved bit, a 2-bit type
(ACK, RNR NAK, NAK) and a 5-bit value (credit count, RNR timer or NAK code).
"""

from gradtap.wire.headers.layout import Bits, Layout

AETH = Layout("AETH", "IBTA Vol 1 Rel 1.4 §9.3.5", (
    (Bits(("syndrome", 8), ("msn", 24)), "I", 0),
))

SYNDROME = Layout("AETH_SYNDROME", "IBTA Vol 1 Rel 1.4 §9.3.5.1", (
    (Bits(("resv", 1), ("type", 2), ("value", 5)), "B", 0),
))

# Derived from the AETH table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to AETH.constants().
AETH_LEN = 4
AETH_OFF_SYNDROME = 0
AETH_SIZE_SYNDROME = 4
AETH_SYNDROME_MASK = 0xff000000
AETH_SYNDROME_SHIFT = 24
AETH_OFF_MSN = 0
AETH_SIZE_MSN = 4
AETH_MSN_MASK = 0xffffff
AETH_MSN_SHIFT = 0
# Derived from the SYNDROME table above and written out so that readers and linters see
# them; tests/wire/test_headers.py holds them equal to SYNDROME.constants().
AETH_SYNDROME_LEN = 1
AETH_SYNDROME_OFF_RESV = 0
AETH_SYNDROME_SIZE_RESV = 1
AETH_SYNDROME_RESV_MASK = 0x80
AETH_SYNDROME_RESV_SHIFT = 7
AETH_SYNDROME_OFF_TYPE = 0
AETH_SYNDROME_SIZE_TYPE = 1
AETH_SYNDROME_TYPE_MASK = 0x60
AETH_SYNDROME_TYPE_SHIFT = 5
AETH_SYNDROME_OFF_VALUE = 0
AETH_SYNDROME_SIZE_VALUE = 1
AETH_SYNDROME_VALUE_MASK = 0x1f
AETH_SYNDROME_VALUE_SHIFT = 0

# Syndrome types (§9.3.5.1).
SYNDROME_ACK = 0
SYNDROME_RNR_NAK = 1
SYNDROME_NAK = 3

# NAK codes, the syndrome value when the type is SYNDROME_NAK.
NAK_PSN_SEQUENCE_ERROR = 0
NAK_INVALID_REQUEST = 1
NAK_REMOTE_ACCESS_ERROR = 2
NAK_REMOTE_OPERATIONAL_ERROR = 3
NAK_INVALID_RD_REQUEST = 4

# The MSN is a 24-bit counter of completed messages (§9.7.6.1.1).
MSN_MODULUS = (AETH.fields["msn"].mask >> AETH.fields["msn"].shift) + 1


def syndrome_byte(kind: int, value: int) -> int:
    """The 8-bit syndrome of type ``kind`` (``SYNDROME_ACK``, ...) with its 5-bit ``value``."""
    return SYNDROME.pack(type=kind, value=value)[0]


def word(syndrome, msn):
    """The AETH as one 32-bit big-endian word, ``syndrome << 24 | MSN`` (how frame records and
    packet descriptors hold it); ``msn`` is taken modulo 2**24. Works on NumPy arrays."""
    s, m = AETH.fields["syndrome"], AETH.fields["msn"]
    return ((syndrome << s.shift) & s.mask) | ((msn << m.shift) & m.mask)


pack = AETH.pack
unpack = AETH.unpack
