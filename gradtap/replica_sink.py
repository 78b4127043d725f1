"""Where the merger's buckets meet the replica: iteration numbering, fallback, snapshots, digests.

The merger numbers iterations by their ordinal since the capture began; the replica by the
trainer's iteration. ``first_iteration`` is the trainer iteration of ordinal 0, which is
the iteration of the checkpoint the replica started from when the capture began with it. A
merged iteration that is not the replica's next one means the appliance missed iterations:
the replica cannot follow, which is a fallback like an unrecoverable iteration.

After every applied iteration the sink can record the replica's state digest
(``gradtap/digest.py``) so that ``gradtap verify`` checks every iteration, not only the
snapshots kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from gradtap.control import ControlPlane
from gradtap.digest import replica_digest
from gradtap.merger.merger import IterationReport
from gradtap.updater.replica import Replica
from gradtap.updater.snapshot import Snapshots


class ReplicaSink:
    """Applies merged buckets to ``replica``; reports to ``control``; snapshots to ``snapshots``."""

    def __init__(self, replica: Replica, control: ControlPlane, first_iteration: int, *,
                 snapshots: Snapshots | None = None, report_path: Path | None = None, digests: bool = False,
                 resync: list[dict] | None = None):
        self.replica, self.control, self.first = replica, control, first_iteration
        self.snapshots = snapshots
        self.offers = {int(c["iteration"]): c for c in resync or []}
        self.report_path, self.digests = report_path, digests
        self.applied: list[int] = []
        self.lines: list[dict] = []

    def offer(self, checkpoint: dict) -> None:
        """A trainer checkpoint to resynchronise a stale replica from: it is used when the
        streams reach the iteration it is ready for (``checkpoint["iteration"]``)."""
        self.offers[int(checkpoint["iteration"])] = checkpoint

    def bucket(self, ordinal: int, bucket: int, data: np.ndarray) -> None:
        r = self.replica
        iteration = self.first + ordinal
        if r.stale and r.open_iteration is None and iteration in self.offers:
            r.resync(self.offers.pop(iteration))
            self.control.resynced(iteration, "trainer checkpoint")
        if r.stale:
            return
        if r.open_iteration is None:
            if iteration != r.iteration:
                self._fallback(ordinal, f"the streams delivered iteration {iteration} but the replica needs "
                                        f"{r.iteration}: the appliance missed iterations")
                return
            r.begin(iteration)
        r.apply_bucket(bucket, data)

    def iteration_done(self, ordinal: int, report: IterationReport) -> None:
        r = self.replica
        iteration = self.first + ordinal
        line = {"iteration": iteration, "recovered": report.recovered, "coverage": report.coverage,
                "missing_blocks": report.missing_blocks,
                "mismatches": [{"block": m.block, "groups": m.groups, "resolved": m.resolved}
                               for m in report.mismatches]}
        if report.mismatches:
            self.control.event("duplicate_mismatch", iteration=iteration, blocks=line["mismatches"])
        if not report.recovered:
            self._fallback(ordinal, f"blocks no mirror stream delivered: {report.missing_blocks} (bucket: blocks)")
        elif not r.stale and r.open_iteration == iteration:
            r.end()
            self.applied.append(iteration)
            if self.digests:
                line["digest"] = replica_digest(r)
            if self.snapshots is not None and self.snapshots.due(r.iteration):
                line["snapshot"] = str(self.snapshots.write_replica(r))
        line["stale"] = r.stale
        self.lines.append(line)
        if self.report_path is not None:
            with self.report_path.open("a") as f:
                f.write(json.dumps(line) + "\n")

    def _fallback(self, ordinal: int, reason: str) -> None:
        r = self.replica
        if r.open_iteration is not None:
            r.abort()
        else:
            r.stale = True    # nothing open to abort: the replica simply cannot go on
        self.control.fallback(self.first + ordinal, reason)
