"""Merging the mirror streams of a job, iteration by iteration, bucket by bucket.

The merger watches every stream parser's in-flight iterations (``StreamParser.in_progress``)
and their final copies (what ``feed``/``flush`` retire). Streams number iterations by their
ordinal since the capture began, which all streams captured together share. The merger hands
them on numbered by the trainer's iteration: ordinal ``o`` is ``first + o``, where ``first``
is given at construction (the start state's iteration, when the capture began with it) or
later by :meth:`Merger.number` (``merger/numbering.py``). Iterations the merger cannot
number yet, and those before the ordinal numbering starts from, are skipped once due: the
sink never hears of them, and :attr:`Merger.skipped` counts them.

For the oldest iteration not yet finished it hands each bucket to the sink as soon as the
union of the streams covers every block of it, duplicates cross-checked (``merger/union.py``),
so the replica's update overlaps the capture. Iterations are applied strictly in order.
The merger asks after every round of frames; a bucket one of whose sampled blocks
(:data:`PROBES` per bucket) no stream covers yet is known incomplete without building any
stream's view of it, the answer for most buckets in most rounds.

**Settling.** An iteration whose buckets are all handed is finished (the sink told, the
replica's step ended) only once it has *settled*: every stream has retired it, or no stream
has placed a frame of it for ``settle_ns`` (the pause between iterations) by the capture's
clock. Until then a later copy of a frame may still arrive; one that contradicts the copy a
handed block was taken from uncovers that block in its stream (``data.duplicate_conflict``,
``parser/assemble.py``). A block covered by a stream when its bucket was handed and no
longer covered by it when the iteration settles was applied from a copy something
contradicts: the iteration is unrecoverable (``contradicted_blocks``), never silently wrong.

**Deadline.** Bucket b of iteration i is due when some stream already carries allgather
data of bucket b in iteration i+1 (the default of the issue: the start of the next
iteration's allgather of the same bucket), or when every stream has retired iteration i,
or at the end of input. An iteration with a bucket still incomplete when due is
*unrecoverable*: the sink is told (it emits the fallback event and marks the replica
stale) and nothing of the partial bucket is applied. The merger never waits for anything
but the streams' own progress, so it cannot hang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gradtap.merger.arenas import Arenas
from gradtap.merger.union import BlockMismatch, BucketBlocks, BucketUnion, Scratch, SharedUnion, merge_held
from gradtap.parser.stream import AssembledIteration
from gradtap.workload.wire_plan import WirePlan

log = logging.getLogger(__name__)
PROBES = 64     # blocks per bucket looked at before the whole bucket is (Merger._incomplete)


class Sink(Protocol):
    """Where merged gradients go (the updater, through the pipeline); ``iteration`` is the
    trainer's iteration. :class:`Merger`'s buckets stay unchanged until ``iteration_done`` of
    their iteration has returned (a mirror group's, ``merger/group.py``, only until the next
    bucket)."""

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None: ...

    def iteration_done(self, iteration: int, report: "IterationReport") -> None: ...


@dataclass
class IterationReport:
    iteration: int                                                    # the trainer's iteration
    start_ns: int
    recovered: bool = True
    missing_blocks: dict[int, int] = field(default_factory=dict)      # bucket -> blocks nobody covered
    contradicted_blocks: dict[int, int] = field(default_factory=dict)  # bucket -> applied blocks later contradicted
    mismatches: list[BlockMismatch] = field(default_factory=list)
    coverage: dict[str, float] = field(default_factory=dict)          # stream -> fraction of blocks covered
    lost_peers: dict[int, str] = field(default_factory=dict)          # mirror group: peer rank -> why it is gone


@dataclass
class _Iteration:
    start_ns: int
    handed: np.ndarray                      # bool[buckets]
    retired: dict[str, AssembledIteration] = field(default_factory=dict)
    report: IterationReport | None = None
    cover: dict[int, list[tuple[str, np.ndarray]]] = field(default_factory=dict)   # bucket -> covered when handed


class Merger:
    """Merge ``streams`` of one job into ``sink``, numbering iterations from ``first_iteration``
    (the trainer's iteration of the capture's first one; None: not known yet, see :meth:`number`)."""

    def __init__(self, plan: WirePlan, streams: list[str], sink: Sink, first_iteration: int | None = 0,
                 settle_ns: int = 0):
        self.plan, self.streams, self.sink = plan, list(streams), sink
        self.settle_ns = settle_ns
        self.now_ns = -1                            # the capture's clock: the latest frame time seen
        self._last_ns: dict[int, int] = {}          # ordinal -> time of the latest frame placed in it
        self.first = first_iteration
        self.from_ordinal = 0                       # ordinals before it are skipped
        self.skipped = 0                            # iterations skipped, unnumbered or before from_ordinal
        elem = plan.elem_size
        self.buckets = [BucketBlocks.of(plan.blocks, b, plan.bucket_offsets[b], elem)
                        for b in range(len(plan.bucket_numels))]
        self.byte_range = [(o * elem, (o + n) * elem) for o, n in zip(plan.bucket_offsets, plan.bucket_numels)]
        self._need = [plan.blocks["need"][bb.index] for bb in self.buckets]
        # Per bucket, about PROBES of its blocks spread over it: where none of the streams
        # covers one of them, the bucket is not complete (``_incomplete``).
        self._probes = [np.arange(0, len(bb.index), max(1, len(bb.index) // PROBES)) for bb in self.buckets]
        # Where a bucket merged from several copies is assembled: its iteration's arena, so
        # that every bucket handed stays as it is until its iteration is done (Sink). The
        # streams share their gradient, so nearly every bucket is handed as a view of it.
        self.arenas = Arenas(plan.grad_bytes)
        self.iterations: dict[int, _Iteration] = {}
        self._views: dict[str, dict[int, AssembledIteration]] = {}
        self.next = 0                               # oldest ordinal not finished
        self.finished: list[IterationReport] = []

    # -- alignment ----------------------------------------------------------------------
    def _global(self, stream: str, index: int, start_ns: int) -> int:
        """Streams number iterations by their ordinal since the capture started, which all
        streams of one capture share. An ordinal older than what was finished comes too late."""
        if index >= self.next and index not in self.iterations:
            self.iterations[index] = _Iteration(start_ns, np.zeros(len(self.buckets), bool))
        return index

    # -- input ----------------------------------------------------------------------------
    def update(self, stream: str, retired: list[AssembledIteration], slots: list[AssembledIteration]) -> None:
        """What one stream produced since its last update: final copies of the iterations it
        retired, and its in-flight slots (``StreamParser.in_progress``, views that stay valid
        until the stream is fed again). Call :meth:`advance` once every stream is updated."""
        for a in retired:
            self.heard(a.index, a.end_ns)
            g = self._global(a.stream, a.index, a.start_ns)
            if g in self.iterations:
                self.iterations[g].retired[a.stream] = a
        self._views[stream] = {self._global(stream, a.index, a.start_ns): a for a in slots}

    def heard(self, ordinal: int, ts_ns: int) -> None:
        """Some stream placed a frame of ``ordinal`` at (or before) ``ts_ns``."""
        if ordinal >= self.next:
            self._last_ns[ordinal] = max(self._last_ns.get(ordinal, -1), ts_ns)

    def advance(self, now_ns: int = -1) -> None:
        """The capture's clock is at ``now_ns``: hand off every complete bucket of the oldest
        iterations, and finish those due or settled."""
        self.now_ns = max(self.now_ns, now_ns)
        self._advance()

    def number(self, ordinal: int, iteration: int) -> None:
        """Ordinal ``ordinal`` is the trainer's ``iteration``: number from it on, and skip the
        ordinals before it. ``ValueError`` when the merger is past it already."""
        if ordinal < self.next:
            raise ValueError(f"captured iteration {ordinal} is merged already (the merger is at {self.next})")
        self.first, self.from_ordinal = iteration - ordinal, ordinal

    def numbered(self, g: int) -> bool:
        return self.first is not None and g >= self.from_ordinal

    def close(self) -> list[IterationReport]:
        """End of input: every pending iteration is due now."""
        while self.iterations:
            self._finish(self.next)
        return self.finished

    # -- merging ------------------------------------------------------------------------
    def _union(self, g: int, b: int) -> tuple[BucketUnion | SharedUnion, list[tuple[str, np.ndarray]]]:
        """Bucket b of iteration g merged from every stream holding it, and which blocks each
        covers (:func:`~gradtap.merger.union.merge_held`)."""
        return merge_held(self.buckets[b], *self.byte_range[b], self._need[b], self._holding(g), self._assembly(g, b))

    def _assembly(self, g: int, b: int) -> Scratch:
        """Where bucket b of iteration g is assembled, if it must be (``merger/arenas.py``)."""
        lo, hi = self.byte_range[b]
        return lambda: self.arenas.of(g)[lo:hi]

    def _copies(self, g: int, b: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """Every stream's whole copy of bucket b of iteration g, and which blocks it covers."""
        (lo, hi), blocks, need = self.byte_range[b], self.buckets[b], self._need[b]
        return [(s, *a.bucket(lo, hi, blocks.index, need)) for s, a in self._holding(g)]

    def _incomplete(self, g: int, b: int) -> bool:
        """Whether bucket b of iteration g is surely incomplete, told from a few of its blocks
        (``_probes``) without building any stream's copy: one of them no stream covers, with
        the units it kept aside. A bucket all of whose probes are covered may still be
        incomplete: only :func:`~gradtap.merger.union.union` says."""
        probe = self._probes[b]
        index, need = self.buckets[b].index[probe], self._need[b][probe]
        lo, hi = self.byte_range[b]
        covered = np.zeros(len(probe), bool)
        for _, a in self._holding(g):
            covered |= a.covers(lo, hi, index, need)
        return not covered.all()

    def _stream_coverage(self, g: int) -> dict[str, float]:
        """Per stream holding iteration g, the fraction of its blocks the stream covers."""
        need = self.plan.blocks["need"]
        return {s: float(((a.got & need) == need).mean()) if len(need) else 1.0 for s, a in self._holding(g)}

    def _holding(self, g: int) -> list[tuple[str, AssembledIteration]]:
        """Every stream holding iteration g, in stream order, and what it holds (:meth:`_held`)."""
        return [(s, a) for s in self.streams if (a := self._held(s, g)) is not None]

    def _held(self, stream: str, g: int) -> AssembledIteration | None:
        """What ``stream`` holds of iteration g: its final copy, or its slot in flight."""
        it = self.iterations[g]
        if stream in it.retired:
            return it.retired[stream]
        return self._views.get(stream, {}).get(g)

    def _advance(self) -> None:
        if self.iterations and self.next not in self.iterations:
            # Ordinals before the first one any stream locked on never come.
            self.next = max(self.next, min(self.iterations))
        while self.next in self.iterations:
            g = self.next
            if not self.numbered(g):
                if self.first is None and not self._due(g):
                    return          # numbering may still come while it is in flight
                self._skip(g)
                continue
            it = self.iterations[g]
            for b in np.flatnonzero(~it.handed):
                if self._incomplete(g, b):
                    continue
                u, covers = self._union(g, b)
                if u.complete:
                    it.cover[int(b)] = covers
                    self._hand(g, b, u)
            if self._due(g) or (it.handed.all() and self._settled(g)):
                self._finish(g)
            else:
                return

    def _settled(self, g: int) -> bool:
        """No stream will place more of iteration g: each retired it, or it has been quiet
        for ``settle_ns`` by the capture's clock."""
        it = self.iterations[g]
        if all(s in it.retired for s in self.streams):
            return True
        return self.now_ns - self._last_ns.get(g, it.start_ns) >= self.settle_ns

    def _due(self, g: int) -> bool:
        it = self.iterations[g]
        if all(s in it.retired for s in self.streams):
            return True
        for b in np.flatnonzero(~it.handed):
            idx = self.buckets[b].index
            for views in self._views.values():
                if g + 1 in views and views[g + 1].got[idx].any():
                    return True
        return False

    def _contradicted(self, g: int) -> dict[int, int]:
        """Per handed bucket of iteration g, the blocks some stream covered when the bucket
        was handed and covers no longer (a later copy contradicted its own)."""
        out = {}
        for b, then in self.iterations[g].cover.items():
            (lo, hi), idx, need = self.byte_range[b], self.buckets[b].index, self._need[b]
            now = {s: a.covers(lo, hi, idx, need) for s, a in self._holding(g)}
            lost = sum(int((covered & ~now[s]).sum()) for s, covered in then if s in now)
            if lost:
                out[b] = lost
        return out

    def _hand(self, g: int, b: int, u) -> None:
        it = self.iterations[g]
        it.handed[b] = True
        report = self._report(g)
        report.mismatches.extend(u.mismatches)
        for m in u.mismatches:
            log.warning("iteration %d block %d: streams disagree %s (%s)", self.first + g, m.block, m.groups,
                        "majority wins" if m.resolved else "no majority")
        self.sink.bucket(self.first + g, int(b), u.data)

    def _report(self, g: int) -> IterationReport:
        it = self.iterations[g]
        if it.report is None:
            it.report = IterationReport(self.first + g, it.start_ns)
        return it.report

    def _skip(self, g: int) -> None:
        """Iteration g is not numbered (or precedes the numbering): drop it unheard."""
        self.next = g + 1
        self._last_ns.pop(g, None)
        self.arenas.finish(g)
        if self.iterations.pop(g, None) is not None:
            self.skipped += 1
        for views in self._views.values():
            views.pop(g, None)

    def _finish(self, g: int) -> None:
        """Iteration g is due: hand what is complete, or declare it unrecoverable."""
        if not self.numbered(g):
            self._skip(g)
            return
        self.next = g + 1
        it = self.iterations.get(g)
        if it is None:
            return
        report = self._report(g)
        self._last_ns.pop(g, None)
        report.contradicted_blocks.update(self._contradicted(g))
        pending = {int(b): self._union(g, b)[0] for b in np.flatnonzero(~it.handed)}
        missing = {b: int((~u.covered).sum()) for b, u in pending.items() if not u.complete}
        if report.contradicted_blocks:
            report.recovered = False      # what was applied is in doubt; nothing more of it is
        elif missing:
            # Unrecoverable: nothing more of it is applied, not even its complete buckets.
            report.recovered = False
            report.missing_blocks.update(missing)
            for u in pending.values():
                report.mismatches.extend(u.mismatches)
        else:
            for b, u in pending.items():
                self._hand(g, b, u)
        report.coverage.update(self._stream_coverage(g))
        del self.iterations[g]
        self.arenas.finish(g)
        for views in self._views.values():
            views.pop(g, None)
        self.finished.append(report)
        self.sink.iteration_done(self.first + g, report)
