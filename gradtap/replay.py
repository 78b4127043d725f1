"""Offline replay: capture files → parse → merge → update, the appliance's pipeline over pcaps.

Each stream's file is read in bounded batches (``gradtap.capture.pcap.PcapReader``), without copying
the frames out of the file's mapping. All streams advance together in time: every round
takes from each stream the frames up to a common horizon (the earliest end of the streams'
buffered batches), so no stream runs ahead of the others by more than one batch of the
slowest; this matters because the merger's deadline looks at how far each stream has got.
The streams of a round are parsed in parallel threads (the Numba kernels release the GIL);
the merger and the updater then run on the main thread while the parsers wait, so nothing
reads a slot a parser is writing.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.core.errors import ConfigError
from gradtap.merger.merger import IterationReport, Merger, Sink
from gradtap.wire import events as ev
from gradtap.parser.stream import StreamParser
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

    def horizon(self) -> int | None:
        """Time of the last buffered frame (None at end of file). What is left of a batch is
        topped up with the next one when it is under half a batch: the streams' batches end
        at slightly different times, and those remainders would otherwise make rounds of a
        few frames each."""
        left = 0 if self.pending is None else len(self.pending.offsets)
        if 2 * left < self._read or left == 0:
            more = next(self.batches, None)
            if more is not None:
                self._read = len(more.offsets)
                self.pending = more if left == 0 else _join(self.pending, more)
        if self.pending is None or len(self.pending.offsets) == 0:
            self.done = True
            return None
        return int(self.pending.ts_ns[-1])

    def take(self, until: int) -> FrameBatch | None:
        b = self.pending
        if b is None:
            return None
        cut = int(np.searchsorted(b.ts_ns, until, side="right"))
        head = _slice(b, 0, cut)
        self.pending = _slice(b, cut, len(b.offsets)) if cut < len(b.offsets) else None
        self.frames += cut
        self.bytes += int(head.caplens.sum())
        return head

    def close(self) -> None:
        self.reader.close()


def _slice(b: FrameBatch, lo: int, hi: int) -> FrameBatch:
    return FrameBatch(data=b.data, offsets=b.offsets[lo:hi], caplens=b.caplens[lo:hi], wirelens=b.wirelens[lo:hi],
                      ts_ns=b.ts_ns[lo:hi], linktype=b.linktype)


def _join(a: FrameBatch, b: FrameBatch) -> FrameBatch:
    """``a``'s frames then ``b``'s; batches of one file mapping share their data, so only the
    frame arrays are joined."""
    if a.data is not b.data:
        return FrameBatch.concat([a, b], a.linktype)
    return FrameBatch(a.data, *(np.concatenate([getattr(a, k), getattr(b, k)])
                                for k in ("offsets", "caplens", "wirelens", "ts_ns")), a.linktype)


@dataclass
class StageTimes:
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

    iteration: int
    parse_s: float
    merge_s: float
    update_s: float
    lag_s: float


@dataclass
class ReplayResult:
    reports: list[IterationReport]
    counters: dict[str, dict[str, int]]        # stream -> decode event -> count
    frames: dict[str, int]
    bytes: dict[str, int]
    times: StageTimes
    wall_s: float
    timings: list[IterationTiming]


Progress = Callable[[str, int, int], None]     # (stream, bytes read, file bytes)


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


class Pipeline:
    """Every stream's parser, the merger and the sink, advanced one round at a time.

    A round parses each stream's new frames in parallel threads (the Numba kernels release
    the GIL), then updates the merger with what each stream retired and holds in flight,
    and lets it hand off what is complete; the sink (the updater) runs on the caller's
    thread while the parsers wait, so nothing reads a slot a parser is writing. Offline
    replay and the live appliance drive the same rounds.
    """

    def __init__(self, job: JobSpec, plan: WirePlan, streams: list[str], sink: Sink):
        gap = job.appliance.iteration_gap_ns
        self.parsers = {name: StreamParser(job, plan, name, gap_ns=gap) for name in streams}
        self.times = StageTimes(parse_s={name: 0.0 for name in streams})
        self._sink = _TimedSink(sink, self.times)
        self.merger = Merger(plan, list(streams), self._sink)
        self.last_fed: dict[int, float] = {}        # iteration -> start of the last round carrying its frames
        self._placed: dict[str, dict[int, int]] = {name: {} for name in streams}   # StreamParser.placed()
        self._retired: dict[int, list[tuple[str, np.ndarray]]] = {}   # iteration -> gradients the merger holds
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(streams)), thread_name_prefix="gradtap-parse")

    def round(self, batches: dict[str, FrameBatch]) -> None:
        started = time.perf_counter()
        work = [(n, b) for n, b in batches.items() if b is not None and len(b.offsets)]
        results = list(self._pool.map(lambda nb: self._parse(*nb), work))
        t = time.perf_counter()
        for name, retired in results:
            parser = self.parsers[name]
            placed = parser.placed()
            for i, n in placed.items():
                if n != self._placed[name].get(i):
                    self.last_fed[i] = started
            self._placed[name] = placed
            for a in retired:
                self._retired.setdefault(a.index, []).append((name, a.grad))
            self.merger.update(name, retired, parser.in_progress())
        self.merger.advance()
        self._recycle()
        self.times.merge_s += time.perf_counter() - t - self._sink.pop_update_time()

    def finish(self) -> list[IterationReport]:
        """End of input: every stream hands back what it holds, every pending iteration is due."""
        t = time.perf_counter()
        for name, p in self.parsers.items():
            self.merger.update(name, p.flush(), [])
        reports = self.merger.close()
        self.times.merge_s += time.perf_counter() - t - self._sink.pop_update_time()
        return reports

    def _recycle(self) -> None:
        """Hand the gradient arrays of iterations the merger has finished (or never took) back
        to their parsers: the merger dropped its copies and the sink got merged buckets of its
        own, so nothing refers to them any more."""
        for g in [g for g in self._retired if g < self.merger.next]:
            for name, grad in self._retired.pop(g):
                self.parsers[name].recycle(grad)

    def counters(self) -> dict[str, dict[str, int]]:
        return {n: ev.as_dict(p.counters) for n, p in self.parsers.items()}

    def timings(self) -> list[IterationTiming]:
        return self._sink.timings(self.last_fed)

    def close(self) -> None:
        self._pool.shutdown()

    def _parse(self, name: str, batch: FrameBatch):
        t = time.perf_counter()
        retired = self.parsers[name].feed(batch)
        self.times.parse_s[name] += time.perf_counter() - t
        return name, retired


def replay(job: JobSpec, plan: WirePlan, pcaps: dict[str, Path], sink: Sink, *, batch_frames: int = 65536,
           progress: Progress = lambda *_: None) -> ReplayResult:
    """Replay ``pcaps`` (stream name → file) of ``job`` into ``sink``; never hangs (ends at EOF)."""
    pipeline = Pipeline(job, plan, list(pcaps), sink)
    sources = {name: _Source(path, batch_frames) for name, path in pcaps.items()}
    started = time.perf_counter()
    try:
        while True:
            horizons = {n: s.horizon() for n, s in sources.items() if not s.done}
            live = {n: h for n, h in horizons.items() if h is not None}
            if not live:
                break
            until = min(live.values())
            pipeline.round({n: sources[n].take(until) for n in live})
            for n in live:
                progress(n, sources[n].bytes, sources[n].file_bytes)
        reports = pipeline.finish()
    finally:
        pipeline.close()
        for s in sources.values():
            s.close()
    return ReplayResult(reports, pipeline.counters(), {n: s.frames for n, s in sources.items()},
                        {n: s.bytes for n, s in sources.items()}, pipeline.times, time.perf_counter() - started,
                        pipeline.timings())


class _TimedSink:
    """Measures the time the sink (the updater) takes, so merge time excludes it."""

    def __init__(self, sink: Sink, times: StageTimes):
        self.sink, self.times, self._pending = sink, times, 0.0
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
        self._pending += seconds

    def pop_update_time(self) -> float:
        spent, self._pending = self._pending, 0.0
        return spent
