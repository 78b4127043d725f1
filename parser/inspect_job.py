"""``gradtap inspect --job``: which captured flows are which flows of the job's wire plan, and
their RDMA WRITE messages by phase and bucket.

Which wire flow is which planned flow is decided exactly as the stream parser decides it at
lock-on, from the same evidence, so that ``inspect`` and ``replay`` agree:

1. **Learning** (:class:`~parser.flow_learning.FlowLearner`, as :class:`~parser.lockon.LockOn`
   drives it): for a mirror stream of the job, each planned flow gets the destination QPN of
   the wire flow between the same ranks whose write sizes fit it at their PSNs (CTS flows:
   the reverse pair of their data flow, by UDP port or announced address). Point-to-point and
   other traffic between the same hosts fits no planned flow and stays unassigned.
2. **Alignment**: LockOn keeps narrowing each learnt data flow's iteration bases with its
   writes; when the sizes leave several, the first iteration boundary (a pause of
   ``job.appliance.iteration_gap_ns`` in the job's traffic) places the flow
   (:meth:`~parser.lockon.LockOn.place`), and a plan the boundary contradicts is reported
   (:func:`~parser.lockon.misplaced`) as replay would refuse it.

The capture's stream is the one named, else the job's mirror stream whose learner assigns the
most planned flows (first in the spec on a tie); a capture none of them learns is reported with
the learner's explanation. Only tracked flows (``parser/inspect_flows.py``) are shown to the
learners, and of those only the first :data:`LEARNER_FLOWS` wire flows between the job's ranks
per stream (the learner keeps state and spends time per wire flow): this bounds memory and time on
hostile captures, and on a capture within both limits it is what replay sees.

Counting (a second pass over the file, once the mapping is known, so that nothing is held in
memory meanwhile): a message starts with a RETH (WRITE FIRST or ONLY, decoded whole with an
ICRC that is not bad); one whose start PSN is among its flow's last :data:`DEDUP_WINDOW` ones
is a retransmission or a duplicate and counted once. A data flow's message lands on the
planned message its PSN (relative to the flow's iteration base, modulo the flow's packets per
iteration) starts, if that one has its size; a CTS flow's message is a CTS if it has the plan's
CTS size. On a flow with adaptive routing, a plain multi-packet write that arrives as one
WRITE_ONLY per packet counts once, at its first packet. Everything else between two of the
job's ranks (messages that land nowhere, flows the learner left unassigned, flows not tracked)
is ``other``. Buckets count data messages (reduce-scatter and allgather), not CTS.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from gradtap.parser.flow_learning import FlowLearner
from gradtap.parser.inspect_flows import FlowTable
from gradtap.parser.lockon import LockOn, misplaced
from gradtap.parser.stream_tables import UNKNOWN_QPN, StreamTables, ip16, stream_tables
from gradtap.wire.events import DECODE_OK
from gradtap.wire.frame_record import ICRC_BAD
from gradtap.wire.headers.opcodes import KIND_WRITE, OPCODE_KIND, OPCODE_RETH_OFF, RC_RDMA_WRITE_ONLY
from gradtap.wire.psn import psn_add, psn_delta
from gradtap.workload.spec import JobSpec
from gradtap.workload.wire_plan import CTS, PHASE_AG, PHASE_RS, WirePlan

PHASE_NAMES = ("reduce-scatter", "allgather", "CTS", "other")
DEDUP_WINDOW = 1024
HOLD_RECORDS = 1 << 16      # job writes held from an iteration boundary until the flows are resolved
LEARNER_FLOWS = 1024        # wire flows between the job's ranks shown to one stream's learner

NOT_SHOWN = DECODE_OK + 1   # any event but DECODE_OK: the learner and LockOn pass such a record by
SIZES, BOUNDARY, AMBIGUOUS = "sizes", "boundary", "ambiguous"   # how a data flow was aligned


@dataclass
class _Stream:
    """One mirror stream of the job, learning from the capture as its stream parser would."""

    name: str
    plan_flows: np.ndarray            # plan flow index of each stream flow
    lock: LockOn
    base: np.ndarray                  # int64[F]: PSN at which each data flow's iteration begins (-1: not placed)
    held: list[np.ndarray] = field(default_factory=list)   # job writes since the pending boundary
    pending: bool = False
    placed: bool = False              # placed at a boundary the plan did not contradict
    refused: str | None = None
    unseen: bool = False              # wire flows past LEARNER_FLOWS were not shown to the learner

    @property
    def tables(self) -> StreamTables:
        return self.lock.tables

    @property
    def done(self) -> bool:
        data = self.tables.data_flows
        return self.lock.learnt is not None and self.placed and bool((self.base[data] >= 0).all())

    def observe(self, recs: np.ndarray, data: np.ndarray) -> None:
        if self.lock.learnt is None:
            recs = self._admit(recs)
        boundary = self.lock.observe(recs, data)
        if self.placed:
            self.lock.place(recs, 0, self.base)      # data flows silent at the boundary: their first writes
            return
        if boundary is not None and not self.pending:
            self.pending, self.held = True, []
            recs = recs[boundary.index:]
        if not self.pending:
            return
        self.held.append(recs[self.lock.learner.keys(recs) >= 0])
        if not self.lock.resolved():
            if sum(len(h) for h in self.held) > HOLD_RECORDS:
                self.pending, self.held = False, []   # as the stream parser does: wait for a later boundary
            return
        held = np.concatenate(self.held)
        self.pending, self.held = False, []
        wrong = misplaced(self.tables, self.lock.place(held, 0, self.base))
        if wrong:
            self.base[:] = -1
            self.refused = self.refused or wrong
        else:
            self.placed = True

    def _admit(self, recs: np.ndarray) -> np.ndarray:
        """``recs`` with the writes of wire flows past the first :data:`LEARNER_FLOWS` the learner
        has seen masked out: the learner keeps state per wire flow and its work per batch grows
        with the wire flows in it, and a job's stream has a few dozen (channels x QPs x 2)."""
        learner = self.lock.learner
        keys = learner.keys(recs)
        room = LEARNER_FLOWS - len(learner.wire)
        seen = np.flatnonzero(keys >= 0)
        uniq, first = np.unique(keys[seen], return_index=True)
        new = [k for _, k in sorted(zip(first.tolist(), uniq.tolist())) if k not in learner.wire]
        if len(new) <= room:
            return recs
        self.unseen = True
        out = recs.copy()
        out["event"][np.isin(keys, new[max(room, 0):])] = NOT_SHOWN
        return out

    def assigned(self) -> int:
        return int((self.tables.qpn != UNKNOWN_QPN).sum()) if self.lock.learnt is not None else 0


@dataclass(frozen=True)
class JobFlows:
    """The outcome of learning: the stream chosen, its tables with the learnt QPNs, and each
    data flow's iteration base and how it was found."""

    stream: str | None
    tables: StreamTables | None
    plan_flows: np.ndarray       # plan flow of each stream flow
    base: np.ndarray             # int64[F] (-1: CTS flows, flows not learnt)
    alignments: np.ndarray       # int64[F]: iteration bases the write sizes left
    aligned_by: tuple[str, ...]  # SIZES, BOUNDARY or AMBIGUOUS per flow ("" for CTS)
    detail: str                  # why nothing was learnt, or what the learner was not shown ("": nothing to say)
    refused: str | None          # a boundary contradicted the plan (as replay would refuse it)


class JobLearner:
    """Pass one: feed every batch's records (flows not tracked masked out) to a learner per
    candidate mirror stream; :meth:`finish` picks the stream."""

    def __init__(self, job: JobSpec, plan: WirePlan, stream: str | None):
        mirrors = job.mirrors if stream is None else [job.mirror(stream)]
        self.streams = []
        for m in mirrors:
            t = stream_tables(job, plan, m)
            self.streams.append(_Stream(m.name, plan.flows_of(m.rank, m.direction),
                                        LockOn(t, job.appliance.iteration_gap_ns,
                                               FlowLearner(t, job.nccl.adaptive_routing)),
                                        np.full(len(t.qpn), -1, np.int64)))

    def observe(self, recs: np.ndarray, data: np.ndarray, ids: np.ndarray) -> None:
        """One decoded batch over its bytes ``data``; ``ids``: its flow ids (-2: not tracked)."""
        if (ids == -2).any():
            recs = recs.copy()
            recs["event"][ids == -2] = NOT_SHOWN
        for s in self.streams:
            if not s.done:
                s.observe(recs, data)

    def finish(self) -> JobFlows:
        learnt = [s for s in self.streams if s.lock.learnt is not None]
        if not learnt:
            detail = "\n".join(f"stream {s.name}: {s.lock.learner.explain()}{_unseen(s)}" for s in self.streams)
            return JobFlows(None, None, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), (),
                            detail, None)
        s = max(learnt, key=lambda s: (s.assigned(), -self.streams.index(s)))
        t, base = s.tables, s.base.copy()
        alignments = np.ones(len(t.qpn), np.int64)
        aligned_by = [""] * len(t.qpn)
        for f in t.data_flows.tolist():
            cands = sorted(s.lock.candidates.get(f, ()))
            alignments[f] = len(cands)
            if len(cands) == 1:
                aligned_by[f] = SIZES
            elif base[f] >= 0:
                aligned_by[f] = BOUNDARY
            else:
                aligned_by[f] = AMBIGUOUS
            if base[f] < 0 and cands:       # no boundary placed it: the first candidate
                base[f] = psn_add(s.lock.ref[f], cands[0])
        return JobFlows(s.name, t, s.plan_flows, base, alignments, tuple(aligned_by), _unseen(s).strip(), s.refused)


def _unseen(s: _Stream) -> str:
    return (f"\n  wire flows between the job's ranks past the first {LEARNER_FLOWS} were not shown to the learner "
            "(they count as other)" if s.unseen else "")


def _phase(message) -> str:
    if message["kind"] == CTS:
        return "CTS"
    return {PHASE_RS: "reduce-scatter", PHASE_AG: "allgather"}.get(int(message["phase"]), "other")


class JobCounter:
    """Pass two: count the messages of every tracked flow between two of the job's ranks on
    the learnt mapping (see the module docstring)."""

    def __init__(self, job: JobSpec, plan: WirePlan, learnt: JobFlows, flows: FlowTable):
        self.job, self.plan, self.learnt = job, plan, learnt
        self.ranks = np.stack([ip16(r.ip) for r in job.ring.ranks])
        t = learnt.tables
        keys = flows.t.keys[:len(flows)]
        src = self._rank_of(np.ascontiguousarray(keys[:, 0:2]).view(np.uint8))
        dst = self._rank_of(np.ascontiguousarray(keys[:, 2:4]).view(np.uint8))
        between = (src >= 0) & (dst >= 0) & (src != dst)
        # Per tracked flow: its stream flow (>= 0), -1 between two ranks but not the job's, -2 elsewhere.
        self.stream_flow = np.where(between, -1, -2).astype(np.int64)
        learnt_flows = [] if t is None else np.flatnonzero(t.qpn != UNKNOWN_QPN).tolist()
        for f in learnt_flows:
            same = (between & (keys[:, 0:2] == t.src_ip[f].view(np.uint64)).all(axis=1)
                    & (keys[:, 2:4] == t.dst_ip[f].view(np.uint64)).all(axis=1)
                    & ((keys[:, 4] & np.uint64(0xFFFFFFFF)) == np.uint64(t.qpn[f])))
            self.stream_flow[same] = f
        self.counts = {f: np.zeros(int(t.msg_count[f]), np.int64) for f in learnt_flows}
        self.other: dict[int, int] = {}
        self.untracked_other = 0
        self.recent: dict[int, tuple[set, deque]] = {}
        self.cts_bytes = {int(m["wire_bytes"]) for m in plan.messages if m["kind"] == CTS}

    def feed(self, recs: np.ndarray, ids: np.ndarray) -> None:
        """One decoded batch and its flow ids (``FlowTable.assign(..., insert=False)``)."""
        opcode = recs["opcode"]
        starts = ((recs["event"] == DECODE_OK) & (OPCODE_KIND[opcode] == KIND_WRITE)
                  & (OPCODE_RETH_OFF[opcode] >= 0) & (recs["icrc"] != ICRC_BAD))
        tracked = starts & (ids >= 0)
        mine = np.flatnonzero(tracked)[self.stream_flow[ids[tracked]] != -2]
        untracked = np.flatnonzero(starts & (ids == -2))
        if len(untracked):
            src = self._rank_of(recs["src_ip"][untracked])
            dst = self._rank_of(recs["dst_ip"][untracked])
            self.untracked_other += int(((src >= 0) & (dst >= 0) & (src != dst)).sum())
        for i in mine.tolist():
            g = int(ids[i])
            f = int(self.stream_flow[g])
            psn, length = int(recs["psn"][i]), int(recs["reth_len"][i])
            if f >= 0 and self._repeat(f, psn):
                continue
            j = self._lands(f, psn, length, int(opcode[i])) if f >= 0 else -1
            if j >= 0:
                self.counts[f][j] += 1
            elif j == -1:
                self.other[g] = self.other.get(g, 0) + 1

    def _rank_of(self, addresses: np.ndarray) -> np.ndarray:
        """Ring position of each 16-byte address (-1: not a rank's)."""
        out = np.full(len(addresses), -1, np.int64)
        for r, ip in enumerate(self.ranks):
            out[(addresses == ip).all(axis=1)] = r
        return out

    def _repeat(self, f: int, psn: int) -> bool:
        seen, order = self.recent.setdefault(f, (set(), deque()))
        if psn in seen:
            return True
        seen.add(psn)
        order.append(psn)
        if len(order) > DEDUP_WINDOW:
            seen.discard(order.popleft())
        return False

    def _lands(self, f: int, psn: int, length: int, opcode: int) -> int:
        """The planned message (index within the flow) this write starts; -1: none; -2: a
        later packet of a plain write split into WRITE_ONLYs (not a message of its own)."""
        t = self.learnt.tables
        msgs = t.messages[t.msg_start[f]:t.msg_start[f] + t.msg_count[f]]
        if not t.is_data[f]:
            return 0 if length in self.cts_bytes and len(msgs) else -1
        offset = psn_delta(int(self.learnt.base[f]), psn) % int(t.period[f])
        j = int(np.searchsorted(msgs["psn_offset"], offset, side="right")) - 1
        if j < 0:
            return -1
        m = msgs[j]
        if m["psn_offset"] == offset and m["wire_bytes"] == length:
            return j
        split = (self.job.nccl.adaptive_routing and opcode == RC_RDMA_WRITE_ONLY and m["imm"] == 0
                 and offset < m["psn_offset"] + m["npkts"] and length <= t.mtu)
        if split:
            return j if offset == m["psn_offset"] else -2
        return -1

    def finish(self) -> tuple[dict[int, dict], dict]:
        """``({tracked flow: its "job" entry}, the top-level "job" entry)``."""
        t, learnt = self.learnt.tables, self.learnt
        per_flow, phases, buckets = {}, dict.fromkeys(PHASE_NAMES, 0), {}
        phases["other"] = self.untracked_other
        for g in np.flatnonzero(self.stream_flow != -2).tolist():
            f = int(self.stream_flow[g])
            info = {"plan_flow": None, "messages": dict.fromkeys(PHASE_NAMES, 0), "buckets": {}}
            info["messages"]["other"] = self.other.get(g, 0)
            if f >= 0:
                p = int(learnt.plan_flows[f])
                info.update(plan_flow=p, label=t.label(f), kind="data" if t.is_data[f] else "CTS",
                            src_rank=int(t.src[f]), dst_rank=int(t.dst[f]), channel=int(t.channel[f]),
                            qp=int(t.qp_index[f]), alignments=int(learnt.alignments[f]))
                if t.is_data[f]:
                    info["aligned_by"] = learnt.aligned_by[f]
                for m, n in zip(self.plan.flow_messages(p), self.counts[f].tolist()):
                    info["messages"][_phase(m)] += n
                    if m["kind"] != CTS and n:
                        info["buckets"][str(m["bucket"])] = info["buckets"].get(str(m["bucket"]), 0) + n
            per_flow[g] = info
            for name, n in info["messages"].items():
                phases[name] += n
            for b, n in info["buckets"].items():
                buckets[b] = buckets.get(b, 0) + n
        summary = {"name": self.job.name, "stream": learnt.stream, "learnt": t is not None, "phases": phases,
                   "buckets": dict(sorted(buckets.items(), key=lambda kv: int(kv[0])))}
        if learnt.detail:
            summary["detail"] = learnt.detail
        if learnt.refused:
            summary["refused"] = learnt.refused
        return per_flow, summary
