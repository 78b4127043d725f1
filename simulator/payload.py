"""Protocol payloads: the bytes NCCL writes into a FIFO slot for one send.

A send's data are the raw little-endian bytes of its elements in the wire dtype. What
goes on the wire (the RDMA WRITE payload, ``msg_bytes`` in the wire plan) depends on the
protocol, as NCCL v2.19.3-1 lays it out; the line formats, flags and the LL128 warp mapping
below are unchanged in every era up to v2.30.7-1 (``device.h``, ``prims_ll.h``,
``prims_ll128.h``), so one encoder serves every ``nccl.era``; what differs between eras (the
elements of each send, the ImmDt byte order) comes from the wire plan and its era facts:

**Simple** (``src/device/prims_simple.h``): the data bytes as they are.

**LL** (``src/device/prims_ll.h``, ``src/include/device.h``): 16-byte lines
``data1 flag1 data2 flag2`` (four little-endian uint32, ``union ncclLLFifoLine``), carrying
8 data bytes each: ``storeLL`` writes ``(uint32)val, flag, (uint32)(val >> 32), flag``
with ``flag = NCCL_LL_FLAG(step + 1) = (uint32)(step + 1)``. A last line with fewer than
8 data bytes: ``DataLoader`` does not load the missing half for 4/8-byte types (the
register keeps whatever it held) and for 2-byte types loads the following bytes of the
user buffer, so NCCL leaves those bytes unspecified; this encoder writes zeros there.

**LL128** (``src/device/prims_ll128.h``, ``device.h``): 128-byte lines of 16 little-endian
uint64 words, word 15 of each line the flag ``step + 1`` (``sendFlag``, full 64 bits).
Each warp moves a *slice* of 240 data words (1920 B) into 256 wire words (2048 B, 16
lines); successive 1920-byte data slices go to successive 2048-byte wire slices
(``GenericOp``: ``wireOffset = 256·warp + 2·wid``, advancing by ``256·nwarps`` while the
data pointer advances by ``240·nwarps`` words), so a send of ``d`` data bytes is
``ceil(d / 1920)·2048`` wire bytes. Inside a slice, lane ``wid`` (0..31) of the warp,
a *flag thread* when ``wid % 8 == 7``:

1. ``loadRegsBegin``: for ``g`` in 0..3 loads the 16-byte data block
   ``ix = 32g - 4·(g // 2) + wid - (g % 2)·(wid // 8)`` into ``regs[2g], regs[2g+1]``
   (flag threads skip odd ``g``; a block at or past the end of the data is not loaded);
2. ``loadRegsFinish``: flag threads move ``regs[2g-1]`` into ``regs[2g]`` for odd ``g``;
3. ``recvReduceSendCopy``: for ``u`` in 0, 2, 4, 6 stores the word pair
   ``(regs[u], flagThread ? flag : regs[u+1])`` at wire words ``32u + 2·wid`` and ``+1``.

Hence data word ``2·ix`` goes to wire word ``64g + 2·wid`` and data word ``2·ix + 1`` to
``64g + 2·wid + 1`` (``64(g+1) + 2·wid`` for a flag thread); the 4 groups × 32 lanes, minus
the flag threads' odd groups, cover blocks 0..119 exactly once
(:data:`gradtap.wire.ll128.LL128_DATA_TO_WIRE`, shared with the parser).
Data past the end of a send (its last slice) is unspecified in NCCL (unloaded registers,
or the user buffer's following bytes inside a partly used block); this encoder writes
zeros there. Flags are written on every line of every slice.

The flag argument of the encoders is ``step + 1``, the connection's absolute FIFO step
plus one; LL keeps its low 32 bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gradtap.core.jit import JIT
from gradtap.wire.ll import LL_DATA1_OFF, LL_DATA2_OFF, LL_FLAG1_OFF, LL_FLAG2_OFF, LL_HALF_BYTES, LL_LINE_BYTES, \
    LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_DATA_TO_WIRE, LL128_FLAG_WORD, LL128_LINE_WORDS, LL128_SLICE_DATA_WORDS, \
    LL128_SLICE_WIRE_WORDS
from gradtap.wire.protocol import Protocol

_LL128_WIRE_FROM_DATA = np.zeros(LL128_SLICE_WIRE_WORDS, dtype=np.int64)   # flag words: overwritten
_LL128_WIRE_FROM_DATA[LL128_DATA_TO_WIRE] = np.arange(LL128_SLICE_DATA_WORDS)
# uint32 words of an LL line: the data halves and the flags.
_LL_DATA_WORDS = [LL_DATA1_OFF // LL_HALF_BYTES, LL_DATA2_OFF // LL_HALF_BYTES]
_LL_FLAG_WORDS = [LL_FLAG1_OFF // LL_HALF_BYTES, LL_FLAG2_OFF // LL_HALF_BYTES]


def wire_size(protocol: Protocol, nbytes: int) -> int:
    """Bytes on the wire of one send of ``nbytes`` data bytes (whole protocol units)."""
    unit, wire_unit = _check_protocol(protocol).unit
    return -(-nbytes // unit) * wire_unit


def encode(protocol: Protocol, data: np.ndarray, flag: int, out: np.ndarray | None = None) -> np.ndarray:
    """The wire payload (uint8) of one send whose element bytes are ``data`` (uint8, 1-D).

    ``out``: optional C-contiguous uint8 array of exactly :func:`wire_size` bytes to write
    the payload into (e.g. a slice of a preallocated arena); it is returned.
    """
    protocol = _check_protocol(protocol)
    data = _check_data(data)
    size = wire_size(protocol, len(data))
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (size,)
                            or not out.flags.c_contiguous):
        raise ValueError(f"out must be a contiguous uint8 array of {size} bytes, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', None)}")
    unit = protocol.unit[0]
    if protocol == Protocol.SIMPLE:
        # The data as they are (and zeros up to the unit): one copy, straight into out.
        out = np.empty(size, np.uint8) if out is None else out
        out[:len(data)] = data
        out[len(data):] = 0
        return out
    if len(data) % unit:
        padded = np.zeros(-(-len(data) // unit) * unit, dtype=np.uint8)
        padded[:len(data)] = data
    else:
        padded = data
    return _layout(protocol, padded, np.uint64(flag), out)


def encode_batch(protocol: Protocol, data: np.ndarray, offsets: np.ndarray,
                 flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode many sends at once; equal to :func:`encode` of each, concatenated.

    Parameters
        data: uint8, the element bytes of all sends; send ``i`` is
            ``data[offsets[i]:offsets[i+1]]``.
        offsets: ``[m+1]`` non-decreasing int64 byte offsets into ``data``.
        flags: ``[m]`` ``step + 1`` of each send (ignored by Simple).

    Returns ``(wire, wire_offsets)``: the concatenated wire payloads (uint8) and ``[m+1]``
    int64 offsets, send ``i`` being ``wire[wire_offsets[i]:wire_offsets[i+1]]``.
    """
    protocol = _check_protocol(protocol)
    data = _check_data(data)
    offsets, flags = _check_offsets(offsets, flags, len(data))
    sizes = np.diff(offsets)
    unit, wire_unit = protocol.unit
    units = -(-sizes // unit)
    wire_offsets = np.concatenate([[0], np.cumsum(units * wire_unit)]).astype(np.int64)
    padded = _pad(data[offsets[0]:offsets[-1]], sizes, units * unit)
    return _layout(protocol, padded, np.repeat(flags, units)), wire_offsets


def _layout(protocol: Protocol, padded: np.ndarray, unit_flags, out: np.ndarray | None = None) -> np.ndarray:
    """Wire bytes of whole protocol units of data; ``unit_flags`` is one flag per unit
    (LL line, LL128 slice) or a single flag for all. Written into ``out`` (uint8, the wire
    size) when given."""
    if protocol == Protocol.SIMPLE:
        if out is None:
            return padded.copy()
        out[:] = padded
        return out
    unit_flags = np.asarray(unit_flags, dtype=np.uint64)
    if protocol == Protocol.LL:
        shape = (len(padded) // LL_LINE_DATA_BYTES, LL_LINE_BYTES // LL_HALF_BYTES)
        lines = np.empty(shape, dtype="<u4") if out is None else out.view("<u4").reshape(shape)
        lines[:, _LL_DATA_WORDS] = padded.view("<u4").reshape(-1, 2)
        lines[:, _LL_FLAG_WORDS] = unit_flags.astype("<u4")[..., None]   # NCCL_LL_FLAG: the low 32 bits
        return lines.reshape(-1).view(np.uint8)
    words = padded.view("<u8").reshape(-1, LL128_SLICE_DATA_WORDS)
    # A gather (each wire word from its data word) is several times faster than the scatter.
    if out is None:
        slices = np.take(words, _LL128_WIRE_FROM_DATA, axis=1)
    else:
        slices = out.view("<u8").reshape(len(words), LL128_SLICE_WIRE_WORDS)
        np.take(words, _LL128_WIRE_FROM_DATA, axis=1, out=slices)
    slices[:, LL128_FLAG_WORD::LL128_LINE_WORDS] = unit_flags.astype("<u8")[..., None]
    return slices.reshape(-1).view(np.uint8)


def _pad(data: np.ndarray, sizes: np.ndarray, padded_sizes: np.ndarray) -> np.ndarray:
    """Each send's bytes followed by zeros up to ``padded_sizes``, all concatenated."""
    if (padded_sizes == sizes).all():
        return data
    out = np.zeros(int(padded_sizes.sum()), dtype=np.uint8)
    _copy_segments(data, np.cumsum(sizes) - sizes, sizes, out, np.cumsum(padded_sizes) - padded_sizes)
    return out


@njit(**JIT)
def _copy_segments(src, src_starts, lengths, dst, dst_starts):
    """``dst[dst_starts[i]:][:lengths[i]] = src[src_starts[i]:][:lengths[i]]`` for every i.

    A loop of slice copies: NumPy has no segmented copy, and a byte-index gather or mask
    costs ten times the bytes it moves."""
    for i in range(len(lengths)):
        n = lengths[i]
        dst[dst_starts[i]:dst_starts[i] + n] = src[src_starts[i]:src_starts[i] + n]


def _check_protocol(protocol) -> Protocol:
    if not isinstance(protocol, Protocol):
        raise ValueError(f"protocol {protocol!r} is not one of {', '.join(p.name for p in Protocol)} "
                         f"(a gradtap.wire.protocol.Protocol)")
    return protocol


def _check_data(data) -> np.ndarray:
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError(f"data must be a 1-D uint8 array, got {getattr(data, 'dtype', type(data).__name__)} "
                         f"with shape {getattr(data, 'shape', None)}")
    return np.ascontiguousarray(data)


def _check_offsets(offsets, flags, length: int) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.asarray(offsets, dtype=np.int64)
    flags = np.asarray(flags).astype(np.uint64)
    if offsets.ndim != 1 or len(offsets) < 1 or flags.shape != (len(offsets) - 1,):
        raise ValueError(f"offsets must be [m+1] and flags [m]; got {offsets.shape} and {flags.shape}")
    if offsets[0] < 0 or offsets[-1] > length or (np.diff(offsets) < 0).any():
        raise ValueError(f"offsets must be non-decreasing within 0..{length}")
    return offsets, flags
