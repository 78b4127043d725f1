"""Merging the mirror streams of a job, iteration by iteration, bucket by bucket.

The merger watches every stream parser's in-flight iterations (``StreamParser.in_progress``)
and their final copies (what ``feed``/``flush`` retire). Streams number iterations by their
ordinal since the capture began, which all streams captured together share. The merger hands
them on numbered by the trainer's iteration: ordinal 0 is ``first_iteration`` (the iteration
of the checkpoint the replica started from when the capture began with it).

For the oldest iteration not yet finished it hands each bucket to the sink as soon as the
union of the streams covers every block of it, duplicates cross-checked (``merger/union.py``),
so the replica's update overlaps the capture. Iterations are applied strictly in order.

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

from gradtap.merger.union import BlockMismatch, BucketBlocks, union
from gradtap.parser.stream import AssembledIteration
from gradtap.workload.wire_plan import WirePlan

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where merged gradients go (the updater, through the pipeline); ``iteration`` is the
    trainer's iteration."""

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None: ...

    def iteration_done(self, iteration: int, report: "IterationReport") -> None: ...


@dataclass
class IterationReport:
    iteration: int                                                    # the trainer's iteration
    start_ns: int
    recovered: bool = True
    missing_blocks: dict[int, int] = field(default_factory=dict)      # bucket -> blocks nobody covered
    mismatches: list[BlockMismatch] = field(default_factory=list)
    coverage: dict[str, float] = field(default_factory=dict)          # stream -> fraction of blocks covered


@dataclass
class _Iteration:
    start_ns: int
    handed: np.ndarray                      # bool[buckets]
    retired: dict[str, AssembledIteration] = field(default_factory=dict)
    report: IterationReport | None = None


class Merger:
    """Merge ``streams`` of one job into ``sink``, numbering iterations from ``first_iteration``
    (the trainer's iteration of the capture's first one)."""

    def __init__(self, plan: WirePlan, streams: list[str], sink: Sink, first_iteration: int = 0):
        self.plan, self.streams, self.sink = plan, list(streams), sink
        self.first = first_iteration
        elem = plan.elem_size
        self.buckets = [BucketBlocks.of(plan.blocks, b, plan.bucket_offsets[b], elem)
                        for b in range(len(plan.bucket_numels))]
        self.byte_range = [(o * elem, (o + n) * elem) for o, n in zip(plan.bucket_offsets, plan.bucket_numels)]
        self.iterations: dict[int, _Iteration] = {}
        self._views: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
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
    def update(self, stream: str, retired: list[AssembledIteration],
               slots: list[tuple[int, int, np.ndarray, np.ndarray]]) -> None:
        """What one stream produced since its last update: final copies of the iterations it
        retired, and its in-flight slots (``StreamParser.in_progress``, views that stay valid
        until the stream is fed again). Call :meth:`advance` once every stream is updated."""
        for a in retired:
            g = self._global(a.stream, a.index, a.start_ns)
            if g in self.iterations:
                self.iterations[g].retired[a.stream] = a
        self._views[stream] = {self._global(stream, i, t): (grad, got) for i, t, grad, got in slots}

    def advance(self) -> None:
        """Hand off every complete bucket of the oldest iterations, and finish those due."""
        self._advance()

    def close(self) -> list[IterationReport]:
        """End of input: every pending iteration is due now."""
        while self.iterations:
            self._finish(self.next)
        return self.finished

    # -- merging ------------------------------------------------------------------------
    def _copies(self, g: int, b: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
        lo, hi = self.byte_range[b]
        idx = self.buckets[b].index
        need = self.plan.blocks["need"][idx]
        out = []
        it = self.iterations[g]
        for s in self.streams:
            if s in it.retired:
                a = it.retired[s]
                grad, got = a.grad, a.got
            elif g in self._views.get(s, {}):
                grad, got = self._views[s][g]
            else:
                continue
            out.append((s, grad[lo:hi], (got[idx] & need) == need))
        return out

    def _advance(self) -> None:
        if self.iterations and self.next not in self.iterations:
            # Ordinals before the first one any stream locked on never come.
            self.next = max(self.next, min(self.iterations))
        while self.next in self.iterations:
            g = self.next
            it = self.iterations[g]
            for b in np.flatnonzero(~it.handed):
                u = union(self.buckets[b], self._copies(g, b), self.byte_range[b][1] - self.byte_range[b][0])
                if u.complete:
                    self._hand(g, b, u)
            if it.handed.all() or self._due(g):
                self._finish(g)
            else:
                return

    def _due(self, g: int) -> bool:
        it = self.iterations[g]
        if all(s in it.retired for s in self.streams):
            return True
        for b in np.flatnonzero(~it.handed):
            idx = self.buckets[b].index
            for views in self._views.values():
                if g + 1 in views and views[g + 1][1][idx].any():
                    return True
        return False

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

    def _finish(self, g: int) -> None:
        """Iteration g is due: hand what is complete, or declare it unrecoverable."""
        self.next = g + 1
        it = self.iterations.get(g)
        if it is None:
            return
        report = self._report(g)
        pending = {int(b): union(self.buckets[b], self._copies(g, b), self.byte_range[b][1] - self.byte_range[b][0])
                   for b in np.flatnonzero(~it.handed)}
        missing = {b: int((~u.covered).sum()) for b, u in pending.items() if not u.complete}
        if missing:
            # Unrecoverable: nothing more of it is applied, not even its complete buckets.
            report.recovered = False
            report.missing_blocks.update(missing)
            for u in pending.values():
                report.mismatches.extend(u.mismatches)
        else:
            for b, u in pending.items():
                self._hand(g, b, u)
        need = self.plan.blocks["need"]
        for s in self.streams:
            got = it.retired[s].got if s in it.retired else self._views.get(s, {}).get(g, (None, None))[1]
            if got is not None:
                report.coverage[s] = float(((got & need) == need).mean()) if len(need) else 1.0
        del self.iterations[g]
        for views in self._views.values():
            views.pop(g, None)
        self.finished.append(report)
        self.sink.iteration_done(self.first + g, report)
