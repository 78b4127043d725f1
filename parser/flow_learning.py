"""Which wire flow is which planned flow: the job's QPNs, learnt from its traffic at lock-on.

A NIC numbers its queue pairs when NCCL connects, so a job's QPNs are not known in advance
(``docs/parser.md``, "Flow learning"). A *wire flow* is what the mirror shows: RDMA WRITEs from
one address to another with one destination QPN. Each planned flow of the stream (a rank's data
QP on one channel and QP index, or its CTS QP) is matched to one wire flow from what the
traffic itself shows:

- **Addresses.** Only a wire flow between the same two ranks, in the same direction, can be a
  planned flow; traffic between other hosts is never looked at.
- **Shape.** NCCL's clear-to-send writes are plain RDMA WRITE_ONLYs of the era's CTS size with
  no immediate; every other write makes a wire flow a data flow.
- **Sizes at their PSNs.** A write starting at PSN ``p`` with RETH length ``L`` fits planned flow
  ``f`` only where ``f`` posts a write of length ``L``, i.e. at iteration bases ``p -
  psn_offset[j]`` (modulo ``f``'s packets per iteration). A wire flow *fits* ``f`` while one base
  explains all its writes. The mirror may lose writes, never invent them, and their lengths are
  ICRC-checked, so a good fit is never refuted; a few misfits are tolerated (``MISFIT_SHARE``)
  so that a rare corrupt frame that passed an unchecked ICRC cannot lock the job out.
  Point-to-point and other jobs' writes between the same hosts fit nothing, or fit one write
  by chance and lose to the wire flow that fits many.
- **Connections.** A CTS goes back on the data's RC connection, so it is the data flow's
  reverse address pair with the same UDP source port (the NIC derives the port from the QP
  pair), or it announces (its ``addr`` field) a slot the data flow later writes to.

Planned flows with identical write sequences (the channels of equal buckets, the QPs of a
split connection) cannot be told apart by sizes. Then the spec's QPN hints decide when given,
otherwise QPN order: NCCL connects channel after channel and QP after QP (``net_ib.cc``
``ncclIbCreateQp`` in a loop), and the NIC numbers QPs in creation order, so the lower QPN is
the lower channel and QP index. The decision is logged, and hints the traffic contradicts are
reported.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from gradtap.parser.flow_match import ELSEWHERE, pair_keys
from gradtap.parser.stream_tables import UNKNOWN_QPN, StreamTables
from gradtap.wire.headers.opcodes import OPCODE_IMMDT_OFF, OPCODE_RETH_OFF, RC_RDMA_WRITE_FIRST, \
    RC_RDMA_WRITE_MIDDLE, RC_RDMA_WRITE_ONLY
from gradtap.wire.psn import psn_delta

MISFIT_SHARE = 0.05         # share of a wire flow's writes that may contradict its planned flow
MAX_STARTS = 4096           # writes of one wire flow narrowed per batch
EVIDENCE_MARGIN = 2         # the chosen wire flow fits at least this many times more writes than a rival
KEEP_ADDRESSES = 64         # RETH and CTS addresses kept per wire flow
KEEP_STRANGERS = 16         # address pairs of RDMA WRITEs between other hosts, kept to explain a failure
MAX_WIRE_FLOWS = 1024       # wire flows between the job's ranks watched (a NIC's job uses a few per rank pair)
EXPLAIN_FLOWS = 16          # wire flows per rank pair listed when explaining a failure
CTS_ADDR_BYTES = 8          # struct ncclIbSendFifo starts with the u64 address of the announced slot


@dataclass
class _Fit:
    """How well one wire flow fits one planned flow."""

    bases: set[int] | None = None    # iteration bases (mod period, from the wire flow's ref) left
    fits: int = 0
    misfits: int = 0

    @property
    def good(self) -> bool:
        return self.fits > 0 and self.misfits <= MISFIT_SHARE * (self.fits + self.misfits)


@dataclass
class WireFlow:
    """What one (source, destination, destination QPN) has shown so far."""

    pair: int                  # index into FlowLearner.pairs
    qpn: int
    sport: int
    frames: int = 0
    writes: int = 0            # writes with a RETH (message starts)
    data: bool = False         # some write is not CTS-shaped
    ref: int = -1              # PSN of its first write: bases are relative to it
    span: int = 0              # PSNs watched past ref
    lengths: Counter = field(default_factory=Counter)
    packet_bytes: int = 0      # largest payload of a WRITE_FIRST or WRITE_MIDDLE: the path MTU
    vas: set[int] = field(default_factory=set)
    announced: set[int] = field(default_factory=set)   # CTS addr fields
    fit: dict[int, _Fit] = field(default_factory=dict)   # planned flow -> fit

    def fitting(self, flows) -> list[int]:
        return [f for f in flows if f in self.fit and self.fit[f].good]


@dataclass(frozen=True)
class Learnt:
    """The outcome: a QPN per planned flow (UNKNOWN_QPN for a CTS flow not seen), how ties
    were broken, and the hints the traffic contradicts."""

    qpn: np.ndarray
    by_order: tuple[str, ...]
    hint_mismatch: tuple[str, ...]


class FlowLearner:
    """Matches a stream's wire flows to its planned flows (see the module docstring)."""

    def __init__(self, tables: StreamTables, adaptive_routing: bool):
        t = self.tables = tables
        self.hint = t.qpn_hint
        self.labels = [t.label(f) for f in range(len(t.qpn))]
        ends = np.concatenate([t.src_ip, t.dst_ip], axis=1)
        self.pairs, self.pair_of = np.unique(ends, axis=0, return_inverse=True)
        self.pair_of = self.pair_of.reshape(-1)
        index = {row.tobytes(): i for i, row in enumerate(self.pairs)}
        # The pair the other way (-1: not the job's).
        self.reverse = [index.get(row[16:].tobytes() + row[:16].tobytes(), -1) for row in self.pairs]
        self.conflict: str | None = None    # why ties between identical flows cannot be broken
        self.wire: dict[tuple[int, int], WireFlow] = {}
        msgs = [t.messages[t.msg_start[f]:t.msg_start[f] + t.msg_count[f]] for f in range(len(t.qpn))]
        cts_sizes = {int(m["wire_bytes"][0]) for f, m in enumerate(msgs) if not t.is_data[f] and len(m)}
        self.cts_bytes = cts_sizes.pop() if len(cts_sizes) == 1 else -1
        # Per planned flow: write length -> PSN offsets, write start position -> length.
        self.offsets = [_by_length(m) for m in msgs]
        self.start_at = [dict(zip(m["psn_offset"].tolist(), m["wire_bytes"].tolist())) for m in msgs]
        # A plain multi-packet write may arrive as one WRITE_ONLY per packet (adaptive routing).
        self.splits = [adaptive_routing and bool(((m["imm"] == 0) & (m["npkts"] > 1)).any()) for m in msgs]
        self.signature = [(int(t.period[f]), m["psn_offset"].tobytes(), m["wire_bytes"].tobytes())
                          for f, m in enumerate(msgs)]
        self.learnt: Learnt | None = None
        self.strangers: Counter = Counter()   # (src, dst) 16-byte addresses -> RDMA WRITEs not between the ranks

    # -- evidence ----------------------------------------------------------------------------

    def keys(self, recs: np.ndarray) -> np.ndarray:
        """Each record's wire flow as ``pair << 24 | qpn``; negative for any other record
        (``flow_match.ELSEWHERE``: a write between other hosts)."""
        return pair_keys(recs, self.pairs)

    def maybe_job(self, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` may be the job's: wire flows between its ranks that are CTS-shaped
        or not yet refuted as data of every planned flow."""
        out = np.zeros(len(keys), bool)
        for k in np.unique(keys[keys >= 0]).tolist():
            w = self.wire.get(k)
            if w is None or not w.data or not w.fit or any(fit.good or fit.fits + fit.misfits == 0
                                                           for fit in w.fit.values()):
                out[keys == k] = True
        return out

    def observe(self, recs: np.ndarray, data: np.ndarray) -> np.ndarray:
        """Take one batch's records in as evidence; returns their :meth:`keys`."""
        key = self.keys(recs)
        if self.learnt is not None:
            return key
        self._count_strangers(recs, key)
        mine = np.flatnonzero(key >= 0)
        if len(mine) == 0:
            return key
        keys, first, inverse = np.unique(key[mine], return_index=True, return_inverse=True)
        order = np.argsort(inverse, kind="stable")          # each wire flow's rows, in order, in one pass
        bounds = np.searchsorted(inverse[order], np.arange(len(keys) + 1))
        for k, (kv, i0) in enumerate(zip(keys.tolist(), first.tolist())):
            w = self.wire.get(kv)
            if w is None:
                if len(self.wire) >= MAX_WIRE_FLOWS:
                    continue                     # a flood of flows between the ranks: watch the first ones
                rec = recs[mine[i0]]
                w = self.wire[kv] = WireFlow(pair=kv >> 24, qpn=kv & 0xFFFFFF, sport=int(rec["udp_sport"]))
            self._take(w, recs, mine[order[bounds[k]:bounds[k + 1]]], data)
        return key

    def _count_strangers(self, recs: np.ndarray, key: np.ndarray) -> None:
        other = key == ELSEWHERE
        if not other.any():
            return
        ends = np.concatenate([recs["src_ip"][other], recs["dst_ip"][other]], axis=1)
        pairs, counts = np.unique(ends, axis=0, return_counts=True)
        for row, n in zip(pairs, counts.tolist()):
            k = (row[:16].tobytes(), row[16:].tobytes())
            if k in self.strangers or len(self.strangers) < KEEP_STRANGERS:
                self.strangers[k] += n

    def _take(self, w: WireFlow, recs: np.ndarray, rows: np.ndarray, data: np.ndarray) -> None:
        """What ``recs[rows]``, the batch's records of ``w`` in order, show of it. The columns
        read are gathered one by one: gathering whole records took 2.8 ms of a GPT-2 small
        stream's first batch (16.5 k frames), a fifth of its parse."""
        w.frames += len(rows)
        opcode = recs["opcode"][rows]
        full = (opcode == RC_RDMA_WRITE_FIRST) | (opcode == RC_RDMA_WRITE_MIDDLE)
        if full.any():
            w.packet_bytes = max(w.packet_bytes, int(recs["payload_len"][rows[full]].max()))
        has_imm = OPCODE_IMMDT_OFF[opcode] >= 0
        cts_shaped = (opcode == RC_RDMA_WRITE_ONLY) & ~has_imm & (recs["payload_len"][rows] == self.cts_bytes)
        w.data |= bool((~cts_shaped).any())
        starts = rows[OPCODE_RETH_OFF[opcode] >= 0]
        if len(starts) == 0:
            return
        psn, reth_len = recs["psn"][starts], recs["reth_len"][starts]
        if w.ref < 0:
            w.ref = int(psn[0])
        w.writes += len(starts)
        for length, n in Counter(reth_len.tolist()).items():
            if length in w.lengths or len(w.lengths) < KEEP_ADDRESSES:
                w.lengths[length] += n
        for va in recs["reth_va"][starts[:KEEP_ADDRESSES]].tolist():
            if va and len(w.vas) < KEEP_ADDRESSES:
                w.vas.add(va)
        if not w.data:
            for i in starts[:max(0, KEEP_ADDRESSES - len(w.announced))].tolist():
                off = int(recs["payload_off"][i])
                if 0 <= off and off + CTS_ADDR_BYTES <= len(data):
                    w.announced.add(int.from_bytes(data[off:off + CTS_ADDR_BYTES].tobytes(), "little"))
            return
        deltas = [psn_delta(w.ref, p) for p in psn[:MAX_STARTS].tolist()]
        w.span = max(w.span, *deltas)
        lengths = reth_len[:MAX_STARTS].tolist()
        only = (recs["opcode"][starts[:MAX_STARTS]] == RC_RDMA_WRITE_ONLY).tolist()
        for f in np.flatnonzero((self.pair_of == w.pair) & self.tables.is_data).tolist():
            fit = w.fit.setdefault(f, _Fit())
            if fit.misfits > MISFIT_SHARE * (fit.fits + fit.misfits) + 8:
                continue                                     # long refuted: stop spending time on it
            self._narrow(f, fit, deltas, lengths, only)

    def _narrow(self, f: int, fit: _Fit, deltas: list[int], lengths: list[int], only: list[bool]) -> None:
        period = int(self.tables.period[f])
        start_at, offsets = self.start_at[f], self.offsets[f]
        for d, length, plain_only in zip(deltas, lengths, only):
            if fit.bases is None:
                offs = offsets.get(length)
                if offs is None:
                    if not (plain_only and self.splits[f]):
                        fit.misfits += 1
                    continue
                fit.bases = {(d - o) % period for o in offs}
                fit.fits += 1
                continue
            keep = {b for b in fit.bases if start_at.get((d - b) % period) == length}
            if keep:
                fit.bases = keep
                fit.fits += 1
            elif not (plain_only and self.splits[f]):
                fit.misfits += 1

    # -- decision ----------------------------------------------------------------------------

    def decide(self) -> Learnt | None:
        """The assignment, once the evidence settles it for every data flow; None until then."""
        if self.learnt is not None:
            return self.learnt
        t = self.tables
        qpn = np.full(len(t.qpn), UNKNOWN_QPN, np.int64)
        by_order: list[str] = []
        self.conflict = None
        for p in range(len(self.pairs)):
            planned = [f for f in np.flatnonzero((self.pair_of == p) & t.is_data).tolist()]
            if planned and not self._assign_pair(p, planned, qpn, by_order):
                return None
        self._assign_cts(qpn)
        mismatch = tuple(f"{self.labels[f]}: hint {int(self.hint[f]):#x}, wire {int(qpn[f]):#x}"
                         for f in range(len(qpn)) if self.hint[f] >= 0 and qpn[f] != UNKNOWN_QPN
                         and qpn[f] != self.hint[f])
        self.learnt = Learnt(qpn, tuple(by_order), mismatch)
        return self.learnt

    def _assign_pair(self, pair: int, planned: list[int], qpn: np.ndarray, by_order: list[str]) -> bool:
        t = self.tables
        wires = [w for w in self.wire.values() if w.pair == pair and w.data and w.fitting(planned)]
        # Planned flows with equal write sequences form one class; a wire flow must fit one class.
        classes: dict[tuple, list[int]] = {}
        for f in planned:
            classes.setdefault(self.signature[f], []).append(f)
        claims: dict[tuple, list[WireFlow]] = {sig: [] for sig in classes}
        for w in wires:
            fitted = {self.signature[f] for f in w.fitting(planned)}
            if len(fitted) > 1:
                if w.fit and max(w.fit[f].fits for f in w.fitting(planned)) > 1:
                    return False                 # still fits two different sequences: wait
                continue                         # one write that fits anything proves nothing
            claims[fitted.pop()].append(w)
        for sig, flows in classes.items():
            ws = sorted(claims[sig], key=lambda w: -sum(w.fit[f].fits for f in flows))
            if len(ws) < len(flows):
                return False
            chosen, rivals = ws[:len(flows)], ws[len(flows):]
            weakest = min(sum(w.fit[f].fits for f in flows) for w in chosen)
            if rivals and weakest < EVIDENCE_MARGIN * max(sum(w.fit[f].fits for f in flows) for w in rivals):
                return False
            for w in chosen:
                for f in flows:
                    fit = w.fit[f]
                    if len(fit.bases) > 1 and w.span < t.period[f]:
                        return False             # the alignment is not settled yet
            order = sorted(flows, key=lambda f: (int(t.channel[f]), int(t.qp_index[f])))
            if len(flows) > 1:
                hinted = {int(self.hint[f]) for f in flows}
                if all(self.hint[f] >= 0 for f in flows) and hinted == {w.qpn for w in chosen}:
                    for f in flows:
                        qpn[f] = self.hint[f]
                    continue
                by_order.append(", ".join(self.labels[f] for f in order))
                self.conflict = self._orders_disagree(sorted(chosen, key=lambda w: w.qpn), order)
                if self.conflict is not None:
                    return False
            for f, w in zip(order, sorted(chosen, key=lambda w: w.qpn)):
                qpn[f] = w.qpn
        return True

    def _orders_disagree(self, by_qpn: list[WireFlow], order: list[int]) -> str | None:
        """Planned flows with identical writes are told apart by QPN order: a NIC numbers QPs
        as they are created, and NCCL connects channels in order. The receiver's QPNs (the
        data flows' destinations) give one order; the sender's NIC gives another, seen as the
        destinations of the CTS writes that come back on each connection (same UDP source
        port). Where both are seen and they disagree, which flow is which channel cannot be
        told, and nothing is assigned (a silently wrong channel would misplace the data)."""
        senders = []
        for w in by_qpn:
            back = [c for c in self.wire.values() if c.pair == self.reverse[w.pair] and not c.data and c.writes
                    and c.sport == w.sport]
            if len(back) != 1:
                return None                      # not seen (a mirror of one direction), nothing to check
            senders.append(back[0].qpn)
        if senders == sorted(senders):
            return None
        pairs = ", ".join(f"{w.qpn:#x}/{s:#x}" for w, s in zip(by_qpn, senders))
        return (f"{', '.join(self.labels[f] for f in order)} write the same sizes, and the two NICs number their "
                f"connections in different orders (receiver/sender QPNs {pairs}), so which flow is which channel "
                "cannot be told; give ring.ranks[].qpn_base hints")

    def _assign_cts(self, qpn: np.ndarray) -> None:
        """Each CTS flow: the CTS-shaped wire flow on the reverse pair of its connection's
        data flow (QP 0) with the same UDP port, or announcing addresses that flow wrote to."""
        t = self.tables
        for f in np.flatnonzero(~t.is_data).tolist():
            data = [g for g in np.flatnonzero(t.is_data & (t.src == t.dst[f]) & (t.dst == t.src[f])
                                              & (t.channel == t.channel[f]) & (t.qp_index == 0)).tolist()
                    if qpn[g] != UNKNOWN_QPN]
            if not data:
                continue
            d = self.wire.get((int(self.pair_of[data[0]]) << 24) | int(qpn[data[0]]))
            if d is None:
                continue
            ctss = [w for w in self.wire.values() if w.pair == self.pair_of[f] and not w.data and w.writes]
            same = [w for w in ctss if w.sport == d.sport] or [w for w in ctss if w.announced & d.vas]
            if len(same) == 1:
                qpn[f] = same[0].qpn

    # -- explanation -------------------------------------------------------------------------

    def explain(self) -> str:
        """Why no assignment yet: per planned data flow, the write sizes it expects, and the
        wire flows between the same ranks with what they showed."""
        t = self.tables
        lines = [self.conflict] if self.conflict else []
        for p in range(len(self.pairs)):
            planned = np.flatnonzero((self.pair_of == p) & t.is_data).tolist()
            if not planned:
                continue
            expect = sorted({length for f in planned for length in self.offsets[f]})
            wires = [w for w in self.wire.values() if w.pair == p]
            lines.append(f"{', '.join(self.labels[f] for f in planned)}: expected write sizes "
                         f"{_few(expect)} B")
            if not wires:
                lines.append("  no RDMA WRITE between these addresses was seen")
            wires.sort(key=lambda w: -w.frames)
            if len(wires) > EXPLAIN_FLOWS:
                lines.append(f"  ({len(wires)} wire flows; the {EXPLAIN_FLOWS} busiest:)")
            for w in sorted(wires[:EXPLAIN_FLOWS], key=lambda w: w.qpn):
                fits = w.fitting(planned)
                what = ("CTS-shaped" if not w.data else
                        f"fits {', '.join(self.labels[f] for f in fits)}" if fits else "fits no planned flow")
                lines.append(f"  QPN {w.qpn:#x}: {w.frames} frames, write sizes "
                             f"{_few(sorted(w.lengths))} B; {what}")
        return "\n".join(lines)


def _by_length(msgs: np.ndarray) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for length, off in zip(msgs["wire_bytes"].tolist(), msgs["psn_offset"].tolist()):
        out.setdefault(length, []).append(off)
    return out


def _few(values: list[int], n: int = 6) -> str:
    shown = ", ".join(str(v) for v in values[:n])
    return shown + (f" and {len(values) - n} more" if len(values) > n else "") if values else "none"
