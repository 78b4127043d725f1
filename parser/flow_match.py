"""Which flow a frame record belongs to: an RDMA WRITE's destination QPN and address pair.

Stage 2 (``parser/assemble.py``) finds each record's flow in the stream's tables one record
at a time. Lock-on asks the same of a whole batch, while it narrows and when it places
(``parser/lockon.py``), and, before the QPNs are known, which of the job's address pairs each
write travels between (``parser/flow_learning.py``). Those batch questions are kernels here.
As NumPy expressions they compared every record's 16-byte addresses with every flow's, one
reduction per flow, with the GIL held: a stream's first batch of GPT-2 small (16.5 k frames,
68 MB) took 19.7 ms to parse with them and 13.4 ms with the kernels (3 ms once locked on).

Records are ``FRAME_DTYPE`` (``wire/frame_record.py``); a record counts only when stage 1
decoded it (``DECODE_OK``; a deferred ICRC is settled later, as the NumPy forms did) and its
opcode is an RDMA WRITE. Addresses are stage 1's 16-byte form (IPv4 mapped into IPv6).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT_NO_REFCOUNT
from gradtap.wire import events as ev
from gradtap.wire.headers.opcodes import KIND_WRITE, OPCODE_KIND

NONE = -1           # a record of no flow (not a decoded write, or of no flow asked about)
ELSEWHERE = -2      # pair_keys: a decoded RDMA WRITE between none of the pairs asked about


@njit(**JIT_NO_REFCOUNT)
def _write(rec):
    return rec["event"] == ev.DECODE_OK and OPCODE_KIND[rec["opcode"]] == KIND_WRITE


@njit(**JIT_NO_REFCOUNT)
def _between(rec, src, dst):
    """Whether ``rec`` goes from address ``src`` to ``dst`` (uint8[16] each)."""
    for b in range(16):
        if src[b] != rec["src_ip"][b] or dst[b] != rec["dst_ip"][b]:
            return False
    return True


@njit(**JIT_NO_REFCOUNT)
def find_flow(rec, t):
    """The stream flow of a record (``t``: the stream's ``StreamTables``): its destination QP
    and address pair; -1 if none."""
    for f in range(t.qpn.shape[0]):
        if t.qpn[f] == rec["dest_qp"] and _between(rec, t.src_ip[f], t.dst_ip[f]):
            return f
    return NONE


@njit(**JIT_NO_REFCOUNT)
def _record_flows(recs, t, out):
    for i in range(min(recs.shape[0], out.shape[0])):
        out[i] = find_flow(recs[i], t) if _write(recs[i]) else NONE


def record_flows(recs: np.ndarray, t) -> np.ndarray:
    """int64[n]: the stream flow of each of ``recs`` (``FRAME_DTYPE[n]``) that is a decoded
    RDMA WRITE of one of ``t``'s flows, else -1."""
    out = np.empty(len(recs), np.int64)
    _record_flows(np.ascontiguousarray(recs), t, out)
    return out


@njit(**JIT_NO_REFCOUNT)
def _pair_keys(recs, pairs, out):
    for i in range(min(recs.shape[0], out.shape[0])):
        out[i] = NONE
        if not _write(recs[i]):
            continue
        out[i] = ELSEWHERE
        for p in range(pairs.shape[0]):
            if _between(recs[i], pairs[p, :16], pairs[p, 16:]):
                out[i] = (np.int64(p) << 24) | np.int64(recs[i]["dest_qp"])
                break


def pair_keys(recs: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """int64[n]: each of ``recs`` that is a decoded RDMA WRITE between one of ``pairs``
    (uint8[P, 32]: source then destination address, each row once) as ``p << 24 | dest_qp``;
    :data:`ELSEWHERE` (-2) for one between none of them, and -1 for every other record."""
    if pairs.ndim != 2 or pairs.shape[1] != 32 or pairs.dtype != np.uint8:
        raise GradtapError(f"pair_keys: pairs is {pairs.dtype}{pairs.shape}; expected uint8[P, 32]")
    out = np.empty(len(recs), np.int64)
    _pair_keys(np.ascontiguousarray(recs), np.ascontiguousarray(pairs), out)
    return out
