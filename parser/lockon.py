"""Locking a stream on to an iteration boundary, from the middle of a running job.

The appliance may start while training runs, so the PSN at which each flow's iteration
begins is unknown. Two facts give it:

1. **The plan's write sizes.** A write that starts at PSN ``p`` with RETH length ``L`` can
   only be a planned write ``j`` of that length, so the flow's iteration begins at
   ``p - psn_offset[j]`` modulo its period. Each observed write narrows the candidates.
   Repeated patterns (equal buckets) can leave several.
2. **The gap between iterations.** No job traffic flows while the trainer computes the
   next forward pass, so the first write after a gap of at least ``gap_ns`` belongs to a new
   iteration; among the remaining candidates the one that places it earliest in the
   iteration wins (exactly at its start unless the mirror lost the first packets). The
   capture's own start counts as the end of a gap when the port carried other frames for
   ``gap_ns`` before the job's first one.

A flow is *resolved* when one candidate is left, or when it has been watched for a whole
period (its writes then repeat within the iteration and only the gap can tell). A guess from
too few writes could misplace a whole flow consistently (its flags, addresses and lengths
would all agree with the wrong place), so the stream does not lock before every data flow is
resolved; it then locks at the first gap it saw (``parser/stream.py`` keeps the frames since
that gap until then), and numbers iterations by their ordinal since the capture began. Each
flow gets its base at its first write after the gap (:meth:`LockOn.place`).

Before any of this, the stream's QPNs are learnt (``parser/flow_learning.py``): until every
data flow's wire flow is known, the frames between the job's ranks count as job traffic for
the gaps unless they already fit no planned flow (point-to-point, other jobs), and each flow's
alignment candidates come from the learner, which narrows them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradtap.parser.flow_learning import FlowLearner, Learnt
from gradtap.parser.flow_match import record_flows
from gradtap.parser.stream_tables import StreamTables
from gradtap.wire.headers.opcodes import OPCODE_RETH_OFF
from gradtap.wire.psn import psn_add, psn_delta

PLACE_PACKETS = 5     # a flow's first packets after a boundary that place it
PLACE_STRIDE = 8      # PSNs between two of them that still say "in order" (a few lost between)
MAX_STARTS = 64       # iteration start times kept (for numbering by a trainer checkpoint's time)
MAX_CELLS = 1 << 20   # a flow's writes x its planned offsets of their length compared at once (8 MiB)


def _anchor(psns: np.ndarray) -> int:
    """The first of a flow's first packets that the next one follows in order (a stray PSN
    is followed by nothing), or the first when none is."""
    for a, b in zip(psns[:-1].tolist(), psns[1:].tolist()):
        if 0 < psn_delta(a, b) <= PLACE_STRIDE:
            return a
    return int(psns[0])


@dataclass
class Lock:
    """Where iteration 0 of a stream begins."""

    index: int                 # record index (in the batch that locked) of its first job frame
    ts_ns: int                 # time of that frame
    ordinal: int               # iterations begun since the capture started before this one


def misplaced(tables: StreamTables, placed: dict[int, int]) -> str | None:
    """What is wrong when no flow's first packet after an iteration boundary lies in its
    iteration's first write. Mirror loss may take the first packets of every flow's first
    write, but hardly every packet of every flow's first write; a plan that does not fit the
    traffic (ring order, buckets, channels) aligns every flow's writes to the wrong place,
    which their sizes alone cannot show when a flow's writes repeat (modulo its period,
    ``[A, B]`` fits ``[B, A]``): then every flow starts at a later write. None when some flow
    starts in its first write, or when fewer than two flows were placed: one flow's late
    start is as likely a loss of its first write (a stream of one flow cannot show a rotated
    plan)."""
    first_write = tables.messages["npkts"][tables.msg_start]
    if len(placed) < 2 or any(pos < first_write[f] for f, pos in placed.items()):
        return None
    where = ", ".join(f"{tables.label(f)} at packet {p}" for f, p in sorted(placed.items())[:4])
    return (f"after the pause that should start an iteration, no flow's first packet lies in the iteration's "
            f"first write ({where}{', ...' if len(placed) > 4 else ''}): the traffic does not follow the job's "
            f"plan; check the ring order (ring.ranks), the model's bucket sizes and nccl.channels against the job")


@dataclass(frozen=True)
class LockFailure:
    """A stream that has not locked on: what happened, why, and what it saw."""

    stream: str
    what: str        # e.g. "never locked on (867 frames)"
    reason: str
    detail: str      # per planned data flow: the sizes expected and the wire flows seen
    frames: int

    def as_event(self) -> dict:
        return {"stream": self.stream, "what": self.what, "reason": self.reason, "detail": self.detail,
                "frames": self.frames}


@dataclass
class LockOn:
    tables: StreamTables
    gap_ns: int
    learner: FlowLearner
    candidates: dict[int, set[int]] = field(default_factory=dict)   # flow -> bases mod period, from ref
    ref: dict[int, int] = field(default_factory=dict)               # flow -> first PSN seen
    span: dict[int, int] = field(default_factory=dict)              # flow -> PSNs watched past ref
    last_ts: int | None = None
    seen_job: bool = False
    capture_ns: int | None = None   # time of the first frame the stream saw
    starts: dict[int, int] = field(default_factory=dict)           # ordinal -> time of its first job frame
    begun: int = 0              # iterations begun since the capture started (a partial first one counts)
    longest_pause: int = 0      # ns: the longest pause seen in the job's traffic

    @property
    def learnt(self) -> Learnt | None:
        return self.learner.learnt

    def observe(self, recs: np.ndarray, data: np.ndarray) -> Lock | None:
        """Learn and narrow with one batch of records (``data``: the batch's bytes); the first
        iteration boundary in it (a :class:`Lock` to take once :meth:`resolved`), if any."""
        t = self.tables
        if self.learnt is None:
            keys = self.learner.observe(recs, data)
            if self.learner.decide() is None:
                job = np.flatnonzero(self.learner.maybe_job(keys))
            else:
                self._adopt(self.learner.learnt)
                job = np.flatnonzero(record_flows(recs, t) >= 0)
        else:
            flows = record_flows(recs, t)
            job = np.flatnonzero(flows >= 0)
            starts = job[(OPCODE_RETH_OFF[recs["opcode"][job]] >= 0) & t.is_data[flows[job]]]
            for f in np.unique(flows[starts]).tolist():      # flows narrow independently
                mine = starts[flows[starts] == f]
                self._narrow_writes(f, recs["psn"][mine], recs["reth_len"][mine])
        ts = recs["ts_ns"][job]
        if self.last_ts is None and len(recs):
            # The capture was already listening at its first frame, job traffic or not.
            self.last_ts = self.capture_ns = int(recs["ts_ns"][0])
        if len(job) == 0:
            return None
        if not self.seen_job:
            # If the job's first frame comes less than a gap after the capture began, the
            # capture began inside an iteration: that partial iteration is the first begun.
            self.seen_job = True
            if ts[0] - self.last_ts < self.gap_ns:
                self.began(0, int(ts[0]))      # the partial iteration, as far as the capture saw it
                self.begun += 1
        prev = np.r_[self.last_ts, ts[:-1]]
        self.last_ts = int(ts[-1])
        self.longest_pause = max(self.longest_pause, int((ts - prev).max()))
        gaps = np.flatnonzero(ts - prev >= self.gap_ns)
        begun_before = self.begun
        for k in range(max(0, len(gaps) - MAX_STARTS), len(gaps)):
            self.began(begun_before + k, int(ts[gaps[k]]))
        self.begun += len(gaps)
        if len(gaps) == 0:
            return None
        first = job[gaps[0]]
        return Lock(index=int(first), ts_ns=int(recs["ts_ns"][first]), ordinal=begun_before)

    def began(self, ordinal: int, ts: int) -> None:
        """Note when iteration ``ordinal`` began (the latest :data:`MAX_STARTS` are kept)."""
        self.starts[ordinal] = ts
        if len(self.starts) > MAX_STARTS:
            del self.starts[min(self.starts)]

    def resolved(self) -> bool:
        """Every data flow is learnt and its alignment known (see the module docstring)."""
        return self.learnt is not None and all(self._resolved(f) for f in self.tables.data_flows)

    def job(self, recs: np.ndarray) -> np.ndarray:
        """Which records are (or, before the flows are learnt, may be) the job's writes."""
        if self.learnt is not None:
            return record_flows(recs, self.tables) >= 0
        return self.learner.maybe_job(self.learner.keys(recs))

    def _adopt(self, learnt: Learnt) -> None:
        """Take the learnt QPNs into the tables, and each data flow's alignment candidates so far."""
        t = self.tables
        t.qpn[:] = learnt.qpn
        for f in t.data_flows.tolist():
            w = self.learner.wire[(int(self.learner.pair_of[f]) << 24) | int(learnt.qpn[f])]
            fit = w.fit[f]
            self.candidates[f] = set(fit.bases)
            self.ref[f] = w.ref
            self.span[f] = w.span

    def _resolved(self, f: int) -> bool:
        cands = self.candidates.get(f)
        return cands is not None and (len(cands) == 1 or self.span.get(f, 0) >= self.tables.period[f])

    def place(self, recs: np.ndarray, start: int, base_psn: np.ndarray) -> dict[int, int]:
        """Give every data flow without a base (-1) one from its first packets in ``recs[start:]``:
        the candidate that puts them earliest in the iteration. Returns the position (packets
        into the iteration) of each placed flow's anchor, its first packet in sequence: 0
        unless the mirror lost the flow's first packets or the job's plan is not the
        traffic's (see :func:`misplaced`).

        Every packet of the flow counts, not only those that carry a RETH: when the mirror
        lost a write's first packet, its middle and last packets still say where the flow
        is, whereas its next write's first packet would fit the lost write's place as well
        when the flow's writes repeat (placing the whole flow one write early, with every
        flag, address and length agreeing). The first packet that the next follows in order
        decides (:func:`_anchor`), so one stray PSN does not."""
        t = self.tables
        todo = [f for f in t.data_flows if base_psn[f] < 0]
        placed: dict[int, int] = {}
        if not todo:
            return placed
        flows = record_flows(recs, t)
        flows[:start] = -1
        starts = np.flatnonzero((flows >= 0) & (OPCODE_RETH_OFF[recs["opcode"]] >= 0))
        for f in todo:
            mine = starts[flows[starts] == f]
            self._narrow_writes(f, recs["psn"][mine], recs["reth_len"][mine])
            first = np.flatnonzero(flows == f)[:PLACE_PACKETS]
            if len(first) == 0 or f not in self.candidates:
                continue
            psn = _anchor(recs["psn"][first].astype(np.int64))
            period = int(t.period[f])
            pos = min(psn_delta(self.ref[f] + c, psn) % period for c in self.candidates[f])
            base_psn[f] = psn_add(psn, -pos)
            placed[f] = pos
        return placed

    def _narrow_writes(self, f: int, psn: np.ndarray, length: np.ndarray) -> None:
        """:meth:`_narrow` with each of flow ``f``'s writes (their PSNs and RETH lengths, in
        order). Once one candidate is left, a write that keeps it narrows nothing, and with
        the job's plan every write does: those are checked in one array expression per
        length, and only from the first that does not keep it are writes taken one by one
        (112 calls of :meth:`_narrow` were 2 ms of a GPT-2 small stream's first batch)."""
        cands, start = self.candidates.get(f), 0
        if cands is not None and len(cands) == 1 and f in self.ref and len(psn):
            (c,) = cands
            psn64 = psn.astype(np.int64)
            keeps = np.ones(len(psn), bool)
            for n in np.unique(length).tolist():
                offsets = self._offsets(f, n)
                if not len(offsets):
                    continue                           # a length the plan lacks narrows nothing
                rows = np.flatnonzero(length == n)
                step = max(1, MAX_CELLS // len(offsets))
                for lo in range(0, len(rows), step):
                    r = rows[lo:lo + step]
                    keeps[r] = (self._bases(f, offsets[None, :], psn64[r, None]) == c).any(axis=1)
            start = int(np.argmin(keeps)) if not keeps.all() else len(psn)
            if start:
                self.span[f] = max(self.span.get(f, 0), int(psn_delta(self.ref[f], psn64[:start]).max()))
        for p, n in zip(psn[start:].tolist(), length[start:].tolist()):
            self._narrow(f, p, n)

    def _offsets(self, f: int, length: int) -> np.ndarray:
        """Where flow ``f``'s planned writes of ``length`` bytes start (packets into its iteration)."""
        t = self.tables
        m = t.messages[t.msg_start[f]:t.msg_start[f] + t.msg_count[f]]
        return m["psn_offset"][m["wire_bytes"] == length].astype(np.int64)

    def _bases(self, f: int, offsets: np.ndarray, psn) -> np.ndarray:
        """Where flow ``f``'s iteration begins (modulo its period, from its first PSN seen) if
        a write at ``psn`` is its planned write at ``offsets``."""
        return psn_delta(self.ref[f] + offsets, psn) % int(self.tables.period[f])

    def _narrow(self, f: int, psn: int, length: int) -> None:
        ref = self.ref.setdefault(f, psn)
        self.span[f] = max(self.span.get(f, 0), psn_delta(ref, psn))
        cands = set(self._bases(f, self._offsets(f, length), psn).tolist())
        # A write the plan does not have (corruption is caught by the ICRC; this is another
        # job or a plan mismatch) narrows nothing.
        if cands:
            self.candidates[f] = self.candidates.get(f, cands) & cands or cands
