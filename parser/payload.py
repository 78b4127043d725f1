"""A packet's gradient bytes: written into a gradient, or compared with what it holds.

A packet of an RDMA write carries ``length`` payload bytes that start ``wire_off`` bytes into
its message; the message holds ``nbytes`` of gradient starting at byte ``dest``. Simple
carries the bytes as they are; LL interleaves every 8 data bytes with two 32-bit flags
(``wire/ll.py``); LL128 puts a flag word in each 128-byte line (``wire/ll128.py``). The
flags themselves are checked before (``parser/assemble.py``); here only the data moves.

A parser that writes its gradients alone (no other stream's parser runs beside it) leaves
the copies of Simple payloads for later (:class:`Deferred`): the stage-2 kernel places a
batch's packets in one thread, and :func:`copy_deferred` then copies their payloads with
every thread. Units are published (claimed, written, held) as they are placed, before their
bytes are copied, which only a parser alone may do: another stream's parser would compare
with bytes not yet there. (One stream of GPT-2 small, ICRC off: the copies were 75% of the
kernel's time; deferred, the stream parses in 0.071 s instead of 0.094 s on 2 threads, and
in 0.086 s instead of 0.100 s on one, where the copies come one after another.)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from gradtap.core.jit import JIT_NO_REFCOUNT, JIT_PARALLEL
from gradtap.core.memory import compare_bytes, store_fence, stream_bytes
from gradtap.wire.ll import LL_DATA1_OFF, LL_DATA2_OFF, LL_HALF_BYTES, LL_LINE_BYTES, LL_LINE_DATA_BYTES
from gradtap.wire.ll128 import LL128_SLICE_DATA_WORDS, LL128_SLICE_WIRE_WORDS, LL128_WIRE_TO_DATA, LL128_WORD_BYTES
from gradtap.wire.protocol import Protocol


class Deferred(NamedTuple):
    """Simple payloads placed but not yet copied into their slot's gradient, from the batch
    the kernel is placing (its ``data``). Another copy of a pending unit is compared with the
    pending one's bytes in the batch (:func:`pending_differs`); the parser makes the copies
    before it hands anything on (:func:`copy_deferred`)."""

    ops: np.ndarray     # int64[capacity, 5]: (position in the batch's data, slot, block, position in the slot's
                        # gradient, bytes); the first ``count`` are pending
    count: np.ndarray   # int64[1]
    op_of: np.ndarray   # int64[W, blocks]: the row of ``ops`` that may hold the block's pending copy (a Simple
                        # packet is one coverage block)

    @classmethod
    def room(cls, capacity: int, slots: int = 0, blocks: int = 0) -> Deferred:
        """Room for ``capacity`` copies into ``slots`` gradients of ``blocks`` coverage blocks
        (no room: every payload is copied as it is placed)."""
        return cls(np.zeros((capacity, 5), np.int64), np.zeros(1, np.int64), np.full((slots, blocks), -1, np.int64))

    def grown(self, capacity: int) -> Deferred:
        """The same, with room for ``capacity`` copies (none pending)."""
        assert self.count[0] == 0
        return self._replace(ops=np.zeros((capacity, 5), np.int64))


_OP_DATA, _OP_SLOT, _OP_BLOCK, _OP_DEST, _OP_BYTES = range(5)
_RUN = 64       # copies between two store fences (256 KiB of 4 KiB packets)


@njit(**JIT_NO_REFCOUNT, inline="always")
def defer_payload(deferred, data_pos, length, protocol, wire_off, slot, block, dest, nbytes):
    """Leave :func:`store_payload`'s write of a Simple packet (block ``block`` of slot ``slot``)
    pending, if ``deferred`` has room: True when it did (nothing more to do), False when the
    caller writes it now."""
    j = deferred.count[0]
    op_of = deferred.op_of
    if protocol != Protocol.SIMPLE or j >= deferred.ops.shape[0] or not (0 <= slot < op_of.shape[0]) or \
            not (0 <= block < op_of.shape[1]):
        return False
    n = min(length, nbytes - wire_off)
    if n > 0:
        ops = deferred.ops
        ops[j, _OP_DATA] = data_pos
        ops[j, _OP_SLOT] = slot
        ops[j, _OP_BLOCK] = block
        ops[j, _OP_DEST] = dest + wire_off
        ops[j, _OP_BYTES] = n
        op_of[slot, block] = j
        deferred.count[0] = j + 1
    return True


@njit(**JIT_NO_REFCOUNT, inline="always")
def pending_differs(deferred, slot, block, data, pos, length, wire_off, nbytes):
    """Whether ``length`` payload bytes at ``data[pos]`` (at ``wire_off`` in a Simple message of
    ``nbytes``) differ from the pending copy of block ``block`` of slot ``slot``: -1 when none is
    pending (its bytes are in the gradient), else 1 or 0."""
    op_of = deferred.op_of
    if not (0 <= slot < op_of.shape[0]) or not (0 <= block < op_of.shape[1]):
        return -1
    j = op_of[slot, block]
    ops = deferred.ops
    # A row left from copies made since is pending only while it still names the block.
    if j < 0 or j >= deferred.count[0] or ops[j, _OP_SLOT] != slot or ops[j, _OP_BLOCK] != block:
        return -1
    n = min(length, nbytes - wire_off)
    if n != ops[j, _OP_BYTES]:
        return 1
    return 1 if compare_bytes(data, ops[j, _OP_DATA], data, pos, n) != 0 else 0


@njit(**JIT_PARALLEL)
def copy_deferred(deferred, data, grads):
    """Make the pending copies from ``data`` (the batch they were placed from) into ``grads``
    (the slots' gradients) with every Numba thread, in runs of ``_RUN`` consecutive copies
    (``prange`` gives each thread consecutive runs), with non-temporal stores: an iteration's
    gradient is read once it is complete, long after these bytes have left the caches."""
    ops = deferred.ops
    count = deferred.count[0]
    for r in prange((count + _RUN - 1) // _RUN):
        for j in range(r * _RUN, min(count, (r + 1) * _RUN)):
            stream_bytes(grads[ops[j, _OP_SLOT]], ops[j, _OP_DEST], data, ops[j, _OP_DATA], ops[j, _OP_BYTES])
        store_fence()
    deferred.count[0] = 0


@njit(**JIT_NO_REFCOUNT)
def store_payload(data, start, length, protocol, wire_off, grad, dest, nbytes, compare):
    """Write the data of ``length`` payload bytes (at ``wire_off`` in the message) into
    ``grad[dest : dest + nbytes]`` (the message's elements), never past ``nbytes``. With
    ``compare``, write nothing and return whether ``grad`` holds other bytes there.

    Simple payloads are written with non-temporal stores and fenced before the return, so
    the caller may publish them to other threads at once. Ordinary stores first read every
    line of the gradient they fill (long out of cache), and the atomic that publishes the
    unit then waited for them: GPT-2 small, 3 streams on 2 threads
    (``benchmarks.replay``, 8 alternated rounds of 4 replays): median replay wall 1.23 ->
    1.11 s, parse 1.29 -> 1.17 thread-s."""
    if protocol == Protocol.SIMPLE:
        n = min(length, nbytes - wire_off)
        if n > 0:
            if compare:
                return compare_bytes(grad, dest + wire_off, data, start, n) != 0
            stream_bytes(grad, dest + wire_off, data, start, n)
            store_fence()
    elif protocol == Protocol.LL:
        for j in range(length // LL_LINE_BYTES):
            d = (wire_off // LL_LINE_BYTES + j) * LL_LINE_DATA_BYTES
            line = start + LL_LINE_BYTES * j
            for half in range(2):
                src = line + (LL_DATA2_OFF if half else LL_DATA1_OFF)
                at = d + half * LL_HALF_BYTES
                for b in range(min(LL_HALF_BYTES, nbytes - at)):
                    if not compare:
                        grad[dest + at + b] = data[src + b]
                    elif grad[dest + at + b] != data[src + b]:
                        return True
    else:
        w0 = wire_off // LL128_WORD_BYTES
        for j in range(length // LL128_WORD_BYTES):
            w = w0 + j
            k = LL128_WIRE_TO_DATA[w % LL128_SLICE_WIRE_WORDS]
            if k < 0:
                continue
            d = ((w // LL128_SLICE_WIRE_WORDS) * LL128_SLICE_DATA_WORDS + k) * LL128_WORD_BYTES
            for b in range(min(LL128_WORD_BYTES, nbytes - d)):
                if not compare:
                    grad[dest + d + b] = data[start + LL128_WORD_BYTES * j + b]
                elif grad[dest + d + b] != data[start + LL128_WORD_BYTES * j + b]:
                    return True
    return False


@njit(**JIT_NO_REFCOUNT)
def data_differs(a, a_pos, b, b_pos, length, protocol, wire_off):
    """Whether two copies of the same ``length`` wire bytes (at ``wire_off`` in their
    messages) carry other data: LL and LL128 flags are not data (two hops of a chunk carry
    it with the flags of their own steps)."""
    if protocol == Protocol.SIMPLE:
        return compare_bytes(a, a_pos, b, b_pos, length) != 0
    if protocol == Protocol.LL:
        for j in range(length // LL_LINE_BYTES):
            for off in (LL_DATA1_OFF, LL_DATA2_OFF):
                at = LL_LINE_BYTES * j + off
                if compare_bytes(a, a_pos + at, b, b_pos + at, LL_HALF_BYTES) != 0:
                    return True
        return False
    w0 = wire_off // LL128_WORD_BYTES
    for j in range(length // LL128_WORD_BYTES):
        if LL128_WIRE_TO_DATA[(w0 + j) % LL128_SLICE_WIRE_WORDS] >= 0:
            at = LL128_WORD_BYTES * j
            if compare_bytes(a, a_pos + at, b, b_pos + at, LL128_WORD_BYTES) != 0:
                return True
    return False
