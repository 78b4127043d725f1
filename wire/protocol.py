"""NCCL's three wire protocols, one encoding for all of gradtap.

A send's bytes go on the wire as they are (**Simple**), in 16-byte lines of two data and two
flag words (**LL**, ``wire/ll.py``) or in 128-byte lines whose last word is a flag (**LL128**,
``wire/ll128.py``). The job spec names them as NCCL does (``NCCL_PROTO``: ``Simple``, ``LL``,
``LL128``); :meth:`Protocol.of` maps a name to the member, and :attr:`Protocol.nccl_name`
back. Kernels compare against the members, which Numba treats as integer constants.
"""

from __future__ import annotations

from enum import IntEnum

from gradtap.wire.ll import LL_LINE_BYTES, LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_SLICE_DATA_BYTES, LL128_SLICE_WIRE_BYTES


class Protocol(IntEnum):
    SIMPLE = 0
    LL = 1
    LL128 = 2

    @property
    def nccl_name(self) -> str:
        """The name NCCL and the job spec use (``"Simple"``, ``"LL"``, ``"LL128"``)."""
        return _NCCL_NAMES[self]

    @property
    def unit(self) -> tuple[int, int]:
        """``(data bytes, wire bytes)`` of the protocol's unit of encoding: a byte (Simple),
        a line (LL), a warp slice (LL128). A send occupies whole units on the wire."""
        return _UNITS[self]

    def wire_bytes(self, data_bytes: int) -> int:
        """Bytes on the wire of one send carrying ``data_bytes`` bytes of elements."""
        data, wire = _UNITS[self]
        return -(-data_bytes // data) * wire

    @classmethod
    def of(cls, name: str) -> Protocol:
        """The protocol NCCL calls ``name``; ``ValueError`` naming the allowed names otherwise."""
        for protocol, nccl_name in _NCCL_NAMES.items():
            if name == nccl_name:
                return protocol
        raise ValueError(f"protocol {name!r} is not one of {', '.join(_NCCL_NAMES.values())}")


N_PROTOCOLS = len(Protocol)

_NCCL_NAMES = {Protocol.SIMPLE: "Simple", Protocol.LL: "LL", Protocol.LL128: "LL128"}
_UNITS = {Protocol.SIMPLE: (1, 1), Protocol.LL: (LL_LINE_DATA_BYTES, LL_LINE_BYTES),
          Protocol.LL128: (LL128_SLICE_DATA_BYTES, LL128_SLICE_WIRE_BYTES)}
