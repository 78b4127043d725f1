"""The BTH opcode table, IBTA Vol 1 Release 1.4 §9.2.1 (OpCode field) and §9.3 (which
extended transport headers each packet carries), plus the RoCEv2 CNP (Annex A17 §A17.9.3).

An opcode is a 3-bit transport prefix and a 5-bit operation. The table below lists each
operation once with its extension headers (in wire order, between BTH and payload) and
whether it carries payload; each transport then names which operations it has and which
headers every packet of that transport carries first (UD's DETH). The Linux rxe driver's
``rxe_opcode.c`` encodes the same facts and agrees with this table.

RD (prefix 0x40) and XRC (0xA0) are not RoCEv2 NCCL traffic and are left out: their
opcodes are unknown here, like every other opcode not listed.

For Numba kernels the table is also flattened into ``uint8``/``int8`` arrays indexed by
opcode (``OPCODE_VALID``, ``OPCODE_EXT_LEN``, ``OPCODE_PAYLOAD``, ``OPCODE_KIND``,
``OPCODE_POSITION``, and ``OPCODE_<HEADER>_OFF``: the byte offset of that extension header
from the end of the BTH, or -1 when the opcode does not carry it). Each opcode's name is also
a module-level constant (``RC_RDMA_WRITE_FIRST == 0x06``).
"""

from typing import NamedTuple

import numpy as np

from gradtap.wire.headers.aeth import AETH
from gradtap.wire.headers.atomiceth import ATOMICACKETH, ATOMICETH
from gradtap.wire.headers.cnp import CNP_BODY
from gradtap.wire.headers.deth import DETH
from gradtap.wire.headers.ieth import IETH
from gradtap.wire.headers.immdt import IMMDT
from gradtap.wire.headers.layout import Layout
from gradtap.wire.headers.reth import RETH

# What the operation does (OPCODE_KIND).
KIND_SEND = 1
KIND_WRITE = 2
KIND_READ_REQUEST = 3
KIND_READ_RESPONSE = 4
KIND_ACK = 5
KIND_ATOMIC = 6
KIND_ATOMIC_ACK = 7
KIND_CNP = 8

# Where the packet sits in its message (OPCODE_POSITION).
POS_FIRST = 1
POS_MIDDLE = 2
POS_LAST = 3
POS_ONLY = 4

TRANSPORT_MASK = 0xE0
TRANSPORT_RC = 0x00
TRANSPORT_UC = 0x20
TRANSPORT_UD = 0x60


class Opcode(NamedTuple):
    code: int
    name: str
    kind: int
    position: int
    headers: tuple[Layout, ...]  # extended transport headers after BTH, in wire order
    payload: bool


# 5-bit operation, name, kind, position, extension headers, payload (§9.2.1, §9.3).
_OPERATIONS = (
    (0x00, "SEND_FIRST", KIND_SEND, POS_FIRST, (), True),
    (0x01, "SEND_MIDDLE", KIND_SEND, POS_MIDDLE, (), True),
    (0x02, "SEND_LAST", KIND_SEND, POS_LAST, (), True),
    (0x03, "SEND_LAST_WITH_IMMEDIATE", KIND_SEND, POS_LAST, (IMMDT,), True),
    (0x04, "SEND_ONLY", KIND_SEND, POS_ONLY, (), True),
    (0x05, "SEND_ONLY_WITH_IMMEDIATE", KIND_SEND, POS_ONLY, (IMMDT,), True),
    (0x06, "RDMA_WRITE_FIRST", KIND_WRITE, POS_FIRST, (RETH,), True),
    (0x07, "RDMA_WRITE_MIDDLE", KIND_WRITE, POS_MIDDLE, (), True),
    (0x08, "RDMA_WRITE_LAST", KIND_WRITE, POS_LAST, (), True),
    (0x09, "RDMA_WRITE_LAST_WITH_IMMEDIATE", KIND_WRITE, POS_LAST, (IMMDT,), True),
    (0x0A, "RDMA_WRITE_ONLY", KIND_WRITE, POS_ONLY, (RETH,), True),
    (0x0B, "RDMA_WRITE_ONLY_WITH_IMMEDIATE", KIND_WRITE, POS_ONLY, (RETH, IMMDT), True),
    (0x0C, "RDMA_READ_REQUEST", KIND_READ_REQUEST, POS_ONLY, (RETH,), False),
    (0x0D, "RDMA_READ_RESPONSE_FIRST", KIND_READ_RESPONSE, POS_FIRST, (AETH,), True),
    (0x0E, "RDMA_READ_RESPONSE_MIDDLE", KIND_READ_RESPONSE, POS_MIDDLE, (), True),
    (0x0F, "RDMA_READ_RESPONSE_LAST", KIND_READ_RESPONSE, POS_LAST, (AETH,), True),
    (0x10, "RDMA_READ_RESPONSE_ONLY", KIND_READ_RESPONSE, POS_ONLY, (AETH,), True),
    (0x11, "ACKNOWLEDGE", KIND_ACK, POS_ONLY, (AETH,), False),
    (0x12, "ATOMIC_ACKNOWLEDGE", KIND_ATOMIC_ACK, POS_ONLY, (AETH, ATOMICACKETH), False),
    (0x13, "COMPARE_SWAP", KIND_ATOMIC, POS_ONLY, (ATOMICETH,), False),
    (0x14, "FETCH_ADD", KIND_ATOMIC, POS_ONLY, (ATOMICETH,), False),
    (0x16, "SEND_LAST_WITH_INVALIDATE", KIND_SEND, POS_LAST, (IETH,), True),
    (0x17, "SEND_ONLY_WITH_INVALIDATE", KIND_SEND, POS_ONLY, (IETH,), True),
)

# Transport, prefix, the operations it has, headers every one of its packets carries first.
_TRANSPORTS = (
    ("RC", TRANSPORT_RC, tuple(op[0] for op in _OPERATIONS), ()),
    ("UC", TRANSPORT_UC, tuple(range(0x00, 0x0C)), ()),  # SEND and RDMA WRITE only
    ("UD", TRANSPORT_UD, (0x04, 0x05), (DETH,)),  # SEND Only [with Immediate]
)


def _build() -> dict[int, Opcode]:
    ops = {op[0]: op for op in _OPERATIONS}
    table = {}
    for transport, prefix, allowed, leading in _TRANSPORTS:
        for low in allowed:
            _, name, kind, position, headers, payload = ops[low]
            code = prefix | low
            table[code] = Opcode(code, f"{transport}_{name}", kind, position,
                                 leading + headers, payload)
    # RoCEv2's own opcode, outside the transports (Annex A17 §A17.9.3).
    table[0x81] = Opcode(0x81, "CNP", KIND_CNP, POS_ONLY, (CNP_BODY,), False)
    return table


OPCODES: dict[int, Opcode] = _build()
# Each opcode's name as a constant, written out (tests/wire/test_headers.py holds them equal
# to OPCODES).
RC_SEND_FIRST = 0x00
RC_SEND_MIDDLE = 0x01
RC_SEND_LAST = 0x02
RC_SEND_LAST_WITH_IMMEDIATE = 0x03
RC_SEND_ONLY = 0x04
RC_SEND_ONLY_WITH_IMMEDIATE = 0x05
RC_RDMA_WRITE_FIRST = 0x06
RC_RDMA_WRITE_MIDDLE = 0x07
RC_RDMA_WRITE_LAST = 0x08
RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
RC_RDMA_WRITE_ONLY = 0x0a
RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0b
RC_RDMA_READ_REQUEST = 0x0c
RC_RDMA_READ_RESPONSE_FIRST = 0x0d
RC_RDMA_READ_RESPONSE_MIDDLE = 0x0e
RC_RDMA_READ_RESPONSE_LAST = 0x0f
RC_RDMA_READ_RESPONSE_ONLY = 0x10
RC_ACKNOWLEDGE = 0x11
RC_ATOMIC_ACKNOWLEDGE = 0x12
RC_COMPARE_SWAP = 0x13
RC_FETCH_ADD = 0x14
RC_SEND_LAST_WITH_INVALIDATE = 0x16
RC_SEND_ONLY_WITH_INVALIDATE = 0x17
UC_SEND_FIRST = 0x20
UC_SEND_MIDDLE = 0x21
UC_SEND_LAST = 0x22
UC_SEND_LAST_WITH_IMMEDIATE = 0x23
UC_SEND_ONLY = 0x24
UC_SEND_ONLY_WITH_IMMEDIATE = 0x25
UC_RDMA_WRITE_FIRST = 0x26
UC_RDMA_WRITE_MIDDLE = 0x27
UC_RDMA_WRITE_LAST = 0x28
UC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x29
UC_RDMA_WRITE_ONLY = 0x2a
UC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x2b
UD_SEND_ONLY = 0x64
UD_SEND_ONLY_WITH_IMMEDIATE = 0x65
CNP = 0x81

EXT_HEADERS = (RETH, IMMDT, AETH, DETH, IETH, ATOMICETH, ATOMICACKETH, CNP_BODY)


def _flatten():
    arrays = {name: np.zeros(256, np.uint8) for name in
              ("OPCODE_VALID", "OPCODE_EXT_LEN", "OPCODE_PAYLOAD", "OPCODE_KIND",
               "OPCODE_POSITION")}
    arrays.update({f"OPCODE_{h.name}_OFF": np.full(256, -1, np.int8) for h in EXT_HEADERS})
    for op in OPCODES.values():
        arrays["OPCODE_VALID"][op.code] = 1
        arrays["OPCODE_PAYLOAD"][op.code] = op.payload
        arrays["OPCODE_KIND"][op.code] = op.kind
        arrays["OPCODE_POSITION"][op.code] = op.position
        offset = 0
        for header in op.headers:
            arrays[f"OPCODE_{header.name}_OFF"][op.code] = offset
            offset += header.size
        arrays["OPCODE_EXT_LEN"][op.code] = offset
    for array in arrays.values():
        array.flags.writeable = False
    return arrays


_TABLES = _flatten()
OPCODE_VALID = _TABLES["OPCODE_VALID"]
OPCODE_EXT_LEN = _TABLES["OPCODE_EXT_LEN"]
OPCODE_PAYLOAD = _TABLES["OPCODE_PAYLOAD"]
OPCODE_KIND = _TABLES["OPCODE_KIND"]
OPCODE_POSITION = _TABLES["OPCODE_POSITION"]
OPCODE_RETH_OFF = _TABLES["OPCODE_RETH_OFF"]
OPCODE_IMMDT_OFF = _TABLES["OPCODE_IMMDT_OFF"]
OPCODE_AETH_OFF = _TABLES["OPCODE_AETH_OFF"]
OPCODE_DETH_OFF = _TABLES["OPCODE_DETH_OFF"]
OPCODE_IETH_OFF = _TABLES["OPCODE_IETH_OFF"]
OPCODE_ATOMICETH_OFF = _TABLES["OPCODE_ATOMICETH_OFF"]
OPCODE_ATOMICACKETH_OFF = _TABLES["OPCODE_ATOMICACKETH_OFF"]
OPCODE_CNP_OFF = _TABLES["OPCODE_CNP_OFF"]


def name(code: int) -> str:
    """The opcode's name (``"RC_RDMA_WRITE_FIRST"``), or ``"UNKNOWN_0xaa"``."""
    op = OPCODES.get(code)
    return op.name if op else f"UNKNOWN_{code:#04x}"
