"""Where the merger's buckets meet the replica: control-plane events, the report line, snapshots, digests.

The merger numbers iterations by the trainer's iteration (``Merger(first_iteration=…)``), and
the replica decides what it can do with each (``Replica.begin``: open it, resync from an
offered checkpoint first, or stay or become stale because iterations were missed). The sink
reports what happened on the control plane (``fallback``, ``resync``, ``duplicate_mismatch``),
writes one line per iteration to ``iterations.jsonl``, and snapshots the replica when due.

After every applied iteration the sink can record the replica's state digest
(``gradtap/digest.py``) so that ``gradtap verify`` checks every iteration, not only the
snapshots kept.

Snapshots are written in the background when the snapshots directory has buffers for it
(``Snapshots(buffers=N)``, ``store/snapshot_writer.py``): the sink makes the writer, the
update path copies the replica's state into a free buffer (``snapshot_taken`` in the report
line: the snapshot's directory once written) and goes on; with no buffer free the snapshot is
skipped (``snapshot_skipped``) and counted. Without buffers it is written on the update path
(``snapshot``: its directory). The sink sends the snapshots' events to the control plane.

A snapshot that cannot be written (the disk is full, the directory turned read-only) does
not stop the appliance: the replica keeps following the trainer in memory, the failure is
a ``snapshot.failed`` event (once per run of failures, and again if the reason changes),
and the next snapshot due is tried again; the first that succeeds is a ``snapshot.resumed``
event. Report lines that cannot be appended wait in memory and are appended, in order,
once they can be.

With a gradient log (``store/gradient_log.py``) every bucket applied is also copied to it, and
every iteration applied is handed over whole; a resync begins a new chain of records.
"""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import numpy as np

from gradtap.attestation import Attestations
from gradtap.control import ControlPlane
from gradtap.digest import replica_digest
from gradtap.merger.merger import IterationReport
from gradtap.updater.replica import Begin, Replica
from gradtap.store.gradient_log import GradientLog
from gradtap.store.snapshot import Snapshots, SnapshotWriteError
from gradtap.store.snapshot_writer import SnapshotWriter

log = logging.getLogger(__name__)


class ReplicaSink:
    """Applies merged buckets to ``replica``; reports to ``control``; snapshots to ``snapshots``.
    ``lasting_buckets``: the buckets handed stay unchanged until their iteration is done, as
    :class:`~gradtap.merger.merger.Merger`'s do (``Replica.apply_bucket``'s ``lasting``)."""

    def __init__(self, replica: Replica, control: ControlPlane, *, snapshots: Snapshots | None = None,
                 report_path: Path | None = None, digests: bool = False,
                 attestations: Attestations | None = None, gradient_log: GradientLog | None = None,
                 lasting_buckets: bool = False):
        self.replica, self.control = replica, control
        self.lasting_buckets = lasting_buckets
        replica.prepare(lasting=lasting_buckets)
        self.gradient_log = gradient_log
        self.attestations = attestations
        self.snapshots = snapshots
        self.report_path, self.digests = report_path, digests
        self.applied: list[int] = []
        self.lines: list[dict] = []
        self._unreported: list[dict] = []          # lines not yet appended to report_path
        self.writer: SnapshotWriter | None = None
        if snapshots is not None:
            snapshots.on_event = control.event
            if snapshots.buffers:
                self.writer = SnapshotWriter(snapshots, replica)   # Snapshots.close lets it finish

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None:
        r = self.replica
        if r.open_iteration is None:
            needed = r.iteration
            outcome = r.begin(iteration)
            if outcome is Begin.RESYNCED:
                self.control.resynced(iteration, "trainer checkpoint")
                if self.gradient_log is not None:
                    self.gradient_log.chain_break()
            elif outcome is Begin.MISSED:
                self._fallback(iteration, f"the streams delivered iteration {iteration} but the replica needs "
                                          f"{needed}: the appliance missed iterations")
            if not outcome.opened:
                return
        r.apply_bucket(bucket, data, lasting=self.lasting_buckets)
        if self.gradient_log is not None:
            self.gradient_log.bucket(iteration, bucket, data)

    def iteration_done(self, iteration: int, report: IterationReport) -> None:
        r = self.replica
        line = {"iteration": iteration, "recovered": report.recovered, "coverage": report.coverage,
                "missing_blocks": report.missing_blocks, "contradicted_blocks": report.contradicted_blocks,
                "mismatches": [{"block": m.block, "groups": m.groups, "resolved": m.resolved,
                                "distrusted": m.distrusted}
                               for m in report.mismatches]}
        if report.mismatches:
            self.control.event("duplicate_mismatch", iteration=iteration, blocks=line["mismatches"])
        if report.contradicted_blocks:
            self._fallback(iteration, f"applied blocks contradicted by a later copy of their frames: "
                                      f"{report.contradicted_blocks} (bucket: blocks)")
        elif not report.recovered:
            self._fallback(iteration, f"blocks no mirror stream delivered: {report.missing_blocks} (bucket: blocks)")
        elif not r.stale and r.open_iteration == iteration:
            r.end()
            self.applied.append(iteration)
            if self.gradient_log is not None:
                self.gradient_log.applied(iteration, r.step)
            if self.attestations is not None:
                self.attestations.reached()       # before the snapshot: a diverged replica writes none
            if self.digests:
                line["digest"] = replica_digest(r)
            if self.snapshots is not None and not r.stale and self.snapshots.due(r.iteration):
                self._snapshot(line)
        if self.gradient_log is not None and self.applied[-1:] != [iteration]:
            self.gradient_log.discard(iteration)
        line["stale"] = r.stale
        self.lines.append(line)
        if self.report_path is not None:
            self._unreported.append(line)
            self._report()

    def _snapshot(self, line: dict) -> None:
        """Snapshot the replica (in the background when there is a writer); a failure is an
        event (``Snapshots.note_failed``), and the replica goes on in memory."""
        r = self.replica
        if self.writer is not None:
            taken = self.writer.take(r)
            if taken is None:
                line["snapshot_skipped"] = "writer busy"
            else:
                line["snapshot_taken"] = str(taken)
            return
        try:
            path = self.snapshots.write_replica(r)
        except SnapshotWriteError as exc:
            line["snapshot_failed"] = exc.reason
            self.snapshots.note_failed(exc)
            return
        line["snapshot"] = str(path)
        self.snapshots.note_written(r.iteration, path)

    def _report(self) -> None:
        """Append the lines not yet in ``report_path``, whole lines or none (a full disk
        keeps them in memory until there is room)."""
        text = "".join(json.dumps(line) + "\n" for line in self._unreported).encode()
        try:
            with self.report_path.open("ab", buffering=0) as f:
                size = f.seek(0, 2)
                try:
                    if f.write(text) != len(text):
                        raise OSError(errno.ENOSPC, "short write")
                except OSError:
                    f.truncate(size)
                    raise
        except OSError as exc:
            if len(self._unreported) == 1:
                log.error("%s: cannot append to it (%s); its lines wait in memory", self.report_path,
                          exc.strerror)
            return
        self._unreported.clear()

    def _fallback(self, iteration: int, reason: str) -> None:
        r = self.replica
        if r.open_iteration is not None:
            r.abort()
        else:
            r.stale = True    # nothing open to abort: the replica simply cannot go on
        self.control.fallback(iteration, reason)
