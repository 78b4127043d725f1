"""Where the merger's buckets meet the replica: control-plane events, the report line, snapshots, digests.

The merger numbers iterations by the trainer's iteration (``Merger(first_iteration=…)``), and
the replica decides what it can do with each (``Replica.begin``: open it, resync from an
offered checkpoint first, or stay or become stale because iterations were missed). The sink
reports what happened on the control plane (``fallback``, ``resync``, ``duplicate_mismatch``),
writes one line per iteration to ``iterations.jsonl``, and snapshots the replica when due.

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
from gradtap.updater.replica import Begin, Replica
from gradtap.updater.snapshot import Snapshots


class ReplicaSink:
    """Applies merged buckets to ``replica``; reports to ``control``; snapshots to ``snapshots``."""

    def __init__(self, replica: Replica, control: ControlPlane, *, snapshots: Snapshots | None = None,
                 report_path: Path | None = None, digests: bool = False):
        self.replica, self.control = replica, control
        self.snapshots = snapshots
        self.report_path, self.digests = report_path, digests
        self.applied: list[int] = []
        self.lines: list[dict] = []

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None:
        r = self.replica
        if r.open_iteration is None:
            needed = r.iteration
            outcome = r.begin(iteration)
            if outcome is Begin.RESYNCED:
                self.control.resynced(iteration, "trainer checkpoint")
            elif outcome is Begin.MISSED:
                self._fallback(iteration, f"the streams delivered iteration {iteration} but the replica needs "
                                          f"{needed}: the appliance missed iterations")
            if not outcome.opened:
                return
        r.apply_bucket(bucket, data)

    def iteration_done(self, iteration: int, report: IterationReport) -> None:
        r = self.replica
        line = {"iteration": iteration, "recovered": report.recovered, "coverage": report.coverage,
                "missing_blocks": report.missing_blocks,
                "mismatches": [{"block": m.block, "groups": m.groups, "resolved": m.resolved}
                               for m in report.mismatches]}
        if report.mismatches:
            self.control.event("duplicate_mismatch", iteration=iteration, blocks=line["mismatches"])
        if not report.recovered:
            self._fallback(iteration, f"blocks no mirror stream delivered: {report.missing_blocks} (bucket: blocks)")
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

    def _fallback(self, iteration: int, reason: str) -> None:
        r = self.replica
        if r.open_iteration is not None:
            r.abort()
        else:
            r.stale = True    # nothing open to abort: the replica simply cannot go on
        self.control.fallback(iteration, reason)
