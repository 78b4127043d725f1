"""Stage 2: place each decoded packet of a locked stream by its PSN and the wire plan.

For every frame record (stage 1, ``parser/decode.py``) of a stream whose flows are locked
(``parser/lockon.py`` found each flow's PSN at an iteration boundary), the kernel:

1. classifies it (ACK, NAK, CNP, READ/ATOMIC, SEND/UD, CTS, unknown flow, ...);
2. takes its position from its PSN relative to the flow's base: iteration = offset //
   period, packet = offset % period (24-bit arithmetic), so a packet lost on the mirror
   link shifts nothing after it;
3. finds the planned RDMA write holding that packet (binary search on ``psn_offset``),
   checks opcode, payload length, RETH address/length and ImmDt against the plan;
4. drops a PSN already seen (retransmission, mirror duplicate);
5. skips reduce-scatter data; for allgather data checks the LL/LL128 flags against the
   connection's step counter and writes the elements into the iteration's gradient buffer
   at the planned offsets, and marks the units of its coverage block(s) it carries.

Iterations are assembled in ``W`` slots. A packet of an iteration past the window stops
the kernel with ``NEED_ADVANCE`` so the caller can retire the oldest slot and call again
from that frame. The kernel never raises and bounds-checks every access; each frame ends
in exactly one event counter.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gradtap.core.memory import copy_bytes
from gradtap.core.jit import JIT
from gradtap.wire import events as ev
from gradtap.wire.headers.aeth import SYNDROME_NAK
from gradtap.wire.headers.opcodes import (KIND_ACK, KIND_ATOMIC, KIND_ATOMIC_ACK, KIND_CNP, KIND_READ_REQUEST,
                                    KIND_READ_RESPONSE, KIND_WRITE, OPCODE_IMMDT_OFF, OPCODE_KIND,
                                    OPCODE_POSITION, OPCODE_RETH_OFF, POS_FIRST, POS_LAST, POS_MIDDLE, POS_ONLY)
from gradtap.wire.ll128 import LL128_WIRE_TO_DATA
from gradtap.workload.wire_plan import NO_VA, PHASE_AG

DONE, NEED_ADVANCE = 0, 1
PSN_MASK = (1 << 24) - 1
SIMPLE, LL, LL128 = 0, 1, 2
LL128_SLICE_WORDS = 256
LL128_DATA_WORDS = 240
LL128_SLICE_WIRE = 2048
LL128_LINE = 128
LINES_PER_SLICE = LL128_SLICE_WIRE // LL128_LINE
MAX_SKIP = 64            # iterations a stream may jump ahead (e.g. after an outage) before a PSN is absurd


@njit(**JIT, inline="always")
def _u32le(buf, at):
    return buf[at] | (buf[at + 1] << 8) | (buf[at + 2] << 16) | (np.uint32(buf[at + 3]) << 24)


@njit(**JIT, inline="always")
def _u64le(buf, at):
    lo = np.uint64(_u32le(buf, at))
    hi = np.uint64(_u32le(buf, at + 4))
    return lo | (hi << np.uint64(32))


@njit(**JIT)
def _find_flow(rec, qpn, src_ip, dst_ip):
    for f in range(qpn.shape[0]):
        if qpn[f] != rec.dest_qp:
            continue
        same = True
        for b in range(16):
            if src_ip[f, b] != rec.src_ip[b] or dst_ip[f, b] != rec.dst_ip[b]:
                same = False
                break
        if same:
            return f
    return -1


@njit(**JIT)
def _find_write(msgs, lo, count, pos):
    """Index of the write whose packets [psn_offset, psn_offset + npkts) hold ``pos``."""
    hi = lo + count - 1
    if count <= 0 or pos < msgs[lo].psn_offset:
        return -1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if msgs[mid].psn_offset <= pos:
            lo = mid
        else:
            hi = mid - 1
    if pos >= msgs[lo].psn_offset + msgs[lo].npkts:
        return -1
    return lo


@njit(**JIT)
def _check_flags(data, start, length, protocol, wire_off, flag):
    """True when every LL/LL128 flag in the packet equals ``flag`` (the step + 1)."""
    if protocol == LL:
        if length % 16:
            return False
        for line in range(start, start + length, 16):
            if _u32le(data, line + 4) != np.uint32(flag & 0xFFFFFFFF) or \
                    _u32le(data, line + 12) != np.uint32(flag & 0xFFFFFFFF):
                return False
    elif protocol == LL128:
        if length % 8 or wire_off % 8:
            return False
        w0 = wire_off // 8
        for j in range(length // 8):
            if LL128_WIRE_TO_DATA[(w0 + j) % LL128_SLICE_WORDS] < 0:
                if _u64le(data, start + 8 * j) != np.uint64(flag):
                    return False
    return True


@njit(**JIT)
def _store(data, start, length, protocol, wire_off, grad, dest, nbytes):
    """Write the data of ``length`` payload bytes (at ``wire_off`` in the message) into
    ``grad[dest : dest + nbytes]`` (the message's elements), never past ``nbytes``."""
    if protocol == SIMPLE:
        n = min(length, nbytes - wire_off)
        if n > 0:
            copy_bytes(grad, dest + wire_off, data, start, n)
    elif protocol == LL:
        for j in range(length // 16):
            d = (wire_off // 16 + j) * 8
            for b in range(4):
                if d + b < nbytes:
                    grad[dest + d + b] = data[start + 16 * j + b]
                if d + 4 + b < nbytes:
                    grad[dest + d + 4 + b] = data[start + 16 * j + 8 + b]
    else:
        w0 = wire_off // 8
        for j in range(length // 8):
            w = w0 + j
            k = LL128_WIRE_TO_DATA[w % LL128_SLICE_WORDS]
            if k < 0:
                continue
            d = ((w // LL128_SLICE_WORDS) * LL128_DATA_WORDS + k) * 8
            for b in range(8):
                if d + b < nbytes:
                    grad[dest + d + b] = data[start + 8 * j + b]


@njit(**JIT)
def _expected_position(k, npkts):
    if npkts == 1:
        return POS_ONLY
    if k == 0:
        return POS_FIRST
    if k == npkts - 1:
        return POS_LAST
    return POS_MIDDLE


@njit(**JIT)
def _classify_other(rec):
    kind = OPCODE_KIND[rec.opcode]
    if kind == KIND_ACK:
        return ev.OTHER_NAK if ((rec.aeth >> 29) & 3) == SYNDROME_NAK else ev.OTHER_ACK
    if kind == KIND_CNP:
        return ev.OTHER_CNP
    if kind == KIND_READ_REQUEST or kind == KIND_READ_RESPONSE or kind == KIND_ATOMIC or kind == KIND_ATOMIC_ACK:
        return ev.OTHER_READ_ATOMIC
    return ev.OTHER_SEND_UD


@njit(**JIT)
def assemble(recs, start, data, qpn, src_ip, dst_ip, is_data, period, msg_start, msg_count, seen_base, conn,
             conn_steps, msgs, bucket_offsets, protocol, elem, mtu, step_bytes, imm_big_endian,
             base_psn, step_base, va_ref, va_step, slot0, slot_ts, grads, got, seen, counters):
    """Process ``recs[start:]``; returns ``(status, next_index)``. See the module docstring.

    ``base_psn[f]`` is the PSN of flow f's first packet in the oldest slot's iteration;
    ``step_base[c]`` the absolute FIFO step of connection c at that iteration's start
    (-1 until a flag teaches it); ``va_ref[c]``/``va_step[c]`` a RETH address and the
    relative step it was seen at (-1 until the first). ``grads`` (a tuple of W equal
    ``uint8[bytes]`` arrays), ``got[W, blocks]`` (bitmask of the block units received) and
    ``seen[W, bits]`` are the slots; slot ``(slot0 + r) % W`` holds iteration r, whose
    earliest data frame time goes to ``slot_ts``.
    """
    nslots = len(grads)
    grad_bytes = grads[0].shape[0]
    for i in range(start, recs.shape[0]):
        rec = recs[i]
        if rec.event != ev.DECODE_OK:
            counters[rec.event] += 1
            continue
        if OPCODE_KIND[rec.opcode] != KIND_WRITE:
            counters[_classify_other(rec)] += 1
            continue
        f = _find_flow(rec, qpn, src_ip, dst_ip)
        if f < 0:
            counters[ev.OTHER_UNKNOWN_FLOW] += 1
            continue
        if not is_data[f]:
            counters[ev.OTHER_CTS] += 1
            continue
        if base_psn[f] < 0:
            counters[ev.DATA_BEFORE_LOCK] += 1
            continue
        rel = (np.int64(rec.psn) - base_psn[f]) & PSN_MASK
        it = rel // period[f]
        pos = rel % period[f]
        if it >= nslots + MAX_SKIP:
            # Far behind the window (a late copy of a retired iteration) or absurdly ahead.
            counters[ev.DATA_OUT_OF_WINDOW] += 1
            continue
        if it >= nslots:
            return NEED_ADVANCE, i
        slot = (slot0 + it) % nslots
        bit = seen_base[f] + pos
        if bit < 0 or bit >= seen.shape[1]:
            counters[ev.DATA_OUT_OF_WINDOW] += 1
            continue
        if seen[slot, bit]:
            counters[ev.DATA_DUPLICATE] += 1
            continue
        w = _find_write(msgs, msg_start[f], msg_count[f], pos)
        if w < 0:
            counters[ev.DATA_OUT_OF_WINDOW] += 1
            continue
        m = msgs[w]
        k = pos - m.psn_offset
        expect_len = min(mtu, m.wire_bytes - k * mtu)
        if expect_len < 0:
            expect_len = 0
        position = OPCODE_POSITION[rec.opcode]
        has_imm = OPCODE_IMMDT_OFF[rec.opcode] >= 0
        has_reth = OPCODE_RETH_OFF[rec.opcode] >= 0
        # A NIC may send a plain multi-packet write as WRITE_ONLYs, each with its own RETH.
        split_only = m.imm == 0 and position == POS_ONLY and not has_imm and m.npkts > 1
        if not split_only and (position != _expected_position(k, m.npkts) or
                               has_imm != (m.imm == 1 and k == m.npkts - 1)):
            counters[ev.DATA_OPCODE_MISMATCH] += 1
            continue
        if rec.payload_len != expect_len or rec.payload_off < 0 or rec.payload_off + rec.payload_len > data.shape[0]:
            counters[ev.DATA_LENGTH_MISMATCH] += 1
            continue
        c = conn[f]
        rel_step = it * conn_steps[c] + m.step
        if has_reth:
            reth_len = rec.payload_len if split_only else m.wire_bytes
            if rec.reth_len != reth_len:
                counters[ev.DATA_LENGTH_MISMATCH] += 1
                continue
            if m.remote_offset == NO_VA:
                if rec.reth_va != 0:
                    counters[ev.DATA_VA_MISMATCH] += 1
                    continue
            else:
                va = np.int64(rec.reth_va) - m.part_offset - (k * mtu if split_only else 0)
                if va_ref[c] < 0:
                    va_ref[c] = va
                    va_step[c] = rel_step
                d = va - va_ref[c]
                if d % step_bytes != 0 or ((d // step_bytes) - (rel_step - va_step[c])) % 8 != 0:
                    counters[ev.DATA_VA_MISMATCH] += 1
                    continue
        if has_imm:
            imm = rec.imm if imm_big_endian else (((rec.imm & 0xFF) << 24) | ((rec.imm & 0xFF00) << 8) |
                                                  ((rec.imm >> 8) & 0xFF00) | (rec.imm >> 24))
            if imm != m.msg_bytes:
                counters[ev.DATA_IMM_MISMATCH] += 1
                continue
        wire_off = m.part_offset + k * mtu
        if protocol != SIMPLE and rec.payload_len > 0:
            if step_base[c] < 0:
                # The connection's step counter is learnt from its first flag (LL: the first
                # line's; LL128: the first flag word, word 15 of a 128-byte line).
                at = 4 if protocol == LL else 8 * (((wire_off // 8) | 15) - wire_off // 8)
                if at + 8 <= rec.payload_len:
                    probe = _u32le(data, rec.payload_off + at) if protocol == LL else \
                        _u64le(data, rec.payload_off + at)
                    step_base[c] = np.int64(probe) - 1 - rel_step
            if not _check_flags(data, rec.payload_off, rec.payload_len, protocol, wire_off,
                                step_base[c] + rel_step + 1):
                counters[ev.DATA_FLAG_MISMATCH] += 1
                continue
        seen[slot, bit] = 1
        if slot_ts[slot] < 0 or rec.ts_ns < slot_ts[slot]:
            slot_ts[slot] = rec.ts_ns
        if m.phase != PHASE_AG:
            counters[ev.OTHER_REDUCE_SCATTER] += 1
            continue
        nbytes = m.nelem * elem
        dest = (bucket_offsets[m.bucket] + m.elem_offset) * elem
        # An empty send (a chunk past the end of a small bucket) writes nothing anywhere.
        if nbytes > 0 and (dest < 0 or dest + nbytes > grad_bytes):
            counters[ev.DATA_OUT_OF_WINDOW] += 1
            continue
        _store(data, rec.payload_off, rec.payload_len, protocol, wire_off, grads[slot], dest, nbytes)
        if m.block >= 0:
            if protocol == LL128:
                # Mark the 128-byte lines this packet carries, slice by slice.
                for line in range(wire_off // LL128_LINE, (wire_off + rec.payload_len) // LL128_LINE):
                    b = m.block + line // LINES_PER_SLICE
                    if b < got.shape[1]:
                        got[slot, b] |= 1 << (line % LINES_PER_SLICE)
            elif m.block + k < got.shape[1]:
                got[slot, m.block + k] |= 1
        counters[ev.DATA_WRITTEN] += 1
    return DONE, recs.shape[0]
