"""The per-flow counters of ``gradtap inspect``, in tables sized to what they hold.

A hostile capture can hold millions of flows of one frame each, so nothing here is per flow
and fixed-size beyond a few words, and every table grows by doubling (amortised, never by
concatenating per batch):

- **flows**: an open-addressing hash table (``slots``, load at most 1/2) over the flows'
  keys (IP version, source and destination address, destination QP, as 5 words), with one
  row of :data:`N_COLUMNS` counters per flow, numbered in order of first appearance;
- **opcodes**: frames per (flow, opcode), a sparse table keyed ``flow << 8 | opcode`` (a
  flow shows a few opcodes, not 256);
- **not tracked**: past ``limit`` flows a new flow is not given a row: its frames are
  counted, and its key's 64-bit fingerprint is kept in a hash set so that distinct flows
  are counted too. The set stops growing at :data:`UNTRACKED_EXACT` fingerprints (64 MiB);
  past that the count of flows not tracked is a lower bound (``flows_exact`` false).

Memory: about 200 bytes per tracked flow plus 16 per flow not tracked, at most
``limit x 200 B + 64 MiB`` whatever the capture (a flow showing all 256 opcodes costs 8 KiB,
so the worst case is ``limit x 8 KiB``; see ``docs/inspect.md``).

The kernels stop at the record where a table is full and return its index; the Python side
doubles that table and calls again from there, so no record is counted twice.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

import numpy as np
from numba import njit

from gradtap.core.jit import JIT
from gradtap.parser.decode import is_roce
from gradtap.parser.line_format import is_ll, is_ll128
from gradtap.wire.events import DECODE_OK
from gradtap.wire.frame_record import ICRC_BAD
from gradtap.wire.headers.opcodes import (KIND_ATOMIC, KIND_READ_REQUEST, KIND_SEND, KIND_WRITE,
                                          OPCODE_KIND, OPCODE_VALID)
from gradtap.wire.ll128 import LL128_LINE_BYTES
from gradtap.wire.protocol import Protocol
from gradtap.wire.psn import PSN_HALF, psn_ahead

MAX_SAMPLES = 64
MIXED = "mixed"                  # a flow whose packets show more than one protocol
UNTRACKED_EXACT = 1 << 22        # fingerprints of flows not tracked kept (in 2^23 slots of 8 B)
KEY_WORDS = 5                    # src (2 words), dst (2), version << 32 | QP

# Columns of the per-flow counters (int64[flows, N_COLUMNS]).
FRAMES, PAYLOAD, PSN_FIRST, PSN_LAST, TOP, GAPS, SAMPLED, LL_PASS, LL128_PASS, SPORT = range(10)
N_COLUMNS = 10
# Cells of FlowArrays.counts.
FLOWS, OP_ENTRIES, UNTRACKED_FLOWS, UNTRACKED_FRAMES, UNTRACKED_FULL = range(5)

DONE = -1                        # a kernel's return when it took every record


class FlowArrays(NamedTuple):
    """The tables the kernels read and write (see the module docstring)."""

    slots: np.ndarray      # int64[S]: flow id + 1 (0: empty), S a power of two
    keys: np.ndarray       # uint64[rows, KEY_WORDS]
    state: np.ndarray      # int64[rows, N_COLUMNS]
    op_keys: np.ndarray    # int64[P]: flow << 8 | opcode (-1: empty), P a power of two
    op_counts: np.ndarray  # int64[P]: frames
    untracked: np.ndarray  # uint64[U]: fingerprints of flows not tracked (0: empty), U 0 or a power of two
    counts: np.ndarray     # int64[5]: FLOWS, OP_ENTRIES, UNTRACKED_FLOWS, UNTRACKED_FRAMES, UNTRACKED_FULL


@njit(**JIT, inline="always")
def _mix(x):
    """splitmix64's finaliser: a 64-bit hash of a 64-bit word (uint64)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(**JIT, inline="always")
def _hash(key):
    h = np.uint64(0x9E3779B97F4A7C15)
    for w in range(KEY_WORDS):
        h = _mix(h ^ key[w])
    return h


@njit(**JIT, inline="always")
def _find(slots, keys, key, h):
    """The slot holding ``key``, or the empty slot where it would go."""
    mask = np.uint64(len(slots) - 1)
    s = h & mask
    while True:
        f = slots[s] - 1
        if f < 0:
            return s
        same = True
        for w in range(KEY_WORDS):
            if keys[f, w] != key[w]:
                same = False
                break
        if same:
            return s
        s = (s + np.uint64(1)) & mask


@njit(**JIT)
def _assign(keys, roce, start, t, limit, insert, ids):
    """``ids[i]``: record ``i``'s flow (-1: not RoCEv2, -2: a flow not tracked), from record
    ``start`` on, adding new flows when ``insert`` (up to ``limit``; beyond, counted as not
    tracked). Returns :data:`DONE`, or the record at which a table must grow first."""
    counts = t.counts
    for i in range(start, len(keys)):
        if not roce[i]:
            ids[i] = -1
            continue
        key = keys[i]
        h = _hash(key)
        s = _find(t.slots, t.keys, key, h)
        if t.slots[s] > 0:
            ids[i] = t.slots[s] - 1
            continue
        ids[i] = -2
        if not insert:
            continue
        f = counts[FLOWS]
        if f < limit:
            if f == len(t.keys) or 2 * (f + 1) > len(t.slots):
                return i
            t.keys[f] = key
            t.state[f] = 0
            t.state[f, TOP] = -1
            t.slots[s] = f + 1
            counts[FLOWS] = f + 1
            ids[i] = f
            continue
        n = len(t.untracked)
        if 2 * (counts[UNTRACKED_FLOWS] + 1) > n and n < 2 * UNTRACKED_EXACT:
            return i
        counts[UNTRACKED_FRAMES] += 1
        fp = _mix(h ^ np.uint64(0xD6E8FEB86659FD93)) | np.uint64(1)   # nonzero: 0 marks empty
        mask = np.uint64(n - 1)
        u = fp & mask
        while t.untracked[u] != 0 and t.untracked[u] != fp:
            u = (u + np.uint64(1)) & mask
        if t.untracked[u] == fp:
            continue
        if 2 * (counts[UNTRACKED_FLOWS] + 1) > n:
            counts[UNTRACKED_FULL] = 1                # the set is full: from here on a lower bound
            continue
        t.untracked[u] = fp
        counts[UNTRACKED_FLOWS] += 1
    return DONE


@njit(**JIT)
def _rehash_flows(keys, n, slots):
    for f in range(n):
        s = _find(slots, keys, keys[f], _hash(keys[f]))
        slots[s] = f + 1


@njit(**JIT)
def _rehash_ops(old_keys, old_counts, keys, counts):
    mask = np.uint64(len(keys) - 1)
    for j in range(len(old_keys)):
        k = old_keys[j]
        if k < 0:
            continue
        s = _mix(np.uint64(k)) & mask
        while keys[s] >= 0:
            s = (s + np.uint64(1)) & mask
        keys[s] = k
        counts[s] = old_counts[j]


@njit(**JIT)
def _rehash_set(old, new):
    mask = np.uint64(len(new) - 1)
    for fp in old:
        if fp != 0:
            u = fp & mask
            while new[u] != 0:
                u = (u + np.uint64(1)) & mask
            new[u] = fp


@njit(**JIT)
def _accumulate(records, ids, start, data, t):
    """Add records ``start:`` of a decoded batch to their tracked flows' counters, in arrival
    order. Returns :data:`DONE`, or the record at which the opcode table must grow first."""
    state, counts = t.state, t.counts
    mask = np.uint64(len(t.op_keys) - 1)
    for i in range(start, len(records)):
        f = ids[i]
        if f < 0:
            continue
        rec = records[i]
        opcode = rec["opcode"]
        okey = (f << 8) | opcode
        s = _mix(np.uint64(okey)) & mask
        while t.op_keys[s] >= 0 and t.op_keys[s] != okey:
            s = (s + np.uint64(1)) & mask
        if t.op_keys[s] < 0:
            if 2 * (counts[OP_ENTRIES] + 1) > len(t.op_keys):
                return i
            t.op_keys[s] = okey
            counts[OP_ENTRIES] += 1
        t.op_counts[s] += 1
        psn = np.int64(rec["psn"])
        if state[f, FRAMES] == 0:
            state[f, PSN_FIRST] = psn
            state[f, SPORT] = rec["udp_sport"]
        state[f, FRAMES] += 1
        state[f, PSN_LAST] = psn
        state[f, PAYLOAD] += rec["payload_len"]
        kind = OPCODE_KIND[opcode] if OPCODE_VALID[opcode] else 0
        request = kind == KIND_SEND or kind == KIND_WRITE or kind == KIND_READ_REQUEST or kind == KIND_ATOMIC
        if request and rec["icrc"] != ICRC_BAD:  # a corrupted PSN would make up a gap
            if state[f, TOP] < 0:
                state[f, TOP] = psn
            else:
                ahead = psn_ahead(state[f, TOP], psn)
                if 0 < ahead < PSN_HALF:
                    state[f, GAPS] += ahead > 1
                    state[f, TOP] = psn
        if (rec["event"] == DECODE_OK and (kind == KIND_WRITE or kind == KIND_SEND)
                and rec["payload_len"] >= LL128_LINE_BYTES and state[f, SAMPLED] < MAX_SAMPLES):
            state[f, SAMPLED] += 1
            state[f, LL_PASS] += is_ll(data, rec["payload_off"], rec["payload_len"])
            state[f, LL128_PASS] += is_ll128(data, rec["payload_off"], rec["payload_len"])
    return DONE


def record_keys(records: np.ndarray) -> np.ndarray:
    """uint64[n, KEY_WORDS]: each record's flow key (meaningless where it is not RoCEv2)."""
    keys = np.empty((len(records), KEY_WORDS), np.uint64)
    keys[:, 0:2] = np.ascontiguousarray(records["src_ip"]).view(np.uint64)
    keys[:, 2:4] = np.ascontiguousarray(records["dst_ip"]).view(np.uint64)
    keys[:, 4] = (records["ip_version"].astype(np.uint64) << np.uint64(32)) | records["dest_qp"]
    return keys


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class FlowTable:
    """Flow keys -> dense ids in order of first appearance, and their counters.

    Parameters
    ----------
    limit:
        Flows tracked one by one (>= 1); the frames of further flows are counted, and the
        flows themselves as far as :data:`UNTRACKED_EXACT` allows.
    """

    def __init__(self, limit: int):
        self.limit = limit
        rows = min(limit, 64)
        self.t = FlowArrays(slots=np.zeros(_pow2_at_least(2 * rows), np.int64),
                            keys=np.zeros((rows, KEY_WORDS), np.uint64), state=np.zeros((rows, N_COLUMNS), np.int64),
                            op_keys=np.full(256, -1, np.int64), op_counts=np.zeros(256, np.int64),
                            untracked=np.zeros(0, np.uint64), counts=np.zeros(5, np.int64))

    def __len__(self) -> int:
        return int(self.t.counts[FLOWS])

    @property
    def untracked(self) -> dict:
        c = self.t.counts
        return {"limit": self.limit, "flows": int(c[UNTRACKED_FLOWS]), "frames": int(c[UNTRACKED_FRAMES]),
                "flows_exact": not c[UNTRACKED_FULL]}

    def assign(self, records: np.ndarray, insert: bool = True) -> np.ndarray:
        """int64 flow id of every record: -1 if not RoCEv2, -2 if its flow is not tracked.
        With ``insert``, new flows are added (and counted when past the limit)."""
        keys, roce = record_keys(records), is_roce(records)
        ids = np.empty(len(records), np.int64)
        start = 0
        while (start := _assign(keys, roce, start, self.t, self.limit, insert, ids)) != DONE:
            self._grow_flows()
        return ids

    def accumulate(self, records: np.ndarray, ids: np.ndarray, data: np.ndarray) -> None:
        """Count ``records`` (a decoded batch over the frame bytes ``data``) in their flows."""
        start = 0
        while (start := _accumulate(records, ids, start, data, self.t)) != DONE:
            keys = np.full(2 * len(self.t.op_keys), -1, np.int64)
            counts = np.zeros(len(keys), np.int64)
            _rehash_ops(self.t.op_keys, self.t.op_counts, keys, counts)
            self.t = self.t._replace(op_keys=keys, op_counts=counts)

    def _grow_flows(self) -> None:
        t, n = self.t, len(self)
        if n < self.limit and n == len(t.keys):
            rows = min(self.limit, 2 * n)
            keys, state = np.zeros((rows, KEY_WORDS), np.uint64), np.zeros((rows, N_COLUMNS), np.int64)
            keys[:n], state[:n] = t.keys[:n], t.state[:n]
            t = t._replace(keys=keys, state=state)
        if n < self.limit and 2 * (n + 1) > len(t.slots):
            slots = np.zeros(2 * len(t.slots), np.int64)
            _rehash_flows(t.keys, n, slots)
            t = t._replace(slots=slots)
        if n >= self.limit and 2 * (t.counts[UNTRACKED_FLOWS] + 1) > len(t.untracked):
            new = np.zeros(max(1024, 2 * len(t.untracked)), np.uint64)
            _rehash_set(t.untracked, new)
            t = t._replace(untracked=new)
        self.t = t

    def describe(self) -> list[dict]:
        """Every tracked flow as the JSON summary gives it, in order of first appearance."""
        t, n = self.t, len(self)
        used = t.op_keys >= 0
        order = np.argsort(t.op_keys[used], kind="stable")
        op_keys, op_counts = t.op_keys[used][order], t.op_counts[used][order]
        bounds = np.searchsorted(op_keys >> 8, np.arange(n + 1)).tolist()
        ops = [str(k) for k in (op_keys & 0xFF).tolist()]
        op_counts = op_counts.tolist()
        keys = t.keys[:n]
        versions = (keys[:, 4] >> np.uint64(32)).tolist()
        qps = (keys[:, 4] & np.uint64(0xFFFFFFFF)).tolist()
        src, dst = _addresses(keys[:, 0:2], versions), _addresses(keys[:, 2:4], versions)
        out = []
        for f, row in enumerate(t.state[:n].tolist()):
            lo, hi = bounds[f], bounds[f + 1]
            if row[SAMPLED] == 0:
                protocol = "unknown"
            elif row[LL_PASS] == row[SAMPLED]:
                protocol = Protocol.LL.nccl_name
            elif row[LL128_PASS] == row[SAMPLED]:
                protocol = Protocol.LL128.nccl_name
            elif row[LL_PASS] or row[LL128_PASS]:
                protocol = MIXED            # calls in several protocols on one connection
            else:
                protocol = Protocol.SIMPLE.nccl_name
            out.append({"src": src[f], "dst": dst[f], "dest_qp": qps[f], "udp_sport": row[SPORT],
                        "frames": row[FRAMES], "opcodes": dict(zip(ops[lo:hi], op_counts[lo:hi])),
                        "payload_bytes": row[PAYLOAD], "psn_first": row[PSN_FIRST], "psn_last": row[PSN_LAST],
                        "psn_gaps": row[GAPS], "nccl_protocol": protocol})
        return out


def _addresses(words: np.ndarray, versions: list[int]) -> list[str]:
    """Flow keys' 16-byte addresses (``words``: uint64[n, 2]) as ``ipaddress`` prints them (IPv4
    from ``::ffff:a.b.c.d``), each distinct one formatted once."""
    raw = np.ascontiguousarray(words).view(np.uint8).reshape(-1, 16)
    names: dict[tuple[bytes, int], str] = {}
    out = []
    for a, version in zip(map(bytes, raw), versions):
        name = names.get((a, version))
        if name is None:
            addr = ipaddress.IPv6Address(a)
            name = names[(a, version)] = str(addr.ipv4_mapped) if version == 4 and addr.ipv4_mapped else str(addr)
        out.append(name)
    return out
