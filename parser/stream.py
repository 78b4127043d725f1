"""One mirror stream, frames in, assembled iterations out.

:class:`StreamParser` is the parser's public face. Feed it frame batches (from any capture
source) in arrival order; it decodes them (stage 1), locks on to an iteration boundary
(``parser/lockon.py``), places every packet by PSN and wire plan (``parser/assemble.py``),
and hands back each iteration once the stream has moved two iterations past it (late
retransmissions are still accepted until then) or at :meth:`StreamParser.flush`.

Every stream of a job places its packets into one gradient per iteration, shared with the
other streams' parsers (``parser/shared_gradient.py``; a parser made without a pool has
one of its own). An :class:`AssembledIteration` holds that gradient in the wire dtype,
which units (packets; LL128 lines) of each coverage block this stream holds a copy of that
equals it (a block is *covered* when all are), and the stream's copies that differ
(``parser/aside.py``). Elements outside covered blocks are meaningless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numba
import numpy as np

from gradtap.capture.frames import FrameBatch
from gradtap.core.memory import cache_bytes
from gradtap.parser.aside import NOTHING_ASIDE, AsideCopies, kept, new_aside, reconcile
from gradtap.parser.assemble import NEED_ADVANCE, Slots, StreamState, assemble, origins
from gradtap.parser.decode import check_batch, decode_batch, part_counters, verify_mode
from gradtap.parser.flow_learning import FlowLearner
from gradtap.parser.lockon import Lock, LockFailure, LockOn, misplaced
from gradtap.parser.mismatch import what_differs
from gradtap.parser.payload import Deferred, copy_deferred
from gradtap.parser.pieces import parse_pieces
from gradtap.parser.shared_gradient import GradientPool, IterationGradient
from gradtap.parser.stream_tables import stream_tables
from gradtap.wire import events as ev
from gradtap.wire.frame_record import FRAME_DTYPE
from gradtap.wire.protocol import N_PROTOCOLS
from gradtap.wire.psn import psn_add
from gradtap.workload.spec import JobSpec
from gradtap.workload.wire_plan import WirePlan

log = logging.getLogger(__name__)

# One iteration is assembled at a time. Data-parallel training sends nothing of iteration N + 1
# before every rank's allreduce of iteration N has ended and the optimizer has stepped, so no
# stream carries a packet of N once one of N + 1 has come: the first one, after the pause
# between them, retires N (``parser/assemble.py``: a PSN past the window needs that pause).
DEFAULT_SLOTS = 1
# One spare holds an iteration that a stream has retired until the merger has finished it and
# every other stream has retired it too. Both happen by the next retirement, a whole iteration
# later, so two gradients serve any number of streams.
DEFAULT_SPARES = 1
DEFAULT_GAP_NS = 1_000_000   # an iteration boundary is a pause of at least 1 ms in the job's traffic


@dataclass
class AssembledIteration:
    stream: str
    index: int                 # iterations begun since the capture started before this one (0 = the first)
    start_ns: int              # time of the iteration's first job frame, as seen by this stream
    grad: np.ndarray           # uint8[grad_bytes]: the iteration's flat gradient in the wire dtype
    got: np.ndarray            # int32[blocks]: units per coverage block this stream holds, equal to grad's
    need: np.ndarray           # int32[blocks]: bitmask of the units each block needs
    end_ns: int = -1           # time of its latest job frame, as seen by this stream
    aside: AsideCopies = NOTHING_ASIDE      # this stream's copies of units that differ from grad's
    disputed: np.ndarray | None = None      # int32[blocks]: units a differing copy found no room for
    shared: IterationGradient | None = None  # the pool's buffer grad belongs to

    @property
    def covered(self) -> np.ndarray:
        return (self.got & self.need) == self.need

    def bucket(self, lo: int, hi: int, index: np.ndarray, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stream's own copy of the gradient's bytes ``[lo, hi)`` (the shared bytes, with
        what it kept aside laid over them) and which of the coverage blocks ``index`` (needing
        ``need``) it covers there (:meth:`covers`)."""
        return self.aside.overlay(self.grad, lo, hi, index), self.covers(lo, hi, index, need)

    def covers(self, lo: int, hi: int, index: np.ndarray, need: np.ndarray) -> np.ndarray:
        """Which of the coverage blocks ``index`` (needing ``need``) of the gradient's bytes
        ``[lo, hi)`` the stream covers, with what it kept aside, without building its copy; a
        disputed block is covered by no stream."""
        covered = (self.aside.units(self.got, lo, hi, index) & need) == need
        if self.disputed is not None:
            covered &= self.disputed[index] == 0
        return covered


class StreamParser:
    """Parse one mirror stream of ``job``.

    Parameters
    ----------
    job, plan:
        The job spec and its wire plan (``gradtap.workload.layout.job_plan``).
    stream:
        Name of one of ``job.mirrors``.
    verify_icrc:
        Check every frame's ICRC (``job.appliance.verify_icrc`` by default).
    defer_icrc:
        Once locked on, check a frame's ICRC in stage 2, just before its payload is placed
        (``decode_batch``'s ``defer_icrc``), instead of in stage 1: each payload is then read
        from memory once instead of twice, but the check runs in stage 2's one thread
        instead of stage 1's threads (and stage 1, in pieces, on that thread). The better choice
        for a parser that has at most one core to itself, e.g. one of as many streams as
        threads (``gradtap/pipeline.py``).
    piece_bytes:
        With the ICRC checked, once every data flow is placed, a batch larger than this is
        parsed in pieces of about this size (as many frames each; ``parser/pieces.py``), so
        that stage 2 finds in the cache what stage 1 read of the piece: whole frames with the
        check in stage 1, their headers with it in stage 2. By default half a core's L2 cache
        for each thread stage 1 runs on (``core.memory.cache_bytes``; whole batches where the
        host does not say). 0: whole batches.
    slots:
        Iterations assembled at once (1 by default: see ``DEFAULT_SLOTS``).
    spares:
        Without a ``pool``: gradients its own pool makes at start-up besides the slots', for
        the slots that retire while the gradients handed out are still in use (given back
        through :meth:`GradientPool.done`); a parser whose retired gradients are not given
        back (``discover``'s trials) needs none.
    pool:
        The iterations' gradients shared with the job's other streams
        (``parser/shared_gradient.py``); None: a pool of its own.
    gap_ns:
        Minimum pause in the job's traffic that separates two iterations.
    hold_bytes:
        Frames kept (copied) since the first iteration boundary while lock-on waits for every
        flow to be resolved; past it, that boundary is given up for a later one.
    alone:
        No other stream's parser writes the pool's gradients while this one runs (true when it
        has a pool of its own): the kernel then leaves the payload copies of Simple packets
        to every thread after it (``parser/payload.py``).
    lockon_s, lockon_frames:
        A stream not locked this long after its first frame (capture time), or after this many
        frames, has failed to lock on: :attr:`failure` says why (``job.appliance`` by default).
        It keeps trying.
    """

    def __init__(self, job: JobSpec, plan: WirePlan, stream: str, *, verify_icrc: bool | None = None,
                 defer_icrc: bool = False, piece_bytes: int | None = None, slots: int = DEFAULT_SLOTS,
                 spares: int = DEFAULT_SPARES, gap_ns: int = DEFAULT_GAP_NS, hold_bytes: int = 1 << 30,
                 lockon_s: float | None = None, lockon_frames: int | None = None, pool: GradientPool | None = None,
                 alone: bool | None = None):
        self.job, self.plan = job, plan
        self.mirror = job.mirror(stream)
        # A stream that arrives over L3 (ERSPAN) is opened frame by frame; stage 1 reads the
        # ERSPAN type from the wire, and plain frames on it decode as they are.
        self.decapsulate = self.mirror.encapsulation != "none"
        self.tables = t = stream_tables(job, plan, self.mirror)
        self.verify_icrc = job.appliance.verify_icrc if verify_icrc is None else verify_icrc
        self.defer_icrc = defer_icrc
        self.piece_bytes = piece_bytes
        self._half_l2 = (cache_bytes(2) or 0) // 2
        self.need = plan.blocks["need"].astype(np.int32)
        nconn = t.phase_period.shape[1]
        self.state = StreamState(base_psn=np.full(len(t.qpn), -1, np.int64), step_base=np.full(nconn, -1, np.int64),
                                 va_ref=np.full(nconn * N_PROTOCOLS, -1, np.int64),
                                 va_step=np.zeros(nconn * N_PROTOCOLS, np.int64),
                                 origin=np.zeros((nconn, slots), np.int64),
                                 origin_phase=np.zeros((nconn, slots), np.int64),
                                 last_ns=np.full(1, -1, np.int64), last_psn=np.full(len(t.qpn), -1, np.int64),
                                 prev_psn=np.full(len(t.qpn), -1, np.int64),
                                 last_write=np.full(len(t.qpn), -1, np.int64), gap_ns=gap_ns)
        # Each slot holds its iteration's gradient from the pool, shared with the other streams:
        # retiring hands it on as it is, and nothing of it is copied or cleared here. Until the
        # stream locks on (nothing is placed before), the slots hold an empty stand-in, so
        # that a stream that never locks holds none of the pool's.
        own_pool = pool is None
        if own_pool:
            pool = GradientPool(t.grad_bytes, len(plan.blocks), slots + spares)
        elif (pool.grad_bytes, pool.blocks) != (t.grad_bytes, len(plan.blocks)):
            raise ValueError(f"stream {stream}: the gradient pool holds {pool.grad_bytes} bytes in {pool.blocks} "
                             f"blocks; the plan needs {t.grad_bytes} in {len(plan.blocks)}")
        self.pool = pool
        self.alone = own_pool if alone is None else alone
        blocks = len(plan.blocks)
        self._unbound = IterationGradient.over(np.zeros(0, np.uint8), blocks)
        self._shared = [self._unbound] * slots
        self.slots = Slots(grads=(), claim=(), written=(), disputed=(), crc=(), got=np.zeros((slots, blocks), np.int32),
                           seen=np.zeros((slots, t.seen_bits), np.uint8),
                           start_ns=np.full(slots, -1, np.int64), end_ns=np.full(slots, -1, np.int64),
                           pending=Deferred.room(0, slots, blocks) if self.alone else Deferred.room(0))
        self._bind()
        self.aside = new_aside(t.mtu)
        self._unsettled: list[AssembledIteration] = []   # retired since reconcile() with copies pending
        self._origins()
        self.slot0 = 0
        self.iteration = 0            # iteration held by slot0
        self.counters = ev.new_counters()
        self.lockon = LockOn(t, gap_ns, FlowLearner(t, job.nccl.adaptive_routing))
        self.lockon_ns = int(1e9 * (job.appliance.lockon_timeout_s if lockon_s is None else lockon_s))
        self.lockon_frames = job.appliance.lockon_frames if lockon_frames is None else lockon_frames
        self.failure: LockFailure | None = None    # why the stream has not locked on (None: in time, or locked)
        self._frames = 0
        self._first_ts: int | None = None
        self.lock_ts: int | None = None
        self.hold_bytes = hold_bytes
        self._pending = None          # the first boundary seen, while flows are not yet resolved
        self._held: list[FrameBatch] = []   # the frames since that boundary (FrameBatch.owned)

    @property
    def locked(self) -> bool:
        return self.lock_ts is not None

    def feed(self, batch: FrameBatch) -> list[AssembledIteration]:
        """Parse one batch; returns the iterations it completed."""
        if self.locked:
            piece = self._piece_frames(batch)
            if piece:
                return self._assemble_in_pieces(batch, piece)
        recs = self._decode(batch, placing=self.locked)
        if self.locked:
            return self._assemble(recs, 0, batch.data)
        boundary = self.lockon.observe(recs, batch.data)
        self._watch(batch)
        if self._pending is None:
            stop = boundary.index if boundary else len(recs)
            self._count_unlocked(recs, stop, batch.data)      # before any boundary: counted, not used
            if boundary is None:
                return []
            self._pending, self._held = boundary, [batch.owned(boundary.index)]
        else:
            self._held.append(batch.owned())
        if not self.lockon.resolved():
            if sum(b.nbytes for b in self._held) > self.hold_bytes:
                self._give_up_pending()
            return []
        while True:
            lock, held = self._pending, self._held
            first = self._decode(held[0])
            wrong = misplaced(self.tables, self.lockon.place(first, 0, self.state.base_psn))
            if not wrong:
                break
            # Never assemble against a plan the traffic contradicts: count, report, and try
            # the next boundary (the mirror may have lost the first write of every flow).
            self.state.base_psn[:] = -1
            if self.failure is None:
                self.failure = self._why(f"refused to lock on at t={lock.ts_ns} ns", wrong)
            if not self._next_boundary():
                return []
        self._pending, self._held = None, []
        self.lock_ts, self.iteration = lock.ts_ns, lock.ordinal
        for r in range(len(self._shared)):
            self._take_gradient(r)
        learnt = self.lockon.learnt
        if learnt.by_order:
            log.info("stream %s: flows with identical traffic told apart by QPN order: %s", self.mirror.name,
                     "; ".join(learnt.by_order))
        for m in learnt.hint_mismatch:
            log.warning("stream %s: the job spec's QPN hint does not match the wire (%s); the wire's is used",
                        self.mirror.name, m)
        log.info("stream %s: locked on an iteration boundary at t=%d ns; the capture's iteration %d starts "
                 "there%s", self.mirror.name, lock.ts_ns, lock.ordinal,
                 "" if lock.ordinal == 0 else f" ({lock.ordinal} earlier iteration(s) could not be aligned)")
        out = self._assemble(first, 0, held[0].data)
        for b in held[1:]:
            out += self._assemble(self._decode(b, placing=True), 0, b.data)
        return out

    def _piece_frames(self, batch: FrameBatch) -> int:
        """Frames per piece for a batch of a locked stream (0: whole): with the ICRC checked,
        every data flow placed and the batch larger than a piece."""
        if not self.verify_icrc or not self._placed():
            return 0
        size = self.piece_bytes
        if size is None:
            size = self._half_l2 * self._stage1_threads()
        return max(1, len(batch) * size // batch.nbytes) if 0 < size < batch.nbytes else 0

    def _stage1_threads(self) -> int:
        """The threads stage 1 runs on in pieces: the caller's alone with the ICRC checked in
        stage 2 (a parser with at most a core to itself), else every Numba thread."""
        return 1 if self.defer_icrc else numba.get_num_threads()

    def _placed(self) -> bool:
        """Whether every data flow has its base: stage 2 then needs no record ahead of it."""
        return bool((self.state.base_psn[self.tables.data_flows] >= 0).all())

    def _assemble_in_pieces(self, batch: FrameBatch, piece: int) -> list[AssembledIteration]:
        """Stages 1 and 2 of a locked stream, ``piece`` frames at a time (``parser/pieces.py``)."""
        check_batch(batch)
        recs = np.empty(len(batch), FRAME_DTYPE)
        parts = part_counters(min(piece, self._stage1_threads()))
        self._make_room(len(batch))
        out, i = [], 0
        while True:
            status, i = parse_pieces(batch.data, batch.offsets, batch.caplens, batch.wirelens, batch.ts_ns,
                                     verify_mode(self.verify_icrc, self.defer_icrc),
                                     self.decapsulate, recs, parts, i, piece, self.tables, self.state,
                                     self.slots, self.aside, self.slot0, self.counters)
            if status != NEED_ADVANCE:
                return out
            out.append(self._retire())

    def _decode(self, batch: FrameBatch, placing: bool = False) -> np.ndarray:
        """Stage 1's records of ``batch`` (stage 2 counts every record under one event,
        stage 1's refusals included). ``placing``: they go to stage 2 and nowhere else, which
        then checks a frame's ICRC just before it places the payload, with ``defer_icrc``
        and every flow placed (placing a flow reads the records first)."""
        defer = placing and self.defer_icrc and self._placed()
        return decode_batch(batch, self.verify_icrc, decapsulate=self.decapsulate, defer_icrc=defer)[0]

    def _assemble(self, recs, start, data) -> list[AssembledIteration]:
        self.lockon.place(recs, start, self.state.base_psn)
        out = []
        while True:
            status, i = self._run(recs, start, len(recs), data)
            if status != NEED_ADVANCE:
                return out
            out.append(self._retire())
            start = i

    def _give_up_pending(self) -> None:
        """Too much held while waiting to resolve: count it and wait for a later boundary."""
        log.warning("stream %s: %d MB held since an iteration boundary without resolving every flow; waiting "
                    "for the next boundary", self.mirror.name, self.hold_bytes >> 20)
        self._release_held()

    def _next_boundary(self) -> bool:
        """Move the pending boundary to the next pause in the held frames (counting the frames
        before it as not locked); False, with everything counted, when they hold none."""
        gap, prev = self.lockon.gap_ns, None
        for b, batch in enumerate(self._held):
            recs = self._decode(batch)
            job = np.flatnonzero(self.lockon.job(recs))
            ts = recs["ts_ns"][job]
            if len(ts) == 0:
                continue
            gaps = np.flatnonzero(np.diff(np.r_[ts[0] if prev is None else prev, ts]) >= gap)
            if len(gaps):
                at = int(job[gaps[0]])
                for before in self._held[:b]:
                    self._count_unlocked(self._decode(before), len(before.offsets), before.data)
                self._count_unlocked(recs, at, batch.data)
                self._pending = Lock(index=0, ts_ns=int(recs["ts_ns"][at]), ordinal=self._pending.ordinal + 1)
                self._held = [batch.owned(at)] + self._held[b + 1:]
                return True
            prev = int(ts[-1])
        self._release_held()
        return False

    def _release_held(self) -> None:
        """Count the frames held since the pending boundary (they will not be assembled)."""
        for b in self._held:
            self._count_unlocked(self._decode(b), len(b.offsets), b.data)
        self._pending, self._held = None, []

    def _count_unlocked(self, recs, stop, data) -> None:
        """Count ``recs[:stop]`` of a stream not locked: the job's writes as ``data.before_lock``
        (or ``other.cts``) and the rest as stage 2 classifies them. Before the flows are learnt,
        writes that may be the job's count as ``data.before_lock`` too."""
        recs = recs[:stop]
        if self.lockon.learnt is not None:
            self._run(recs, 0, stop, data)
            return
        job = self.lockon.job(recs)
        self.counters[ev.DATA_BEFORE_LOCK] += int(job.sum())
        rest = recs[~job]
        self._run(rest, 0, len(rest), data)

    def _watch(self, batch: FrameBatch) -> None:
        """Note a stream that has been unlocked for too long (once; it keeps trying)."""
        if len(batch.offsets) == 0:
            return
        if self._first_ts is None:
            self._first_ts = int(batch.ts_ns[0])
        self._frames += len(batch.offsets)
        waited = int(batch.ts_ns[-1]) - self._first_ts
        if self.failure is None and (waited >= self.lockon_ns or self._frames >= self.lockon_frames):
            self.failure = self._why(f"not locked on after {waited / 1e9:.1f} s and {self._frames:,} frames")

    def _unlocked_reason(self) -> str:
        learner = self.lockon.learner
        if not learner.wire:
            return "no RDMA WRITE between the job's ranks (no flow matched): " + \
                (what_differs(self.job, self.mirror, learner) or "check the ring's addresses")
        if self.lockon.learnt is None and learner.conflict:
            return learner.conflict
        if self.lockon.learnt is None:
            differs = what_differs(self.job, self.mirror, learner)
            return "the job's flows could not be told from the traffic" + (f": {differs}" if differs else "")
        return (f"flows learnt, but no iteration boundary (a pause of at least {self.lockon.gap_ns / 1e6:g} ms "
                f"in the job's traffic, appliance.iteration_gap_ns) was followed by a whole iteration; the longest "
                f"pause seen was {self.lockon.longest_pause / 1e6:.3g} ms")

    def _why(self, what: str, reason: str | None = None) -> LockFailure:
        if reason is None:
            reason = self._unlocked_reason()
        failure = LockFailure(self.mirror.name, what, reason, self.lockon.learner.explain(), self._frames)
        log.warning("stream %s: %s: %s\n%s", failure.stream, failure.what, failure.reason, failure.detail)
        return failure

    def in_progress(self) -> list[AssembledIteration]:
        """Every slot holding data, oldest first, as it stands: ``got`` is a view into the
        slot, valid until the slot is retired. A covered block's bytes never change once
        covered (a later copy of its units is compared, never written), so a consumer may take
        covered blocks from here early; a later copy with other bytes uncovers the block
        (``data.duplicate_conflict``)."""
        out = []
        slots = self.slots
        for r in range(len(slots.grads)):
            s = (self.slot0 + r) % len(slots.grads)
            if slots.start_ns[s] >= 0:
                out.append(self._assembled(s, r, slots.got[s], kept(self.aside, s, free=False)))
        return out

    def reconcile(self) -> None:
        """Compare the copies kept aside while the stream that claimed their units was still
        writing them (``parser/aside.py``), of the iterations held and of those retired since
        the last call. Call it while no parser of the pool runs."""
        slots = self.slots
        differing = reconcile(self.aside, slots.grads, slots.written, slots.got)
        for a in self._unsettled:
            if a.shared.ordinal == a.index:     # else the buffer serves a later iteration now
                a.aside, moved = a.aside.reconciled(a.grad, a.shared.written, a.got)
                differing += moved
        self._unsettled.clear()
        self.counters[ev.DATA_WRITTEN] -= differing
        self.counters[ev.DATA_SET_ASIDE] += differing

    def _assembled(self, s: int, r: int, got: np.ndarray, aside: AsideCopies) -> AssembledIteration:
        slots, shared = self.slots, self._shared[s]
        return AssembledIteration(self.mirror.name, self.iteration + r, int(slots.start_ns[s]), slots.grads[s], got,
                                  self.need, int(slots.end_ns[s]), aside, shared.disputed, shared)

    def starts(self) -> tuple[int | None, dict[int, int]]:
        """When the stream's capture began (its first frame; None before one), and when each
        of its recent iterations began (ordinal -> time of its first job frame): counted
        while locking on, then as assembled (``merger/numbering.py`` numbers them by these)."""
        out = dict(self.lockon.starts)
        slots = self.slots
        for r in range(len(slots.grads)):
            s = (self.slot0 + r) % len(slots.grads)
            if slots.start_ns[s] >= 0:
                out[self.iteration + r] = int(slots.start_ns[s])
        return self.lockon.capture_ns, out

    def ends(self) -> dict[int, int]:
        """Time of the latest frame placed in every iteration held (iteration -> ns)."""
        slots = self.slots
        return {self.iteration + r: int(slots.end_ns[(self.slot0 + r) % len(slots.grads)])
                for r in range(len(slots.grads)) if slots.end_ns[(self.slot0 + r) % len(slots.grads)] >= 0}

    def placed(self) -> dict[int, int]:
        """Packets placed so far in every iteration held: iteration -> distinct packets (PSN
        positions) seen. A count that grew between two calls means frames of that iteration
        arrived in between (duplicates and refused frames do not count)."""
        out = {}
        slots = self.slots
        for r in range(len(slots.grads)):
            s = (self.slot0 + r) % len(slots.grads)
            if slots.start_ns[s] >= 0:
                out[self.iteration + r] = int(np.count_nonzero(slots.seen[s]))
        return out

    def flush(self) -> list[AssembledIteration]:
        """Hand back every iteration still held (end of input). A stream that never locked
        counts what it held and says why (:attr:`failure`)."""
        if not self.locked:
            self._release_held()
            if self.failure is None:
                self.failure = self._why(f"never locked on ({self._frames:,} frames)")
        out = []
        for _ in range(len(self.slots.grads)):
            if self.slots.seen[self.slot0].any():
                out.append(self._retire())
            else:
                self._advance()
        return out

    def _make_room(self, records: int) -> None:
        """Alone, the kernel leaves the payload copies (at most one per record) to all the
        threads after it: room for those of ``records`` records."""
        if self.alone and len(self.slots.pending.ops) < records:
            self.slots = self.slots._replace(pending=self.slots.pending.grown(records))

    def _run(self, recs, start, stop, data):
        self._make_room(stop)
        out = assemble(recs[:stop], start, data, self.tables, self.state, self.slots, self.aside, self.slot0,
                       self.counters)
        if self.slots.pending.count[0]:
            copy_deferred(self.slots.pending, data, self.slots.grads)
        return out

    def _retire(self) -> AssembledIteration:
        s = self.slot0
        out = self._assembled(s, 0, self.slots.got[s].copy(), kept(self.aside, s, free=True))
        if out.aside.rec["pending"].any():
            self._unsettled.append(out)
        if out.start_ns >= 0:
            self.lockon.began(out.index, out.start_ns)
        self._advance()
        return out

    def _take_gradient(self, r: int) -> None:
        """Window slot ``r`` (from the oldest) takes its iteration's gradient from the pool
        (and leaves the one it held)."""
        s = (self.slot0 + r) % len(self._shared)
        old = self._shared[s]
        if old is not self._unbound:
            if old.ordinal == self.iteration + r:
                return
            # Left first: when its consumer is done with it already, it is the buffer taken next.
            self.pool.leave(old)
        self._shared[s] = self.pool.enter(self.iteration + r)
        self._bind()

    def _bind(self) -> None:
        """The kernel's view of the slots' gradients."""
        g = self._shared
        self.slots = self.slots._replace(grads=tuple(x.grad for x in g), claim=tuple(x.claim for x in g),
                                         written=tuple(x.written for x in g), disputed=tuple(x.disputed for x in g),
                                         crc=tuple(x.crc for x in g))

    def _origins(self) -> None:
        """Every connection's iteration starts across the window (``assemble.origins``)."""
        for c in range(self.tables.phase_period.shape[1]):
            origins(self.state, self.tables, c)

    def _advance(self) -> None:
        """Drop the oldest slot: every flow's base moves one period, connections' steps too,
        and the slot takes the gradient of the iteration that enters the window."""
        s, slots, state, t = self.slot0, self.slots, self.state, self.tables
        slots.got[s] = 0
        slots.seen[s] = 0
        slots.start_ns[s] = -1
        slots.end_ns[s] = -1
        kept(self.aside, s, free=True)
        locked = state.base_psn >= 0
        state.base_psn[locked] = psn_add(state.base_psn[locked], t.period[locked])
        # Each connection's steps in the retired iteration, by the phase it had.
        retired = t.phase_period[state.origin_phase[:, 0], np.arange(t.phase_period.shape[1])]
        known = state.step_base >= 0
        state.step_base[known] += retired[known]
        state.va_step[:] -= np.repeat(retired, N_PROTOCOLS)     # indexed c * N_PROTOCOLS + protocol
        self._origins()
        self.slot0 = (s + 1) % len(slots.grads)
        self.iteration += 1
        if self.locked:
            self._take_gradient(len(slots.grads) - 1)
