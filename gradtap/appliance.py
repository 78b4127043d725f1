"""The live appliance: capture workers → shared rings → parse → merge → update, until stopped.

One capture worker process per mirror stream (``capture/worker.py``; pinned to its core)
fills one shared-memory frame ring (huge pages when the host has them). The main process
reads every ring in rounds and drives the same :class:`gradtap.pipeline.Pipeline` as offline
replay: the parsers run in their own threads, pinned to their cores, the merger and the
updater on the main thread. It writes snapshots as the job configures, and stops cleanly on
SIGINT/SIGTERM (or :meth:`Appliance.stop`) with a final snapshot. A capture worker that dies
stops the appliance with its error: the process exits non-zero and never hangs.

As a node of a mirror group (``group``: ``docs/group.md``) it steps its shard of the replica
(:func:`gradtap.group.join_group`, as ``gradtap replay --group`` does), its merger merging
with the peers' over gloo; a peer gone (``group.peer_gone``, then a ``fallback``) stops it
with exit code 4, since a broken group merges nothing more. A group node writes its shard
snapshots when due and no final one (that would be a round its peers are not in), and
takes no durable store, gradient log, offers or attestations (not wired for shards yet).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gradtap.attestation import Attestations
from gradtap.capture.ring import FrameRing
from gradtap.capture.worker import CaptureWorker, SourceSpec
from gradtap.control import ControlPlane
from gradtap.core.errors import CaptureError, ConfigError
from gradtap.core.jit import fit_threads
from gradtap.merger.merger import Merger
from gradtap.pipeline import Cores, Pipeline, start_up_frozen
from gradtap.rehearsal import Rehearsal, rehearse
from gradtap.status import ApplianceStatus
from gradtap.replica_sink import ReplicaSink
from gradtap.start import Numbering, ReplicaStart, replica_start
from gradtap.store_tier import gradient_log_for, store_close_timeout, uploader_for
from gradtap.updater.replica import Replica
from gradtap.updater.replica_origin import ReplicaOrigin
from gradtap.store.snapshot import Snapshots, SnapshotWriteError
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import JobSpec, MirrorGroupSpec

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    ring_slots: int = 1 << 16
    slot_size: int = 9216                 # a jumbo RoCE frame (MTU 4096 + headers) with room
    hugepages: str = "auto"
    capture_cpus: dict[str, int] = field(default_factory=dict)   # stream -> core
    parse_cpus: list[int] = field(default_factory=list)          # cores for the parser threads
    update_cpus: list[int] = field(default_factory=list)         # cores for the update thread (pipeline_cores)
    batch_frames: int | None = None       # frames a round takes per stream at most (None: round_frames)
    poll_s: float = 0.05
    digests: bool = False                 # a state digest per iteration, for `gradtap verify`
    force: bool = False                   # clear an --out holding another replica's snapshots
    start: Path | None = None             # --start: from one of --out's own snapshots, the run continues its replica
    control_token_file: Path | None = None  # --control-token-file (default: the job's, else OUT/control.token)
    rehearse: bool = True                 # run the pipeline on a miniature of the job before listening (--no-rehearsal)

    @property
    def round_frames(self) -> int:
        """The frames a round reads from each stream's ring at most: ``batch_frames``, else a
        quarter of the ring (16384 of the default 65536 slots). A round reads only what has
        arrived, so this bounds the rounds of an appliance that has fallen behind: larger
        rounds share each round's fixed costs (waking the parser threads, the merge on one
        core, the threads that finish first waiting for the last) among more frames. A round
        holds its slots until the next one, so the capture keeps three quarters of the ring
        to write into meanwhile. ``benchmarks.replay`` (GPT-2 small, 3 streams, 2 cores;
        alternated twice, runs 2-4 of 4 replays each): 1.24-1.32 s per 2 iterations (median
        1.28) in rounds of 8192 frames, 1.15-1.31 (1.20) of 16384, 1.11-1.27 (1.14) of 32768,
        which leaves the capture only half the ring."""
        return self.batch_frames or max(1, self.ring_slots // 4)


def pipeline_cores(options: RunOptions) -> Cores:
    """Where the pipeline's threads run: the parsers on ``parse_cpus``; the update thread on
    ``update_cpus``, else, when the parsers are pinned, on the cores neither they nor the
    capture workers take (on theirs when there is none left), else anywhere."""
    parse = frozenset(options.parse_cpus)
    update = frozenset(options.update_cpus)
    if parse and not update:
        update = frozenset(os.sched_getaffinity(0)) - parse - frozenset(options.capture_cpus.values()) or parse
    return Cores(parse, update)


def control_token_file(job: JobSpec, out: Path, options: RunOptions) -> Path:
    """The control token's file: ``--control-token-file``, else ``appliance.control_token_file``,
    else ``OUT/control.token``."""
    return options.control_token_file or job.appliance.control_token_file or out / "control.token"


@dataclass
class RunResult:
    exit_code: int
    reason: str
    iterations: int
    unrecoverable: int


GROUP_BROKEN_EXIT = 4      # a peer of the mirror group is gone: the node stops


class Appliance:
    """Capture ``streams`` (name → :class:`SourceSpec`) of ``job`` into a replica started from
    ``start`` (a trainer checkpoint, or None to wait for the trainer's: ``gradtap/start.py``);
    with ``group``, into this node's shard of the group's replica (the rendezvous waits here
    for every node, up to the group's timeout)."""

    @staticmethod
    def check_streams(job: JobSpec, streams: dict[str, SourceSpec]) -> None:
        """ConfigError naming the streams that are no mirror of ``job``; checked by ``gradtap
        run`` before it loads the start state too."""
        unknown = set(streams) - {m.name for m in job.mirrors}
        if unknown:
            raise ConfigError(f"--stream: {sorted(unknown)} are not mirror streams of job {job.name!r}")

    def __init__(self, job: JobSpec, streams: dict[str, SourceSpec], out: Path, start: ReplicaStart | dict | None,
                 options: RunOptions = RunOptions(), group: MirrorGroupSpec | None = None):
        self.check_streams(job, streams)
        self.job, self.specs, self.out, self.options = job, streams, Path(out), options
        start = replica_start(job, start, "the start state", handed_over=False)     # a dict stays the caller's
        self.group = None
        if group is None:
            merger = self._single(job, start, options)
            plan = job_plan(job) if job.nccl.resolved else None
        else:
            merger = self._group(job, start, options, group)
            plan = self.group.plan
        # The replica and its sink: the pipeline's update thread against status(), offers and
        # attestations. Taken after self._lock by whoever takes both (an offer: it numbers the
        # pipeline's iterations too).
        self._replica_lock = threading.Lock()
        try:
            self.numbering = Numbering(start, self.replica, self.control)
            self.pipeline = Pipeline(job, plan, list(streams), self.sink, start.first_iteration,
                                     on_lockon_failed=lambda failure: self.control.event("lockon.failed",
                                                                                         **failure.as_event()),
                                     on_anchor=self.numbering.placed,
                                     on_resolved=lambda r: self.control.event("job.resolved", **r.as_event()),
                                     merger=merger, overlap=None if group is None else False,
                                     update_lock=self._replica_lock, cores=pipeline_cores(options))
            self.numbering.attach(self.pipeline)
        except BaseException:
            if self.group is not None:
                self.group.close()
            raise
        self.rings: dict[str, FrameRing] = {}
        self.workers: dict[str, CaptureWorker] = {}
        self._final_capture: dict[str, dict] | None = None   # counters kept once the rings are gone
        self.stopping = threading.Event()
        self.ready = threading.Event()     # every capture worker is listening
        self.rehearsal: Rehearsal | None = None
        self._lock = threading.Lock()      # the pipeline: status() for metrics vs the loop

    def _single(self, job: JobSpec, start: ReplicaStart, options: RunOptions):
        """The whole replica, its snapshots, store tier, gradient log and attestations."""
        self.replica = Replica(job, start.take_checkpoint(), consume=start.handed_over)
        origin = ReplicaOrigin.of(self.replica, start.waiting)
        # First: refuses an --out that cannot be written or holds another replica's snapshots.
        self.uploader = uploader_for(job)
        self.snapshots = Snapshots(self.out / "snapshots", job.name, every=job.appliance.snapshot_every,
                                   keep=job.appliance.snapshot_keep, buffers=job.appliance.snapshot_buffers,
                                   origin=origin, force=options.force, continues=options.start,
                                   uploader=self.uploader, close_timeout_s=store_close_timeout(job))
        self.gradient_log = gradient_log_for(job, self.replica, None if start.waiting else origin)
        # The fallback POST carries the control token, the one the control server checks.
        self.control = ControlPlane(self.out / "events.jsonl", job.appliance.control_endpoint,
                                    token_file=control_token_file(job, self.out, options))
        if self.uploader is not None:
            self.uploader.on_event = self.control.event
        if self.gradient_log is not None:
            self.gradient_log.on_event = self.control.event
        self.attestations = Attestations(self.replica, self.control)
        self.sink = ReplicaSink(self.replica, self.control, snapshots=self.snapshots,
                                report_path=self.out / "iterations.jsonl", digests=options.digests,
                                attestations=self.attestations, gradient_log=self.gradient_log,
                                lasting_buckets=True)
        return Merger

    def _group(self, job: JobSpec, start: ReplicaStart, options: RunOptions, group: MirrorGroupSpec):
        """This node's part of the mirror group (``gradtap/group.py``), as replay builds it."""
        from gradtap.group import check_group_node, join_group

        for flag, given in (("digests (a shard keeps no whole-replica digests)", options.digests),
                            ("--force", options.force)):
            if given:
                raise ConfigError(f"mirror group: {flag} is not wired for shards yet; run the node without it")
        check_group_node(job, list(self.specs), start)
        self.control = ControlPlane(self.out / "events.jsonl", job.appliance.control_endpoint,
                                    token_file=control_token_file(job, self.out, options))
        self.uploader = self.gradient_log = self.attestations = self.snapshots = None
        self.group = join_group(job, list(self.specs), start, group, self.out, self.control)
        self.replica, self.sink = self.group.replica, self.group.sink
        return self.group.merger

    def stop(self) -> None:
        self.stopping.set()

    def offer(self, checkpoint: dict, source: str = "POST /resync", *, handed_over: bool = False) -> list[int]:
        """A trainer checkpoint to resynchronise from (the control endpoint's POST /resync): it
        replaces any offer pending; the iterations of the offers it replaced. Until the
        iterations are numbered, it must carry ``time_ns`` (``gradtap/start.py``).
        ``handed_over``: nothing else keeps the checkpoint's tensors, which then leave it as
        they are copied (``Numbering.make_offer``)."""
        self._not_for_group("POST /resync (a trainer checkpoint offered)")
        # Made without the locks: the rounds (self._lock) and the update thread (the replica's)
        # go on while its 12 bytes per parameter are copied and checked. Under them, the copy
        # (GPT-2 small: 1.3-6.8 s on a 2-core AMD EPYC) stalled both for as long as it took,
        # longer than the capture rings hold.
        made = self.numbering.make_offer(checkpoint, source, handed_over=handed_over)
        with self._lock, self._replica_lock:
            return self.numbering.offer(made, source)

    def attest(self, fingerprint: object) -> dict:
        """The trainer's fingerprint of its state (the control endpoint's POST /attest): held
        until the replica reaches that state, then compared (``gradtap/attestation.py``)."""
        self._not_for_group("POST /attest (the trainer's fingerprint)")
        with self._replica_lock:
            return self.attestations.offer(fingerprint)

    def _not_for_group(self, what: str) -> None:
        if self.group is not None:
            raise ConfigError(f"{what}: not wired for mirror-group shards yet; node {self.group.spec.rank} of "
                              f"{self.group.spec.world_size} refuses it (docs/group.md, Not done yet)")

    def run(self) -> RunResult:
        reason, code = "stopped", 0
        files = any(spec.source == "pcap" for spec in self.specs.values())
        try:
            self.rehearse()
            self._start_workers()
            self._pin_parsers()
            with self._lock:
                self.pipeline.listening_ns = time.time_ns()    # every worker listens: no iteration begins unseen
            self.ready.set()
            with start_up_frozen():
                while not self.stopping.is_set():
                    if all(ring.finished for ring in self.rings.values()):
                        reason = "every source ended"      # files; a live interface never ends
                        break
                    # A worker that ended by itself (a file source) exits 0 and has closed its ring.
                    dead = [n for n, w in self.workers.items() if not w.alive and w.exitcode not in (0, None)]
                    if dead:
                        reason, code = self._crashed(dead[0]), 3
                        break
                    batches = {n: ring.read(self.options.round_frames, self.options.poll_s, self.stopping)
                               for n, ring in self.rings.items()}
                    # A live capture's clock runs on while its ports are quiet; a file's is its frames'.
                    now = -1 if files else time.time_ns()
                    with self._lock:
                        self.pipeline.round(batches, now)
                    if self.group is not None and self.group.gone:
                        reason, code = self._group_broken(), GROUP_BROKEN_EXIT
                        break
            # A group node stopped by a signal, or whose capture died, leaves its group here: the
            # rounds that would close its pending iterations are rounds its peers are not in.
            if self.group is None or reason == "every source ended":
                with self._lock:
                    self.pipeline.finish()
                if self.group is not None and self.group.gone:
                    reason, code = self._group_broken(), GROUP_BROKEN_EXIT
            if files and reason == "every source ended" and not any(self.pipeline.locked().values()):
                # As replay: a file run that applied nothing must not pass as a success in a script.
                reason, code = ("every source ended, and no stream locked on to the job's traffic "
                                "(events.jsonl: lockon.failed says why)"), 1
        finally:
            self.pipeline.close()       # the update thread makes what is queued first
            final = (code == 0 and not self.replica.stale and self.replica.open_iteration is None
                     and bool(self.sink.applied) and self.group is None)
            self._shutdown(final)
        lines = self.sink.lines
        return RunResult(code, reason, len(lines), sum(not x["recovered"] for x in lines))

    def rehearse(self) -> Rehearsal | None:
        """Run the pipeline on a miniature of the job (``gradtap/rehearsal.py``), unless done
        or ``options.rehearse`` is off: it compiles every kernel the frames will run, before
        any frame can wait for one. :meth:`run` does it first; a caller may do it earlier, to
        show it. Raises :class:`~gradtap.rehearsal.RehearsalFailed` when not exact."""
        if self.rehearsal is None and self.options.rehearse:
            log.info("rehearsing the pipeline on a miniature of job %s before the capture starts", self.job.name)
            self.rehearsal = rehearse(self.job, self.options.round_frames, self.options.slot_size,
                                      digests=self.options.digests)
            log.info("rehearsal: %d iterations exact in %.1f s", self.rehearsal.iterations, self.rehearsal.seconds)
        return self.rehearsal

    def status(self) -> ApplianceStatus:
        """The counters as they are now (thread-safe; the metrics and control threads call it).
        The pipeline's side and the replica's are read under their own locks, one after the
        other: holding the first while waiting for the second (an Adam pass under way on the
        update thread) would keep the next round from starting."""
        with self._lock:
            capture = self._final_capture if self._final_capture is not None else self._capture_stats()
            timings = self.pipeline.timings()
            parse_s, merge_s, update_s = self.pipeline.times.total()
            events, locked = self.pipeline.counters(), self.pipeline.locked()
            numbered, skipped = self.pipeline.numbered, self.pipeline.skipped
            backlog = None if self.pipeline.update is None else self.pipeline.update.backlog
            late = self.pipeline.pool.fresh if self.pipeline.resolved else 0
            group = None if self.group is None else self.group.report()
        with self._replica_lock:
            lines = self.sink.lines
            recovered = sum(x["recovered"] for x in lines)
            return ApplianceStatus(capture=capture, events=events, recovered=recovered,
                                   unrecoverable=len(lines) - recovered, replica_iteration=self.replica.iteration,
                                   stale=self.replica.stale, lag_s=timings[-1].lag_s if timings else 0.0,
                                   parse_s=parse_s, merge_s=merge_s, update_s=update_s,
                                   locked=locked, numbered=numbered, skipped=skipped,
                                   attested=0 if self.attestations is None else self.attestations.attested,
                                   diverged=0 if self.attestations is None else self.attestations.diverged,
                                   snapshots=self.snapshots.counts() if self.snapshots is not None else None,
                                   store=None if self.uploader is None else self.uploader.counts(),
                                   gradient_log=None if self.gradient_log is None else self.gradient_log.counts(),
                                   listening=self.ready.is_set(), update_backlog=backlog,
                                   gradients_made_late=late, cpu_s=time.process_time(), group=group)

    def _capture_stats(self) -> dict[str, dict]:
        out = {}
        for n, w in self.workers.items():
            try:
                out[n] = {**self.rings[n].stats(), **w.stats()}
            except CaptureError:
                out[n] = self.rings[n].stats()
        return out

    def _start_workers(self) -> None:
        o = self.options
        for name, spec in self.specs.items():
            ring = FrameRing.create(o.ring_slots, o.slot_size, hugepages=o.hugepages, name=f"gradtap-{name}")
            self.rings[name] = ring
            log.info("stream %s: ring of %d slots x %d B on %s pages", name, o.ring_slots, o.slot_size,
                     "huge" if ring.hugepages else "normal")
            worker = CaptureWorker(spec, ring, cpu=o.capture_cpus.get(name), name=f"gradtap-capture-{name}")
            self.workers[name] = worker
            worker.start()

    def _pin_parsers(self) -> None:
        cpus = self.options.parse_cpus
        if cpus:
            # The parsers' pool threads are started lazily; pinning the process's main
            # thread first makes every thread it starts inherit these cores.
            os.sched_setaffinity(0, set(cpus))
            fit_threads()

    def _group_broken(self) -> str:
        gone = "; ".join(f"node rank {p} is gone ({why})" for p, why in sorted(self.group.gone.items()))
        log.error("mirror group: %s; stopping (the replica is stale)", gone)
        return f"mirror group broken: {gone}; the replica is stale (restart the group's nodes)"

    def _crashed(self, name: str) -> str:
        worker = self.workers[name]
        try:
            worker.stop(timeout=2.0)
            why = f"exit code {worker.exitcode}"
        except CaptureError as exc:
            why = str(exc)
        log.error("capture worker of stream %s died (%s): stopping", name, why)
        self.control.event("stage_crashed", stage=f"capture:{name}", error=why)
        return f"capture worker of stream {name} died: {why}"

    def _shutdown(self, final_snapshot: bool) -> None:
        for name, worker in self.workers.items():
            try:
                if worker.alive:
                    worker.stop(timeout=5.0)
            except CaptureError as exc:
                log.error("stream %s: %s", name, exc)
        self.pipeline.close()
        if self.group is not None:
            self.group.close()
        if self.gradient_log is not None:
            self.gradient_log.close(store_close_timeout(self.job))
        try:
            if self.snapshots is not None:
                self.snapshots.close(self.replica if final_snapshot else None)
        except SnapshotWriteError as exc:      # the final snapshot: said, and the rings still closed
            log.error("%s", exc)
            self.control.event("snapshot.failed", iteration=exc.iteration, directory=str(exc.directory),
                               reason=exc.reason, error=str(exc), final=True)
        with self._lock:
            self._final_capture = self._capture_stats()
            for ring in self.rings.values():
                ring.close()


def wait_for_stop(appliance: Appliance, signals: tuple[int, ...]) -> None:
    """Make ``signals`` stop ``appliance`` cleanly (a second one is not needed: it never hangs)."""
    import signal

    def handler(signum, frame):
        del frame
        log.info("signal %d: stopping (final snapshot follows)", signum)
        appliance.stop()

    for s in signals:
        signal.signal(s, handler)


def status_loop(appliance: Appliance, render: Callable[[ApplianceStatus], None],
                every_s: float = 0.5) -> threading.Thread:
    """Call ``render(appliance.status())`` every ``every_s`` seconds until the appliance stops."""
    def loop():
        while not appliance.stopping.wait(every_s):
            render(appliance.status())
    thread = threading.Thread(target=loop, name="gradtap-status", daemon=True)
    thread.start()
    return thread


