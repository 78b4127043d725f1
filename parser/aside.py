"""A stream's copies of units that differ from the iteration's shared gradient.

Every stream places its packets into the iteration's one shared gradient
(``parser/shared_gradient.py``): the first stream to claim a unit writes it, the others
compare their copy with it. A copy that differs is kept here, per stream, with where it
goes, so that the merger can show each stream's own view of a bucket to its vote
(``merger/union.py``): the shared bytes with the stream's differing units laid over them.
Copies that agree, all but a corrupted or misplaced few, are never stored twice.

A copy is also kept when the claiming stream had not yet written the unit (``pending``: two
streams placed the same unit at the same moment). The pipeline compares pending copies
once its parser threads are idle (:func:`reconcile`): one that agrees is dropped and the
stream covers the unit; one that differs stays. That includes the copies of an iteration the
stream retired in the same round (:meth:`AsideCopies.reconciled`): left pending, an equal
copy would stay a copy kept aside, which the merger votes on, instead of a covered unit.

The area holds ``capacity`` units of at most ``stride`` wire bytes each. A differing copy
that finds it full cannot be kept: the unit is then marked *disputed* in the shared
gradient, and no stream covers its block (the merger cannot vote without the copy), which
is an unrecoverable iteration at worst, never a silently wrong one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from gradtap.core.jit import JIT_NO_REFCOUNT
from gradtap.core.memory import copy_bytes, load_acquire
from gradtap.parser.payload import data_differs, store_payload

ASIDE_DTYPE = np.dtype([
    ("slot", np.int64),       # window slot of the unit's iteration (-1: the record is free)
    ("block", np.int64),      # coverage block of the unit
    ("bits", np.int64),       # the unit's bit(s) in the block's bitmap
    ("pending", np.int64),    # 1: not compared yet (the claiming stream had not written the unit)
    ("counted", np.int64),    # 1: the first pending unit of its frame (which was counted as data.written)
    ("protocol", np.int64),
    ("wire_off", np.int64),   # the unit's first byte in its message's wire bytes
    ("dest", np.int64),       # the message's first byte in the gradient
    ("nbytes", np.int64),     # the message's bytes in the gradient
    ("length", np.int64),     # the unit's wire bytes, at data[record * stride:]
])
DEFAULT_CAPACITY = 1024


class Aside(NamedTuple):
    """The area of one stream (the kernel updates it in place)."""

    rec: np.ndarray     # ASIDE_DTYPE[capacity]
    data: np.ndarray    # uint8[capacity * stride]
    used: np.ndarray    # int64[1]: records in use


def new_aside(stride: int, capacity: int = DEFAULT_CAPACITY) -> Aside:
    rec = np.zeros(capacity, ASIDE_DTYPE)
    rec["slot"] = -1
    return Aside(rec, np.zeros(capacity * stride, np.uint8), np.zeros(1, np.int64))


@njit(**JIT_NO_REFCOUNT)
def aside_put(aside, slot, block, bits, pending, counted, protocol, wire_off, dest, nbytes, src, pos, length):
    """Keep ``src[pos:pos+length]``, a unit's wire bytes: the record's index, or -1 when
    there is no room."""
    stride = aside.data.shape[0] // max(1, aside.rec.shape[0])
    if length > stride or length < 0 or pos < 0 or pos + length > src.shape[0]:
        return -1
    for e in range(aside.rec.shape[0]):
        r = aside.rec[e]
        if r["slot"] >= 0:
            continue
        r["slot"], r["block"], r["bits"], r["pending"], r["counted"] = slot, block, bits, pending, counted
        r["protocol"], r["wire_off"], r["dest"], r["nbytes"], r["length"] = protocol, wire_off, dest, nbytes, length
        copy_bytes(aside.data, e * stride, src, pos, length)
        aside.used[0] += 1
        return e
    return -1


@njit(**JIT_NO_REFCOUNT)
def aside_find(aside, slot, block, bits):
    """The record holding unit ``bits`` of ``block`` in ``slot``, or -1."""
    if aside.used[0] == 0:
        return -1
    for e in range(aside.rec.shape[0]):
        r = aside.rec[e]
        if r["slot"] == slot and r["block"] == block and r["bits"] == bits:
            return e
    return -1


@njit(**JIT_NO_REFCOUNT)
def aside_differs(aside, e, src, pos, length):
    """Whether the data of ``src[pos:pos+length]``, another copy of record ``e``'s unit,
    differs from the data kept there (flags aside)."""
    stride = aside.data.shape[0] // max(1, aside.rec.shape[0])
    r = aside.rec[e]
    if r["length"] != length:
        return True
    return data_differs(aside.data, e * stride, src, pos, length, r["protocol"], r["wire_off"])


@njit(**JIT_NO_REFCOUNT)
def aside_free(aside, slot, block):
    """Drop every unit kept of ``block`` in ``slot`` (of every block: ``block`` -1)."""
    if aside.used[0] == 0:
        return
    for e in range(aside.rec.shape[0]):
        r = aside.rec[e]
        if r["slot"] == slot and (block < 0 or r["block"] == block):
            r["slot"] = -1
            aside.used[0] -= 1


@njit(**JIT_NO_REFCOUNT)
def reconcile(aside, grads, written, got):
    """Compare every pending unit with the shared gradient of its slot (``grads[slot]``, whose
    ``written[slot]`` bits say what the claiming stream has written): one that agrees is
    dropped and marked in ``got``; one that differs stays. Returns how many frames counted as
    ``data.written`` hold a unit that differs."""
    stride = aside.data.shape[0] // max(1, aside.rec.shape[0])
    differing = 0
    for e in range(aside.rec.shape[0]):
        r = aside.rec[e]
        s = r["slot"]
        if s < 0 or r["pending"] == 0 or not load_acquire(written[s], r["block"]) & r["bits"]:
            continue
        if store_payload(aside.data, e * stride, r["length"], r["protocol"], r["wire_off"], grads[s], r["dest"],
                         r["nbytes"], True):
            r["pending"] = 0
            differing += r["counted"]
        else:
            got[s, r["block"]] |= r["bits"]
            r["slot"] = -1
            aside.used[0] -= 1
    return differing


@njit(**JIT_NO_REFCOUNT)
def _lay_over(rec, data, stride, out, lo):
    """Write each record's unit into ``out``, the gradient's bytes from ``lo``."""
    for e in range(rec.shape[0]):
        r = rec[e]
        store_payload(data, e * stride, r["length"], r["protocol"], r["wire_off"], out, r["dest"] - lo,
                      r["nbytes"], False)


class AsideCopies:
    """The units a stream kept aside for one iteration (a copy, owned by the holder)."""

    def __init__(self, rec: np.ndarray, data: np.ndarray, stride: int):
        self.rec, self.data, self.stride = rec, data, stride

    def __len__(self) -> int:
        return len(self.rec)

    def _inside(self, lo: int, hi: int, index: np.ndarray) -> np.ndarray:
        """The records of units of the blocks ``index`` whose message lies within ``[lo, hi)``
        (one reaching outside, which no wire plan has, is left out: the stream does not cover
        it there)."""
        rec = self.rec
        if len(rec) == 0:
            return np.zeros(0, np.int64)
        return np.flatnonzero(np.isin(rec["block"], index) & (rec["dest"] >= lo) & (rec["dest"] + rec["nbytes"] <= hi))

    def overlay(self, grad: np.ndarray, lo: int, hi: int, index: np.ndarray) -> np.ndarray:
        """The stream's own view of ``grad[lo:hi]``, whose coverage blocks are ``index``:
        ``grad[lo:hi]`` itself when it kept nothing of them aside, else a copy with its units
        laid over."""
        keep = self._inside(lo, hi, index)
        if len(keep) == 0:
            return grad[lo:hi]
        out = grad[lo:hi].copy()
        _lay_over(self.rec[keep], self.data.reshape(-1, self.stride)[keep].ravel(), self.stride, out, lo)
        return out

    def blocks(self, lo: int, hi: int, index: np.ndarray) -> np.ndarray:
        """The blocks of ``index`` (as global block numbers) where the stream's view of
        ``[lo, hi)`` differs from the shared bytes it was given, or may: those it kept a unit
        of aside."""
        return np.unique(self.rec["block"][self._inside(lo, hi, index)])

    def packed(self, grad: np.ndarray, lo: int, hi: int, index: np.ndarray, start: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray:
        """The stream's own bytes of the blocks ``index`` of its view of ``[lo, hi)``
        (:meth:`overlay`), block after block: block ``j``'s are ``grad[lo + start[j]:][:nbytes[j]]``
        with the units it kept aside laid over. Copies only the messages it kept units of."""
        edges = np.r_[0, np.cumsum(nbytes)].astype(np.int64)
        out = np.empty(int(edges[-1]), np.uint8)
        for j in range(len(index)):
            out[edges[j]:edges[j + 1]] = grad[lo + start[j]:lo + start[j] + nbytes[j]]
        keep = self._inside(lo, hi, index)
        if len(keep) == 0:
            return out
        first, last = lo + start, lo + start + nbytes
        for dest, n in np.unique(np.stack([self.rec["dest"][keep], self.rec["nbytes"][keep]], 1), axis=0).tolist():
            message = self.overlay(grad, dest, dest + n, index)
            for j in np.flatnonzero((first >= dest) & (last <= dest + n)):
                out[edges[j]:edges[j + 1]] = message[first[j] - dest:last[j] - dest]
        return out

    def units(self, got: np.ndarray, lo: int, hi: int, index: np.ndarray) -> np.ndarray:
        """The units the stream holds of each block of ``index`` in its view of ``[lo, hi)``
        (:meth:`overlay`): ``got[index]`` with the bits of the units it kept aside. Reads no
        gradient byte."""
        out = got[index]
        keep = self._inside(lo, hi, index)
        if len(keep):
            order = np.argsort(index)
            at = order[np.searchsorted(index, self.rec["block"][keep], sorter=order)]
            np.bitwise_or.at(out, at, self.rec["bits"][keep].astype(out.dtype))
        return out

    def reconciled(self, grad: np.ndarray, written: np.ndarray, got: np.ndarray) -> tuple[AsideCopies, int]:
        """:func:`reconcile` for an iteration already retired, whose pending copies were copied
        out with it before the claiming streams had written their units: those copies compared
        with ``grad`` where ``written`` says the unit is written, ``got`` marked (in place) for
        each that agrees. The copies left, and how many frames counted as ``data.written``
        hold a unit that differs."""
        if not self.rec["pending"].any():
            return self, 0
        rec = self.rec.copy()
        rec["slot"] = 0
        area = Aside(rec, self.data, np.array([len(rec)], np.int64))
        differing = reconcile(area, (grad,), (written,), got.reshape(1, -1))
        left = np.flatnonzero(rec["slot"] >= 0)
        if len(left) == 0:
            return NOTHING_ASIDE, differing
        rec = rec[left]
        rec["slot"] = self.rec["slot"][left]
        return AsideCopies(rec, self.data.reshape(-1, self.stride)[left].ravel(), self.stride), differing


NOTHING_ASIDE = AsideCopies(np.zeros(0, ASIDE_DTYPE), np.zeros(0, np.uint8), 1)


def kept(aside: Aside, slot: int, free: bool) -> AsideCopies:
    """The units kept of ``slot``'s iteration, copied out; ``free``: and drop them."""
    if aside.used[0] == 0:
        return NOTHING_ASIDE
    stride = aside.data.shape[0] // len(aside.rec)
    mine = np.flatnonzero(aside.rec["slot"] == slot)
    if len(mine) == 0:
        return NOTHING_ASIDE
    rec = aside.rec[mine].copy()
    data = aside.data.reshape(-1, stride)[mine].ravel()
    if free:
        aside_free(aside, slot, -1)
    return AsideCopies(rec, data, stride)
