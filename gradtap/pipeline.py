"""The pipeline the appliance and offline replay share: every stream's parser, the merger and
the sink (the updater), advanced one round of frames at a time, with the time each stage takes.

A round parses each stream's new frames in parallel threads (the Numba kernels release the GIL),
every stream into the same gradient per iteration (``parser/shared_gradient.py``); the merger
then runs on the caller's thread while the parsers wait, so nothing reads a slot a parser is
writing. Where the host has cores the parsers leave free (:func:`overlapping`), the sink (the
updater) runs on a thread of its own (``gradtap/update_thread.py``), so that the next rounds
parse while it steps the replica; otherwise it runs on the caller's thread, between rounds, and
has every core to itself. With more streams than cores, each stream's frames are parsed in
pieces, one thread per core taking the next piece of a stream no other thread is parsing
(:func:`parse_in_pieces`): whole batches on fewer cores than streams leave a core idle at the
end of every round (3 streams on 2 cores: the third batch starts only when one of the first two
ends, so a round takes two batches' time where one and a half would do). ``gradtap.replay``
feeds rounds from capture files, ``gradtap.appliance`` from the capture workers' shared-memory
rings.

A job that leaves ``nccl.era`` or ``nccl.protocol`` to the wire (``auto``) has no plan yet:
until the streams decide it (``parser/resolve.py``), each round's frames are watched and held
(up to ``hold_bytes`` per stream; older frames past that are counted as ``other.unresolved``),
then the parsers and the merger are built for the resolved job and take the held frames first.
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numba
import numpy as np

from gradtap.capture.frames import FrameBatch
from gradtap.core.jit import fit_threads
from gradtap.merger.merger import IterationReport, Merger, Sink
from gradtap.merger.numbering import Anchor, AnchorRefused, StreamStarts, anchor_ordinal
from gradtap.parser.decode import decode_batch
from gradtap.parser.lockon import LockFailure
from gradtap.parser.resolve import Resolution, Resolver
from gradtap.parser.shared_gradient import GradientPool, IterationGradient
from gradtap.parser.stream import DEFAULT_SLOTS, DEFAULT_SPARES, StreamParser
from gradtap.update_thread import UpdateThread
from gradtap.wire import events as ev
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import JobSpec
from gradtap.workload.wire_plan import WirePlan


@dataclass
class StageTimes:
    """Seconds of work per stage since the pipeline started (parsing per stream)."""

    parse_s: dict[str, float] = field(default_factory=dict)
    merge_s: float = 0.0
    update_s: float = 0.0

    def total(self) -> tuple[float, float, float]:
        return sum(self.parse_s.values()), self.merge_s, self.update_s


@dataclass
class IterationTiming:
    """Where one iteration's time went. Stage seconds are the pipeline's work between the
    previous iteration's completion and this one's; ``lag_s`` is the replica lag: the wall
    time from the start of the last round that carried a frame of this iteration (its last
    packet, as far as a round can tell) to the sink having applied it (``iteration_done``)."""

    iteration: int                  # the trainer's iteration
    parse_s: float
    merge_s: float
    update_s: float
    lag_s: float


AnchorOutcome = Callable[[Anchor, "int | None", "str | None"], None]   # anchor, ordinal placed at, or why refused
# The merger a pipeline builds once it has a plan: Merger, or a mirror group's (merger/group.py).
MergerFactory = Callable[[WirePlan, list, Sink, "int | None", int], Merger]
HOLD_BYTES = 1 << 30      # frames held per stream while the job's era and protocols are read from the wire


@contextmanager
def start_up_frozen() -> Iterator[None]:
    """While the rounds run, what the process made before them (modules, PyTorch, the compiled
    kernels, the replica) is left out of Python's cyclic garbage collector (``gc.freeze``);
    afterwards it is collected as before. A full collection walks every object it tracks, some
    400 thousand once torch and Numba are loaded: 0.23 s with the parsers stalled behind it, in
    a one-second run of ``benchmarks.live``. Frozen, the rounds' own objects are all it walks."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class Cores:
    """Where the pipeline's threads run (empty: wherever this process may): ``parse``, the
    thread that runs the rounds and the parsers' pool (whoever runs the rounds pins itself
    there, before they start: the pool's threads inherit its cores); ``update``, the update
    thread."""

    parse: frozenset[int] = frozenset()
    update: frozenset[int] = frozenset()


def overlapping(parse_threads: int, cores: frozenset[int]) -> bool:
    """Whether the sink should run on a thread of its own beside ``parse_threads`` busy parsing:
    when the parsers and the sink may run on more ``cores`` than that. Where the parsers
    take every core, a sink beside them only shares those cores, and the replica lag grows
    by what it shares. Measured with ``benchmarks.replay`` (GPT-2 small, 3 streams parsed on
    2 threads, 2 cores, alternated 8 times): replay wall median 0.543 s between rounds,
    0.567 s beside them; the worse iteration's lag 0.081 s against 0.143 s. On a Xeon with
    AVX-512 (2 vCPUs, KVM; 5 alternations of 4-5 replays) beside them was a little faster,
    0.553-0.601 s against 0.574-0.626, but the lag doubled, 0.17-0.22 s against 0.111-0.116:
    between rounds it stays."""
    return len(cores) > parse_threads


def icrc_in_stage2(streams: int, cores: int) -> bool:
    """Whether the parsers of ``streams`` streams on ``cores`` cores check the ICRC in stage 2,
    frame by frame (``StreamParser(defer_icrc=True)``), rather than in stage 1 on every thread:
    with at least as many streams as threads, a parser has at most one core. (One stream of
    GPT-2 small from memory, ICRC deferred against not: 9.7 against 8.6 GB/s of payload on 1
    thread, 10.5 against 11.4 on 2.)"""
    return streams >= min(numba.get_num_threads(), cores)


class Pipeline:
    """Every stream's parser, the merger and the sink of ``job``, advanced one round at a time:
    each stream's new frames are parsed, then the merger learns what each stream retired and
    holds in flight, and hands what is complete to the sink, numbered by the trainer's
    iteration from ``first_iteration`` (that of the capture's first iteration), or, when that
    is None, from where an :meth:`anchor` falls (``merger/numbering.py``); ``on_anchor`` hears
    where each anchor fell, or why it could not be placed. ``merger`` builds the merger from
    the plan, the streams, the sink, the first iteration and the settle time.

    ``overlap`` (default: :func:`overlapping` on ``cores``) makes the sink's calls, and
    ``on_anchor``'s, on the update thread, each under ``update_lock`` (which whatever else
    touches the replica takes too). The merger's buckets must then stay unchanged until their
    iteration's gradients go back to the pool, as :class:`~gradtap.merger.merger.Merger`'s do; a
    mirror group's last only until the next bucket, and its sink talks to its peers: False.

    ``piece_bytes``: the parsers' pieces (``StreamParser``'s; None: their default)."""

    def __init__(self, job: JobSpec, plan: WirePlan | None, streams: list[str], sink: Sink,
                 first_iteration: int | None = 0, on_lockon_failed: Callable[[LockFailure], None] | None = None,
                 on_anchor: AnchorOutcome | None = None, on_resolved: Callable[[Resolution], None] | None = None,
                 hold_bytes: int = HOLD_BYTES, merger: MergerFactory = Merger, overlap: bool | None = None,
                 update_lock: threading.Lock | None = None, cores: Cores = Cores(), piece_bytes: int | None = None):
        gap = job.appliance.iteration_gap_ns
        self._piece_bytes = piece_bytes
        self._make_merger = merger
        self.job, self.streams, self.gap_ns = job, list(streams), gap
        self._on_lockon_failed = on_lockon_failed
        self._on_anchor = on_anchor
        self._on_resolved = on_resolved
        self._anchors: dict[str, Anchor] = {}       # "start", "offer" -> not yet placed
        self.listening_ns: int | None = None     # when a live capture began listening (before its first frame)
        self._failures_told: set[str] = set()
        self.times = StageTimes(parse_s={name: 0.0 for name in streams})
        allowed = frozenset(os.sched_getaffinity(0))
        self._cores = cores.parse or allowed
        self._threads = max(1, min(len(streams), len(self._cores)))
        if overlap is None:
            # A stream alone makes its payload copies with every parse core (_build).
            busy = len(self._cores) if len(streams) == 1 else self._threads
            overlap = overlapping(busy, self._cores | (cores.update or allowed))
        self._sink = _TimedSink(sink, self.times, background=overlap)
        self.update = UpdateThread(self._sink, update_lock or threading.Lock(), cores.update) if overlap else None
        self._first_iteration = first_iteration
        self.parsers: dict[str, StreamParser] = {}
        self.merger: Merger | None = None
        self.last_fed: dict[int, float] = {}        # ordinal -> start of the last round carrying its frames
        self._placed: dict[str, dict[int, int]] = {name: {} for name in streams}   # StreamParser.placed()
        self._retired: dict[int, list[IterationGradient]] = {}   # ordinal -> gradients the merger holds
        # The thread that runs the rounds parses too (parse_in_pieces). The pool's threads
        # start with the first round, on the cores of the thread that runs it.
        self._pool = ThreadPoolExecutor(max_workers=max(1, self._threads - 1), thread_name_prefix="gradtap-parse",
                                        initializer=fit_threads)
        # Before a plan: the resolver, the frames held for the parsers, and the frames let go.
        self.resolver = Resolver(job, self.streams, gap) if plan is None else None
        self.hold_bytes = hold_bytes
        self._held: dict[str, list[FrameBatch]] = {name: [] for name in streams}
        self._unresolved = {name: ev.new_counters() for name in streams}
        if plan is not None:
            self._build(job, plan)

    def _build(self, job: JobSpec, plan: WirePlan) -> None:
        self.job = job
        # One gradient per iteration for every stream: the window's (DEFAULT_SLOTS), and one
        # for the iteration the merger still holds when the streams move on.
        self.pool = GradientPool(plan.grad_bytes, len(plan.blocks), DEFAULT_SLOTS + DEFAULT_SPARES)
        defer = icrc_in_stage2(len(self.streams), len(self._cores))
        # One stream writes the pool's gradients alone: its payload copies are made after its
        # kernel, with every thread (parser/payload.py).
        self.parsers = {name: StreamParser(job, plan, name, gap_ns=self.gap_ns, pool=self.pool, defer_icrc=defer,
                                           piece_bytes=self._piece_bytes, alone=len(self.streams) == 1)
                        for name in self.streams}
        self.merger = self._make_merger(plan, self.streams, self.update or self._sink, self._first_iteration,
                                        self.gap_ns)

    @property
    def resolved(self) -> bool:
        return self.merger is not None

    def round(self, batches: dict[str, FrameBatch], now_ns: int = -1) -> None:
        """Parse each stream's new frames, then merge and update. ``now_ns``: the capture's
        clock (a live capture's wall clock, which runs on while no frame comes); the frames'
        own times advance it too."""
        if self.update is not None:
            self.update.check()
        if not self.resolved:
            self._watch(batches)
            self._release(now_ns)
            return
        started = time.perf_counter()
        work = [(n, b) for n, b in batches.items() if b is not None and len(b.offsets)]
        results = parse_in_pieces(self._pool, self._threads, work, self._parse)
        t = time.perf_counter()
        for name, _ in results:
            self.parsers[name].reconcile()
        for name, retired in results:
            parser = self.parsers[name]
            placed = parser.placed()
            for i, n in placed.items():       # by the streams' ordinal, as the merger takes them
                if n != self._placed[name].get(i):
                    self.last_fed[i] = started
            for i, ts in parser.ends().items():
                self.merger.heard(i, ts)
            self._placed[name] = placed
        self._place_anchors()
        for name, retired in results:
            parser = self.parsers[name]
            for a in retired:
                self._retired.setdefault(a.index, []).append(a.shared)
            self.merger.update(name, retired, parser.in_progress())
        self.merger.advance(max([now_ns, *(int(b.ts_ns[-1]) for _, b in work)]))
        self._recycle()
        self._tell_failures()
        self.times.merge_s += time.perf_counter() - t - self._sink.pop_update_time()

    def _watch(self, batches: dict[str, FrameBatch]) -> None:
        """A round before the job is resolved: show each stream's frames to the resolver and
        hold them; build the parsers once it decides."""
        t = time.perf_counter()
        for name, b in batches.items():
            if b is None or len(b.offsets) == 0:
                continue
            self.resolver.observe(name, self._decode(name, b), b.data)
            held = self._held[name]
            held.append(b.owned())
            while sum(h.nbytes for h in held) > self.hold_bytes and len(held) > 1:
                self._let_go(name, held.pop(0))
            self.times.parse_s[name] += time.perf_counter() - t
            t = time.perf_counter()
        self._settle(self.resolver.decide())

    def _settle(self, resolution: Resolution | None) -> None:
        """Build the parsers and the merger for the resolved job (nothing while undecided)."""
        self._tell_failures()
        if resolution is None:
            return
        self._build(resolution.job, job_plan(resolution.job))
        for name, counts in self._unresolved.items():
            self.parsers[name].counters += counts
        if self._on_resolved is not None:
            self._on_resolved(resolution)

    def _release(self, now_ns: int = -1) -> None:
        """Once resolved, the held frames to the new parsers, in rounds as they came."""
        if not self.resolved:
            return
        held, self._held = self._held, {name: [] for name in self.streams}
        for k in range(max(map(len, held.values()), default=0)):
            self.round({n: h[k] for n, h in held.items() if k < len(h)}, now_ns)

    def _decode(self, name: str, batch: FrameBatch) -> np.ndarray:
        """Stage 1 over a stream's frames before a plan, as its parser will decode them."""
        recs, _ = decode_batch(batch, self.job.appliance.verify_icrc,
                               decapsulate=self.job.mirror(name).encapsulation != "none")
        return recs

    def _let_go(self, name: str, batch: FrameBatch) -> None:
        """Count frames no parser will see: stage 1's refusals as themselves, the rest as
        ``other.unresolved``."""
        counts = np.bincount(self._decode(name, batch)["event"], minlength=ev.N_EVENTS)
        counts[ev.OTHER_UNRESOLVED] += counts[ev.DECODE_OK]
        counts[ev.DECODE_OK] = 0
        self._unresolved[name] += counts

    def finish(self) -> list[IterationReport]:
        """End of input: every stream hands back what it holds, every pending iteration is due."""
        if not self.resolved:
            # The end of input closes the last iteration as a pause would.
            self._settle(self.resolver.decide(final=True))
            self._release()
        if not self.resolved:
            for name, held in self._held.items():
                for b in held:
                    self._let_go(name, b)
            self._held = {name: [] for name in self.streams}
            self._tell_failures(final=True)
            reports = []
        else:
            t = time.perf_counter()
            flushed = {name: p.flush() for name, p in self.parsers.items()}
            self._place_anchors()
            for name, retired in flushed.items():
                self.merger.update(name, retired, [])
            reports = self.merger.close()
            self._tell_failures()
            self.times.merge_s += time.perf_counter() - t - self._sink.pop_update_time()
        if self.update is not None:
            self.update.drain()
        return reports

    def _recycle(self) -> None:
        """Give the gradients of iterations the merger has finished (or never took) back to
        the pool, and the arenas it assembled their buckets in back to it, once the sink is
        done with them: at once, or, with the update thread, once it has made the calls queued
        before."""
        for g in [g for g in self._retired if g < self.merger.next]:
            for shared in self._retired.pop(g):
                if self.update is not None:
                    self.pool.returning(shared)
                self._once_sink_done(self.pool.done, shared, g)
        arenas = self.merger.arenas
        for arena in arenas.finished():
            self._once_sink_done(arenas.give_back, arena)

    def _once_sink_done(self, give_back: Callable[..., None], *args) -> None:
        """``give_back(*args)`` now, or, with the update thread, after the calls queued before."""
        if self.update is None:
            give_back(*args)
        else:
            self.update.release(give_back, *args)

    def anchor(self, anchor: Anchor, *, start: bool = False) -> None:
        """Number iterations by ``anchor`` once the streams show where it falls; when they are
        numbered already, check that it agrees. One start-state anchor and one offer's are
        held; an offer's replaces the previous offer's (as the offer itself does)."""
        self._anchors["start" if start else "offer"] = anchor

    @property
    def numbered(self) -> bool:
        return self.merger is not None and self.merger.first is not None

    def _place_anchors(self) -> None:
        if not self._anchors or not self.resolved:
            return
        streams = {}
        for name, p in self.parsers.items():
            capture_ns, starts = p.starts()
            if self.listening_ns is not None:
                capture_ns = self.listening_ns if capture_ns is None else min(capture_ns, self.listening_ns)
            streams[name] = StreamStarts(capture_ns, starts)
        for key, a in list(self._anchors.items()):
            try:
                ordinal = anchor_ordinal(a, streams, self.gap_ns)
                if ordinal is None:
                    continue
                self._number(a, ordinal)
            except AnchorRefused as exc:
                ordinal, refused = None, str(exc)
            else:
                refused = None
            del self._anchors[key]
            if self._on_anchor is None:
                continue
            if self.update is None:
                self._on_anchor(a, ordinal, refused)
            else:      # it may change the replica: after the buckets handed before it
                self.update.call(self._on_anchor, a, ordinal, refused)

    def _number(self, a: Anchor, ordinal: int) -> None:
        """Number the merger by ``a``, at ``ordinal``, or check that its numbering agrees."""
        m = self.merger
        if m.first is None:
            try:
                m.number(ordinal, a.iteration)
            except ValueError:        # the merger is past that ordinal
                raise AnchorRefused(f"{a.source}: iteration {a.iteration} is captured iteration {ordinal}, which the "
                                    f"streams have passed; offer the trainer's checkpoint ahead of its iteration") \
                    from None
        elif m.first + ordinal != a.iteration:
            raise AnchorRefused(f"{a.source}: its time_ns places iteration {a.iteration} at captured iteration "
                                f"{ordinal}, which the replica numbers {m.first + ordinal}: the checkpoint's "
                                f"iteration or time is wrong, or the replica's start state was")

    def locked(self) -> dict[str, bool]:
        return {n: n in self.parsers and self.parsers[n].locked for n in self.streams}

    def _tell_failures(self, final: bool = False) -> None:
        """Each stream's lock-on failure, once, to ``on_lockon_failed``; before a plan, each
        stream the resolver gave up on (and, at the end of input, every other one)."""
        failures = {n: p.failure for n, p in self.parsers.items() if p.failure is not None}
        if not self.resolved:
            for name in self.streams:
                why = self.resolver.failures.get(name)
                if why is None and final:
                    e = self.resolver.evidence[name]
                    why = (f"the input ended after {e.tried} iteration(s) of it, before its era and protocols were "
                           f"read from the wire ({e.packets.n:,} write packets between the ring's addresses)"
                           + (f"; the last: {e.why}" if e.why else ""))
                if why is not None:
                    frames = int(self._unresolved[name].sum()) + sum(len(h.offsets) for h in self._held[name])
                    failures[name] = LockFailure(stream=name, what="job not resolved from the wire", reason=why,
                                                 detail=self.resolver.detail(name), frames=frames)
        for name, failure in failures.items():
            if name not in self._failures_told:
                self._failures_told.add(name)
                if self._on_lockon_failed is not None:
                    self._on_lockon_failed(failure)

    def counters(self) -> dict[str, dict[str, int]]:
        if not self.resolved:
            return {n: ev.as_dict(c) for n, c in self._unresolved.items()}
        return {n: ev.as_dict(p.counters) for n, p in self.parsers.items()}

    @property
    def skipped(self) -> int:
        """Iterations the merger passed over before the replica's start (0 before a plan)."""
        return 0 if self.merger is None else self.merger.skipped

    def timings(self) -> list[IterationTiming]:
        if self.merger is None:
            return []
        first = self.merger.first or 0
        return self._sink.timings({first + i: t for i, t in self.last_fed.items()})

    def close(self) -> None:
        """Stop the parsers' threads, and the update thread once it has made what is queued."""
        self._pool.shutdown()
        if self.update is not None:
            self.update.close()

    def _parse(self, name: str, batch: FrameBatch):
        t = time.perf_counter()
        retired = self.parsers[name].feed(batch)
        self.times.parse_s[name] += time.perf_counter() - t
        return name, retired


def parse_in_pieces(pool: Executor, threads: int, work: list[tuple[str, FrameBatch]],
                    parse: Callable[[str, FrameBatch], tuple[str, list]]) -> list[tuple[str, list]]:
    """``parse(name, batch)`` over each stream's batch of ``work`` on ``threads`` threads (the
    calling thread, which would otherwise wait, and ``threads - 1`` of ``pool``), a stream's
    frames in order and never on two threads at once; what each stream's calls return, in
    ``work``'s order. With more streams than threads, each batch is cut in
    ``threads / gcd(streams, threads)`` pieces, so that the pieces come out even (3 streams on
    2 threads: halves, three per thread), and a free thread takes the next piece of the stream
    with the most left that no thread is parsing. A stream whose parse raises parses nothing
    more; the first error is raised once the other threads are done."""
    cut = 1 if len(work) <= threads else threads // math.gcd(len(work), threads)
    left = {name: deque(batch.pieces(cut)) for name, batch in work}
    out: dict[str, list] = {name: [] for name, _ in work}
    busy: set[str] = set()
    changed = threading.Condition()

    def run() -> None:
        while True:
            with changed:
                while True:
                    ready = [name for name, pieces in left.items() if pieces and name not in busy]
                    if ready or not any(left.values()):
                        break
                    changed.wait()
                if not ready:
                    return
                name = max(ready, key=lambda n: len(left[n]))
                piece = left[name].popleft()
                busy.add(name)
            try:
                out[name] += parse(name, piece)[1]
            except BaseException:
                with changed:
                    left[name].clear()
                raise
            finally:
                with changed:
                    busy.discard(name)
                    changed.notify_all()

    futures = [pool.submit(run) for _ in range(min(threads, len(work)) - 1)]
    try:
        run()
    finally:
        wait(futures)
    for future in futures:
        future.result()
    return [(name, out[name]) for name, _ in work]


class _TimedSink:
    """Measures the time the sink (the updater) takes, so that merge time excludes it (none
    to exclude when the sink runs in the ``background``, on the update thread)."""

    def __init__(self, sink: Sink, times: StageTimes, background: bool = False):
        self.sink, self.times, self._pending = sink, times, 0.0
        self.background = background
        self._done: list[tuple[int, float, tuple[float, float, float]]] = []   # iteration, wall, cumulative

    def bucket(self, iteration, bucket, data):
        t = time.perf_counter()
        self.sink.bucket(iteration, bucket, data)
        self._spent(time.perf_counter() - t)

    def iteration_done(self, iteration, report):
        t = time.perf_counter()
        self.sink.iteration_done(iteration, report)
        now = time.perf_counter()
        self._spent(now - t)
        self._done.append((iteration, now, self.times.total()))

    def timings(self, last_fed: dict[int, float]) -> list[IterationTiming]:
        out, before = [], (0.0, 0.0, 0.0)
        for iteration, wall, cumulative in self._done:
            delta = [c - b for c, b in zip(cumulative, before)]
            out.append(IterationTiming(iteration, *delta, lag_s=max(0.0, wall - last_fed.get(iteration, wall))))
            before = cumulative
        return out

    def _spent(self, seconds: float) -> None:
        self.times.update_s += seconds
        if not self.background:
            self._pending += seconds

    def pop_update_time(self) -> float:
        spent, self._pending = self._pending, 0.0
        return spent
