"""Offline replay: capture files → parse → merge → update, the appliance's pipeline over pcaps.

Each stream's file is read in bounded batches (``gradtap.capture.pcap.PcapReader``), without copying
the frames out of the file's mapping. All streams advance together in time: every round
takes from each stream the frames up to a common horizon (the earliest end of the streams'
buffered batches), so no stream runs ahead of the others by more than one batch of the
slowest; this matters because the merger's deadline looks at how far each stream has got.
Each round goes through the :class:`gradtap.pipeline.Pipeline` the live appliance drives too.

A round also ends where every stream pauses for ``appliance.iteration_gap_ns`` (between two
iterations of training, :func:`quiet_from`), and the capture's clock is then given as the end of
that pause, as a live capture's rings hold nothing more at such a pause and its clock runs on.
So the merger finishes an iteration, and the updater applies it, in the round of its last
frames, instead of after the round that also parses the next iteration's first frames.

:func:`replay` feeds any sink; :func:`run_replay` is ``gradtap replay``: a replica, its
snapshots, the event log and the per-iteration report in one output directory.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.gradient_dump import GradientDump
from gradtap.merger.merger import IterationReport, Merger, Sink
from gradtap.parser.lockon import LockFailure
from gradtap.parser.resolve import Resolution
from gradtap.pipeline import IterationTiming, MergerFactory, Pipeline, StageTimes, start_up_frozen
from gradtap.replica_sink import ReplicaSink
from gradtap.start import Numbering, ReplicaStart, replica_start
from gradtap.store_tier import gradient_log_for, store_close_timeout, uploader_for
from gradtap.updater.replica import Replica
from gradtap.updater.replica_origin import ReplicaOrigin
from gradtap.store.snapshot import Snapshots
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import JobSpec
from gradtap.workload.wire_plan import WirePlan


class _Source:
    """One stream's capture file, served in time slices."""

    def __init__(self, path: Path, batch_frames: int):
        self.reader = PcapReader(path, max_frames=batch_frames, copy=False)
        self.batches = iter(self.reader)
        self.pending: FrameBatch | None = None
        self.done = False
        self.frames = 0
        self.bytes = 0
        self.file_bytes = path.stat().st_size
        self._read = 0                               # frames in the last batch read

    def fill(self) -> None:
        """Read ahead: what is left of a batch is topped up with the next one when it is under
        half a batch (the streams' batches end at slightly different times, and those
        remainders would otherwise make rounds of a few frames each)."""
        left = 0 if self.pending is None else len(self.pending.offsets)
        if 2 * left < self._read or left == 0:
            more = next(self.batches, None)
            if more is not None:
                self._read = len(more.offsets)
                self.pending = more if left == 0 else _join(self.pending, more)
        if self.pending is None or len(self.pending.offsets) == 0:
            self.done = True

    def horizon(self) -> int | None:
        """Time of the last buffered frame (None at end of file)."""
        self.fill()
        return None if self.done else int(self.pending.ts_ns[-1])

    def take(self, until: int) -> FrameBatch | None:
        b = self.pending
        if b is None:
            return None
        cut = int(np.searchsorted(b.ts_ns, until, side="right"))
        head = b.frames(0, cut)
        self.pending = b.frames(cut) if cut < len(b.offsets) else None
        self.frames += cut
        self.bytes += int(head.caplens.sum())
        return head

    def close(self) -> None:
        self.reader.close()


def quiet_from(stamps: list[np.ndarray], until: int, gap_ns: int) -> int | None:
    """The earliest frame time ``t`` with ``t + gap_ns <= until`` after which every stream is
    quiet for ``gap_ns`` (no frame in ``(t, t + gap_ns)``), or None. ``stamps``: each stream's
    buffered frame times, in order, every one reaching ``until`` at least (so that each tells
    what it carries up to there). A pause of one stream alone is no candidate: it is the
    iteration boundary of the job's traffic that all streams see."""
    starts = [ts[:np.searchsorted(ts, until - gap_ns, side="right") + 1] for ts in stamps]  # and one frame more
    t = np.unique(np.concatenate([s[:-1][np.diff(s) >= gap_ns] for s in starts] or [np.zeros(0, np.int64)]))
    quiet = np.ones(len(t), bool)
    for ts in stamps:
        quiet &= np.searchsorted(ts, t, side="right") == np.searchsorted(ts, t + gap_ns, side="left")
    return int(t[quiet][0]) if quiet.any() else None


def _join(a: FrameBatch, b: FrameBatch) -> FrameBatch:
    """``a``'s frames then ``b``'s; batches of one file mapping share their data, so only the
    frame arrays are joined."""
    if a.data is not b.data:
        return FrameBatch.concat([a, b], a.linktype)
    return FrameBatch(a.data, *(np.concatenate([getattr(a, k), getattr(b, k)])
                                for k in ("offsets", "caplens", "wirelens", "ts_ns")), a.linktype,
                      lasting=a.lasting and b.lasting)


@dataclass
class ReplayResult:
    reports: list[IterationReport]
    counters: dict[str, dict[str, int]]        # stream -> decode event -> count
    frames: dict[str, int]
    bytes: dict[str, int]
    times: StageTimes
    wall_s: float
    timings: list[IterationTiming]
    locked: dict[str, bool]                    # stream -> locked on at some point
    overlapped: bool = False                   # the sink ran on the update thread, beside the parsers
    cores: int = 1                             # CPUs the process could run on
    late_buffers: int = 0                      # gradient buffers made after start-up (GradientPool.fresh)

    @property
    def mirrored_gbps(self) -> float:
        """Mirrored traffic processed: the captured frames' bits over the replay's wall time
        (parse, merge, update, and the snapshots written on the update path), in Gb/s."""
        return 8 * sum(self.bytes.values()) / self.wall_s / 1e9 if self.wall_s > 0 else 0.0


Progress = Callable[[str, int, int], None]     # (stream, bytes read, file bytes)


def _no_progress(stream: str, done: int, total: int) -> None:
    del stream, done, total


def match_streams(job: JobSpec, pcaps: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` or a path whose file name (without suffix) is a stream of the job."""
    names = [m.name for m in job.mirrors]
    out: dict[str, Path] = {}
    for spec in pcaps:
        name, sep, path = spec.partition("=")
        if not sep:
            path, name = spec, Path(spec).name.split(".")[0]
        if name not in names:
            raise ConfigError(f"capture {spec!r}: {name!r} is not a mirror stream of job {job.name!r} "
                              f"(streams: {', '.join(names)}); name it as STREAM=PATH")
        if name in out:
            raise ConfigError(f"capture {spec!r}: stream {name!r} is given twice")
        if not Path(path).is_file():
            raise ConfigError(f"capture {spec!r}: {path} is not a file")
        out[name] = Path(path)
    if not out:
        raise ConfigError("no capture files given")
    return out


def replay(job: JobSpec, plan: WirePlan | None, pcaps: dict[str, Path], sink: Sink, *, batch_frames: int = 65536,
           progress: Progress = _no_progress, first_iteration: int = 0,
           on_lockon_failed: Callable[[LockFailure], None] | None = None,
           numbering: Numbering | None = None, on_resolved: Callable[[Resolution], None] | None = None,
           merger: MergerFactory = Merger, overlap: bool | None = None,
           piece_bytes: int | None = None) -> ReplayResult:
    """Replay ``pcaps`` (stream name → file) of ``job`` into ``sink``, numbering iterations from
    ``first_iteration`` (the trainer's iteration of the captures' first one), or as ``numbering``
    says (``gradtap/start.py``); never hangs (ends at EOF). ``plan`` None: the job's ``auto``
    fields are read from the wire first (``on_resolved`` hears what they are). ``merger``: the
    pipeline's merger (a mirror group's, ``gradtap/group.py``, with ``overlap`` off: see
    :class:`~gradtap.pipeline.Pipeline`). ``piece_bytes``: the parsers' pieces (None: their
    default; ``parser/stream.py``)."""
    if numbering is not None:
        first_iteration = numbering.start.first_iteration
    pipeline = Pipeline(job, plan, list(pcaps), sink, first_iteration, on_lockon_failed,
                        on_anchor=None if numbering is None else numbering.placed, on_resolved=on_resolved,
                        merger=merger, overlap=overlap, piece_bytes=piece_bytes)
    if numbering is not None:
        numbering.attach(pipeline)
    sources = {name: _Source(path, batch_frames) for name, path in pcaps.items()}
    # The next batches are read (the file's pages mapped in) while a round parses them.
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradtap-read")
    started = time.perf_counter()
    try:
        with start_up_frozen():
            while True:
                horizons = {n: s.horizon() for n, s in sources.items() if not s.done}
                live = {n: h for n, h in horizons.items() if h is not None}
                if not live:
                    break
                until, now = min(live.values()), -1
                quiet = quiet_from([sources[n].pending.ts_ns for n in live], until, pipeline.gap_ns)
                if quiet is not None:
                    until, now = quiet, quiet + pipeline.gap_ns
                batches = {n: sources[n].take(until) for n in live}
                ahead = reader.submit(lambda: [sources[n].fill() for n in live])
                try:
                    pipeline.round(batches, now)
                finally:
                    ahead.result()
                for n in live:
                    progress(n, sources[n].bytes, sources[n].file_bytes)
            reports = pipeline.finish()
    finally:
        reader.shutdown()
        pipeline.close()
        for s in sources.values():
            s.close()
    return ReplayResult(reports, pipeline.counters(), {n: s.frames for n, s in sources.items()},
                        {n: s.bytes for n, s in sources.items()}, pipeline.times, time.perf_counter() - started,
                        pipeline.timings(), pipeline.locked(), pipeline.update is not None,
                        len(os.sched_getaffinity(0)), pipeline.pool.fresh if pipeline.resolved else 0)


def run_replay(job: JobSpec, pcaps: dict[str, Path], out: Path, start: dict | ReplicaStart, *, digests: bool = True,
               batch_frames: int = 65536, progress: Progress = _no_progress,
               resync: Iterable[dict] = (), resync_handed_over: bool = False, force: bool = False,
               start_source: str = "the start state",
               gradients: Path | None = None,
               snapshot_buffers: int = 0, continues: Path | None = None,
               piece_bytes: int | None = None) -> tuple[ReplayResult, ReplicaSink]:
    """Replay ``pcaps`` into a replica initialised from ``start`` (a trainer checkpoint dict
    whose ``iteration`` is the capture's first iteration, or, when it has a ``time_ns``, the
    first that began after it: ``gradtap/start.py``), writing into ``out``:
    ``snapshots/``, ``iterations.jsonl`` (with a state digest per iteration when ``digests``),
    ``events.jsonl`` and ``replay.json``. ``resync``: trainer checkpoints a stale replica
    resynchronises from when the streams reach their iteration, each offered as it comes (a
    generator loads one at a time); ``resync_handed_over``: they are the replay's own, and
    give their tensors up as their offers copy them (``Replica.make_offer(consume=True)``).
    An ``out`` that cannot be written, or holds the snapshots of another replica (another job
    or start state), is refused before anything in it changes; ``force`` clears the other
    replica's snapshots.
    ``gradients``: a directory for each recovered iteration's reduced gradient
    (``gradtap/gradient_dump.py``). ``start`` may also be a :class:`ReplicaStart`
    (:func:`~gradtap.start.replica_start`, ``--start-from-store``): handed over, its checkpoint
    gives each tensor up as the replica copies it, so that the start state and the replica are
    never both held whole; a dict is left as it is.
    ``snapshot_buffers``: copies of the state for writing snapshots in the background
    (``store/snapshot_writer.py``: a snapshot due while they are all being written is skipped);
    0 writes each on the update path, so that every snapshot the schedule names exists.
    ``continues``: the path ``start`` was loaded from (``--start``), so that a start from one of
    ``out``'s own snapshots continues its replica (``Snapshots(continues=)``). ``piece_bytes``: as
    :func:`replay`'s."""
    begin = replica_start(job, start, start_source, handed_over=False)     # a dict stays the caller's
    replica = Replica(job, begin.take_checkpoint(), consume=begin.handed_over)
    origin = ReplicaOrigin.of(replica, begin.waiting)
    uploader = uploader_for(job)
    snapshots = Snapshots(out / "snapshots", job.name, every=job.appliance.snapshot_every,
                          keep=job.appliance.snapshot_keep, origin=origin, force=force, continues=continues,
                          uploader=uploader, close_timeout_s=store_close_timeout(job), buffers=snapshot_buffers)
    gradient_log = gradient_log_for(job, replica, None if begin.waiting else origin)
    for stale in ("iterations.jsonl", "events.jsonl"):
        (out / stale).unlink(missing_ok=True)
    control = ControlPlane(out / "events.jsonl", job.appliance.control_endpoint)
    if uploader is not None:
        uploader.on_event = control.event
    if gradient_log is not None:
        gradient_log.on_event = control.event
    numbering = Numbering(begin, replica, control)
    for checkpoint in resync:
        replica.hold(replica.make_offer(checkpoint, consume=resync_handed_over))
    sink = ReplicaSink(replica, control, snapshots=snapshots, report_path=out / "iterations.jsonl", digests=digests,
                       gradient_log=gradient_log, lasting_buckets=True)
    plan = job_plan(job) if job.nccl.resolved else None      # else read from the wire (parser/resolve.py)
    finished = False
    try:
        result = replay(job, plan, pcaps, sink if gradients is None else GradientDump(sink, gradients, job),
                        batch_frames=batch_frames, progress=progress,
                        numbering=numbering,
                        on_lockon_failed=lambda failure: control.event("lockon.failed", **failure.as_event()),
                        on_resolved=lambda r: control.event("job.resolved", **r.as_event()),
                        piece_bytes=piece_bytes)
        finished = replica.open_iteration is None and bool(sink.applied)
    finally:
        if gradient_log is not None:
            gradient_log.close(store_close_timeout(job))
        snapshots.close(replica if finished else None)   # a clean end writes a final snapshot
    (out / "replay.json").write_text(json.dumps({
        "job": job.name, "streams": {n: str(p) for n, p in pcaps.items()}, "wall_s": result.wall_s,
        "mirrored_gbps": result.mirrored_gbps, "cores": result.cores,
        "frames": result.frames, "bytes": result.bytes, "events": result.counters,
        "iterations": sink.lines, "stale": replica.stale, "locked": result.locked,
        "snapshots": snapshots.counts(),
        "store": None if uploader is None else uploader.counts(),
        "gradient_log": None if gradient_log is None else gradient_log.counts(),
        "timings": [t.__dict__ for t in result.timings]}, indent=1))
    return result, sink
