"""One node of a mirror group: its streams merged with the group's (``merger/group.py``), its
shard of the replica stepped (``updater/shard.py``), what happened reported.

:class:`GroupSink` is the :class:`~gradtap.replica_sink.ReplicaSink` of a shard. Before a
clipped iteration ends it all-gathers the shards' gradient norms, every node for every
iteration the group recovered, so that the rounds stay in step: a node whose shard cannot
step sends none, and then no shard steps (the clip coefficient needs every norm). An
iteration the group could not finish because a peer is gone is a fallback naming the peers
(``group.peer_gone`` on the control plane, then ``fallback``), and the replica is stale.

:func:`join_group` builds a node's part, the same for ``gradtap replay --group``
(:func:`run_group_replay`: :func:`gradtap.replay.replay` with the group's merger and this
sink, into one output directory per node) and ``gradtap run --group`` (the live
:class:`~gradtap.appliance.Appliance`): its shard of the replica, the link to its peers,
its shard snapshots and this sink; the pipeline takes :attr:`GroupNode.merger`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.merger.group import GroupMerger
from gradtap.merger.group_link import GroupBroken, GroupLink
from gradtap.merger.merger import IterationReport, Sink
from gradtap.pipeline import MergerFactory
from gradtap.replay import Progress, ReplayResult, replay
from gradtap.replica_sink import ReplicaSink
from gradtap.start import Numbering, ReplicaStart, replica_start
from gradtap.store.shard_snapshot import ShardSnapshots
from gradtap.updater.replica import Begin
from gradtap.updater.shard import ShardReplica
from gradtap.workload.layout import job_plan
from gradtap.workload.shards import Shards
from gradtap.workload.spec import JobSpec, MirrorGroupSpec
from gradtap.workload.wire_plan import WirePlan


class GroupSink(ReplicaSink):
    """Applies this node's buckets to its shard ``replica``; gathers the shards' norms over ``link``."""

    def __init__(self, replica: ShardReplica, control: ControlPlane, link: GroupLink, *,
                 report_path: Path | None = None, snapshots: ShardSnapshots | None = None):
        super().__init__(replica, control, report_path=report_path)
        self.link, self.shard_snapshots = link, snapshots
        self.group_snapshots: list[Path] = []
        self.gone: dict[int, str] = {}          # peer rank -> why it is gone (the group is broken)

    def iteration_done(self, iteration: int, report: IterationReport) -> None:
        r = self.replica
        if report.recovered and not report.lost_peers and r.open_iteration is None and not r.stepped_buckets():
            self._begin(iteration)        # a shard without buckets hears of the iteration here first
        if report.recovered and not report.lost_peers and self.replica.cfg.clip_grad_norm:
            try:
                self._gather_norms(iteration)
            except GroupBroken as exc:
                report.recovered = False
                report.lost_peers.update(exc.peers)
        if report.lost_peers:
            self._lost(iteration, report)
            return
        super().iteration_done(iteration, report)
        if self.shard_snapshots is not None and report.recovered and self.shard_snapshots.due(iteration + 1):
            self._snapshot(iteration + 1)

    def _snapshot(self, iteration: int) -> None:
        """Every node writes its shard of the state ready for ``iteration``, then the group's
        manifest once all shards are written (``store/shard_snapshot.py``)."""
        r, entry = self.replica, None
        if not r.stale and r.iteration == iteration:
            try:
                entry = self.shard_snapshots.write_shard(r.shard_state(), iteration=iteration, step=r.step,
                                                         lr=r.state.lr)
            except OSError as exc:
                self.control.event("snapshot.failed", iteration=iteration, rank=self.link.rank,
                                   directory=str(self.shard_snapshots.directory), reason=exc.strerror or str(exc),
                                   replica="updating in memory")
        try:
            parts = self.link.all_gather(json.dumps(entry).encode() if entry else b"",
                                         f"iteration {iteration} snapshot")
        except GroupBroken as exc:
            self.gone.update(exc.peers)
            self.control.event("group.peer_gone", iteration=iteration, rank=self.link.rank,
                               peers={str(p): why for p, why in exc.peers.items()})
            return
        missing = [rank for rank, part in enumerate(parts) if not part]
        if missing:
            self.control.event("snapshot.incomplete", iteration=iteration, rank=self.link.rank, missing_ranks=missing)
            return
        self.group_snapshots.append(self.shard_snapshots.commit(iteration, r.step, [json.loads(p) for p in parts]))

    def _begin(self, iteration: int) -> None:
        """Open ``iteration`` as the first bucket would (``ReplicaSink.bucket``)."""
        r, needed = self.replica, self.replica.iteration
        outcome = r.begin(iteration)
        if outcome is Begin.RESYNCED:
            self.control.resynced(iteration, "trainer checkpoint")
        elif outcome is Begin.MISSED:
            self._fallback(iteration, f"the streams delivered iteration {iteration} but the replica needs {needed}: "
                                      "the appliance missed iterations")

    def _gather_norms(self, iteration: int) -> None:
        r = self.replica
        mine = r.shard_norms() if r.open_iteration == iteration and not r.stale else b""
        messages = self.link.all_gather(mine, f"iteration {iteration} gradient norms")
        absent = [rank for rank, m in enumerate(messages) if not m]
        if mine and absent:
            self._fallback(iteration, f"mirror group: node ranks {absent} have no gradient norms of iteration "
                                      f"{iteration} (their shards are stale); the clip coefficient needs every "
                                      "shard's")
        elif mine:
            r.add_norms({rank: m for rank, m in enumerate(messages) if rank != self.link.rank})

    def _lost(self, iteration: int, report: IterationReport) -> None:
        self.gone.update(report.lost_peers)
        peers = {str(p): why for p, why in sorted(report.lost_peers.items())}
        self.control.event("group.peer_gone", iteration=iteration, rank=self.link.rank, peers=peers)
        self._fallback(iteration, "mirror group: " + "; ".join(f"node rank {p} is gone ({why})"
                                                               for p, why in peers.items())
                       + "; its shard of this iteration cannot be completed", lost_peers=peers)
        line = {"iteration": iteration, "recovered": False, "coverage": report.coverage, "lost_peers": peers,
                "missing_blocks": report.missing_blocks, "contradicted_blocks": report.contradicted_blocks,
                "mismatches": [], "stale": True}
        self.lines.append(line)
        if self.report_path is not None:
            self._unreported.append(line)
            self._report()

    def _fallback(self, iteration: int, reason: str, **fields) -> None:
        r = self.replica
        if r.open_iteration is not None:
            r.abort()
        else:
            r.stale = True
        self.control.fallback(iteration, reason, **fields)


def group_merger(link: GroupLink, shards: Shards, job: JobSpec):
    """The pipeline's merger factory for a node of the group (``Pipeline(merger=...)``)."""
    order = [m.name for m in job.mirrors]

    def make(plan: WirePlan, streams: list[str], sink: Sink, first: int | None, settle_ns: int) -> GroupMerger:
        return GroupMerger(plan, streams, sink, link, shards, order, first, settle_ns)
    return make


@dataclass
class GroupNode:
    """This appliance's part of mirror group ``spec``: the job's wire plan, its shard of the
    replica (the group's bucket owners: ``Shards.of_group``), the link to its peers, the sink
    that steps the shard and the pipeline's merger factory."""

    spec: MirrorGroupSpec
    plan: WirePlan
    replica: ShardReplica
    link: GroupLink
    sink: GroupSink
    merger: MergerFactory

    @property
    def gone(self) -> dict[int, str]:
        """Peer rank -> why it is gone; empty while the group holds."""
        return self.sink.gone

    def report(self) -> dict:
        """The group section of ``replay.json`` and ``GET /status``: this node's rank and shard,
        each peer ``up`` or why it is gone, the bytes sent to and received from the peers (sent:
        also by what the rounds carried, ``GroupLink.sent_by_kind``)."""
        r, gone = self.replica, self.gone
        return {"rank": self.spec.rank, "world_size": self.spec.world_size, "rendezvous": self.spec.rendezvous,
                "buckets": r.stepped_buckets(), "elements": [r.shard.start, r.shard.stop],
                "peers": {str(p): gone.get(p, "up") for p in self.link.peers},
                "sent_bytes": self.link.sent_bytes, "sent_by_kind": dict(self.link.sent_by_kind),
                "received_bytes": self.link.received_bytes}

    def close(self) -> None:
        self.link.close()


def check_group_node(job: JobSpec, streams: list[str], start: ReplicaStart) -> None:
    """``ConfigError`` for what a node of a mirror group cannot do (yet), before anything is built."""
    if not streams:
        raise ConfigError("mirror group: a node takes part in the group's rounds as its own streams progress, so it "
                          "needs at least one stream; give this node a capture, or leave it out of the group")
    if not job.nccl.resolved:
        raise ConfigError("mirror group: nccl.era and nccl.protocol must be given (not auto) for a group, so that "
                          "every node shards the same bucket layout from the start")
    if job.appliance.store is not None:
        raise ConfigError(f"appliance.store ({job.appliance.store.url}): the durable store and its gradient log are "
                          "not wired for mirror-group shards yet; remove the section (and --store) for a group node")
    if start.waiting:
        raise ConfigError("mirror group: a node needs a start state (--start CKPT, or the job's "
                          "initial_state.checkpoint): the trainer's offers (POST /resync) are not wired for shards "
                          "yet, so a node waiting for one would wait for ever")


def join_group(job: JobSpec, streams: list[str], start: ReplicaStart, group: MirrorGroupSpec, out: Path,
               control: ControlPlane) -> GroupNode:
    """Node ``group.rank``'s part of the mirror group, its shard started from ``start`` and
    snapshotted into ``out/snapshots`` (``store/shard_snapshot.py``), its report lines in
    ``out/iterations.jsonl``; the rendezvous waits for every node (up to the group's timeout:
    :class:`~gradtap.merger.group_link.PeerGone` naming the nodes that did not come).
    ``ConfigError`` for what a group node cannot do (yet): :func:`check_group_node`."""
    check_group_node(job, streams, start)
    out.mkdir(parents=True, exist_ok=True)
    plan = job_plan(job)
    shards = Shards.of_group(job, plan, group)
    replica = ShardReplica(job, start.take_checkpoint(), shards, group.rank)
    snapshots = ShardSnapshots(out / "snapshots", job.name, group.rank, group.world_size,
                               every=job.appliance.snapshot_every, keep=job.appliance.snapshot_keep)
    link = GroupLink(group)
    sink = GroupSink(replica, control, link, report_path=out / "iterations.jsonl", snapshots=snapshots)
    return GroupNode(group, plan, replica, link, sink, group_merger(link, shards, job))


def run_group_replay(job: JobSpec, pcaps: dict[str, Path], out: Path, start: dict | ReplicaStart,
                     group: MirrorGroupSpec, *,
                     batch_frames: int = 65536, progress: Progress | None = None,
                     start_source: str = "the start state") -> tuple[ReplayResult, GroupSink]:
    """Replay this node's ``pcaps`` as node ``group.rank`` of a mirror group, its shard of a
    replica initialised from ``start``, into ``out``: ``snapshots/`` (its shards, and the group's
    manifests: ``store/shard_snapshot.py``), ``iterations.jsonl``, ``events.jsonl``,
    ``replay.json`` (with the group's figures: its shard, bytes sent to and received from
    peers against the mirrored bytes read)."""
    begin = replica_start(job, start, start_source)
    check_group_node(job, list(pcaps), begin)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("iterations.jsonl", "events.jsonl"):
        (out / stale).unlink(missing_ok=True)
    control = ControlPlane(out / "events.jsonl", job.appliance.control_endpoint)
    started = time.perf_counter()
    node = join_group(job, list(pcaps), begin, group, out, control)
    try:
        numbering = Numbering(begin, node.replica, control)
        result = replay(job, node.plan, pcaps, node.sink, batch_frames=batch_frames, numbering=numbering,
                        merger=node.merger, overlap=False,
                        on_lockon_failed=lambda failure: control.event("lockon.failed", **failure.as_event()),
                        **({} if progress is None else {"progress": progress}))
    finally:
        node.close()
    sink = node.sink
    (out / "replay.json").write_text(json.dumps({
        "job": job.name, "streams": {n: str(p) for n, p in pcaps.items()}, "wall_s": time.perf_counter() - started,
        "frames": result.frames, "bytes": result.bytes, "events": result.counters, "iterations": sink.lines,
        "stale": node.replica.stale, "locked": result.locked, "timings": [t.__dict__ for t in result.timings],
        "group": {**node.report(), "mirrored_bytes": sum(result.bytes.values())}}, indent=1))
    return result, sink
