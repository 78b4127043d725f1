"""``gradtap simulate``: train, reduce in NCCL's ring order, and write what the mirrors see.

For every captured iteration the simulator trains the job's model as N data-parallel ranks
(:mod:`gradtap.simulator.training`), reduces each DDP bucket with the ring's own order of additions
(:mod:`gradtap.simulator.allreduce`), turns the wire plan into packets (:mod:`gradtap.simulator.traffic`),
adds the non-allreduce traffic of each port (:mod:`gradtap.simulator.background`), applies each
mirror path's faults (:mod:`gradtap.simulator.faults`) and appends the frames to one capture file
per mirror stream. The ground truth goes to ``truth/`` (:mod:`gradtap.simulator.truth`).

Captures begin at the first iteration that uses the job's bucket layout: DDP rebuilds its
buckets after iteration 0, so a job in the ``rebuilt`` layout is captured from iteration 1,
as an appliance started on a running job would see it; ``truth/start.pt`` holds the state
it starts from.
"""

from __future__ import annotations

import copy
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapngWriter, PcapWriter
from gradtap.core.errors import ConfigError
from gradtap.core.heap import retained_heap
from gradtap.workload import models
from gradtap.simulator.allreduce import chunk_index, plan_allreduce, ring_partials, ring_sum
from gradtap.simulator.background import Background
from gradtap.simulator.faults import FaultSpec, apply_mirror_faults
from gradtap.simulator.frames import ErspanTunnel, Routes, encode_frames
from gradtap.simulator.lanes import Lane, PhaseClock, wait_for
from gradtap.simulator.traffic import ConnectionState, Timing, TrafficBuilder
from gradtap.simulator.training import WIRE_NUMPY, Trainer
from gradtap.simulator.truth import TruthWriter
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.spec import JobSpec, dump_job
from gradtap.workload.tuner import tuned
from gradtap.workload.wire_plan import build_plan

EPOCH_NS = 1_767_225_600 * 10**9   # 2026-01-01T00:00:00Z: where simulated time starts
LINKTYPE_ETHERNET = 1


@dataclass
class StreamSummary:
    name: str
    path: Path
    offered: int = 0      # frames the mirror port carried, before the mirror path's faults
    frames: int = 0       # frames written to the capture
    bytes: int = 0
    roce_frames: int = 0
    faults: dict[str, int] = field(default_factory=dict)


@dataclass
class Summary:
    out: Path
    iterations: list[int]
    streams: list[StreamSummary]
    link_faults: dict[str, int]
    seconds_training: float = 0.0
    seconds_encoding: float = 0.0
    #: Per phase of the run (:data:`gradtap.simulator.lanes.PHASES`): CPU seconds (every
    #: thread), wall seconds (on whichever thread ran it) and the main thread's wall seconds
    #: (the critical path; the frames and the truth are written beside it).
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: dict[str, float] = field(default_factory=dict)
    main_wall_seconds: dict[str, float] = field(default_factory=dict)


# Payload arenas the traffic builder uses in turn, and buffers of partial sums the reduction
# uses in turn: one bucket's frames are written while the next bucket is built, and one
# bucket is built while the next is reduced.
ARENAS = 2
PARTIALS = 2


class _Stream:
    def __init__(self, job: JobSpec, index: int, out: Path, fmt: str, seed: int):
        m = job.mirrors[index]
        self.mirror = m
        # Each mirror path draws its faults from its own generator, so the traffic on the
        # links (and every other stream) is the same whatever faults this path has.
        self.rng = np.random.default_rng([seed, 1 + index])
        path = out / "streams" / f"{m.name}.{fmt}"
        self.writer = PcapWriter(path, nanosecond=True) if fmt == "pcap" else PcapngWriter(path)
        self.summary = StreamSummary(m.name, path)
        self.scratch = np.zeros(0, np.uint8)     # frames are encoded into it, batch after batch
        self.lane: Lane | None = None
        # A stream over L3 is the switch's ERSPAN session; its id is the mirror's position + 1.
        self.tunnel = None if m.encapsulation == "none" else ErspanTunnel(m.encapsulation, session=index + 1)

    def select(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        p = self.mirror.rank
        mask = {"egress": src == p, "ingress": dst == p, "both": (src == p) | (dst == p)}[self.mirror.direction]
        return np.flatnonzero(mask)


class Simulation:
    """Simulate ``iterations`` captured iterations of ``job`` into ``out``.

    ``fmt`` is ``"pcap"`` (classic, nanosecond timestamps) or ``"pcapng"``.
    """

    def __init__(self, job: JobSpec, out: Path, *, iterations: int, seed: int, faults: FaultSpec,
                 timing: Timing = Timing(), fmt: str = "pcap"):
        if iterations < 1:
            raise ConfigError(f"--iterations: {iterations} must be at least 1")
        if fmt not in ("pcap", "pcapng"):
            raise ConfigError(f"--format: {fmt!r} is not 'pcap' or 'pcapng'")
        self.job, self.out, self.iterations, self.seed = job, Path(out), iterations, seed
        self.faults, self.timing, self.fmt = faults, timing, fmt

    def run(self, progress: Callable[[str, int, int], None] = lambda *_: None) -> Summary:
        # The ranks' backward passes free and allocate the same large blocks again and again.
        with retained_heap():
            return self._run(progress)

    def _run(self, progress: Callable[[str, int, int], None]) -> Summary:
        job = self.job
        if job.model.factory is None:
            raise ConfigError("model.factory: the simulator trains a real model, so the job must name a "
                              "torch.nn.Module factory rather than a parameter list")
        _require_era(job)
        streams_dir = self.out / "streams"
        if streams_dir.exists():
            shutil.rmtree(streams_dir)
        streams_dir.mkdir(parents=True)
        (self.out / "job.yaml").write_text(dump_job(job))
        rng = np.random.default_rng(self.seed)
        params = job_params(job)
        buckets = job_buckets(job)
        first = 1 if job.ddp.layout == "rebuilt" else 0
        # nccl.protocol 'auto': each bucket's protocol as NCCL's tuner picks it (workload/tuner.py)
        wire_job = tuned(job, [b.numel for b in buckets])
        plan = build_plan(wire_job, [b.numel for b in buckets])
        chunk_of = [chunk_index(plan, b) for b in range(len(buckets))]
        one_call = job.model_copy(update={"nccl": job.nccl.model_copy(update={"protocols": None})})
        n = job.world_size

        routes = Routes(job.ipv6)
        streams = [_Stream(job, i, self.out, self.fmt, self.seed) for i in range(len(job.mirrors))]
        egress = {s.mirror.rank for s in streams if s.mirror.direction != "ingress"}
        ingress = {s.mirror.rank for s in streams if s.mirror.direction != "egress"}
        builder = TrafficBuilder(wire_job, plan, routes, self.timing, self.faults.link(), rng, egress, ingress,
                                 arenas=ARENAS)
        background = Background(job, routes, {s.mirror.rank for s in streams}, rng)
        state = ConnectionState.initial(plan, rng)
        link_faults: dict[str, int] = {}
        captured_buckets = {b: i for i, b in enumerate(buckets)}
        clock = {"t": EPOCH_NS, "capturing": False, "buckets": 0}
        phases = PhaseClock()
        for s in streams:
            s.lane = Lane(s.mirror.name, phases, "frames")
        truth_lane = Lane("truth", phases, "truth")
        traffic_lane = Lane("traffic", phases, "traffic")
        lanes = [traffic_lane] + [s.lane for s in streams] + [truth_lane]
        # The stream writes of the latest builds, oldest first: a build reuses the arena of the
        # build ARENAS before it, so those writes must have finished.
        in_flight: deque[list] = deque()
        # The builds of the latest buckets, oldest first: a bucket's partial sums go into the
        # buffer of the bucket PARTIALS before it, so that build must have finished.
        builds: deque = deque()

        scratch: dict[tuple, np.ndarray] = {}

        def partials_buffer(dtype, count, slot):
            """``[n, count]`` rows for one bucket's partial sums, in one of PARTIALS buffers
            used in turn (each grown to the largest), so their pages fault in once per run,
            not per bucket. A bucket's rows are dead once it is built (the payloads are copied
            into the traffic's arena) and its reduced row copied out."""
            buf = scratch.get((dtype, slot))
            if buf is None or buf.shape[1] < count:
                buf = scratch[(dtype, slot)] = np.empty((n, count), dtype)
            return buf[:, :count]

        def write(packets, src, dst, arena, raw):
            """Hand a batch to every stream's lane; returns their futures."""
            return [s.lane.submit(self._write_stream, s, packets, src, dst, arena, raw, routes) for s in streams]

        def build(i, rows):
            """On the traffic lane, one bucket after another: its packets, handed to the streams."""
            while len(in_flight) >= ARENAS:
                for f in in_flight.popleft():
                    f.result()
            traffic = builder.build(i, rows, state, clock["t"])
            for key, v in traffic.injected.items():
                link_faults[key] = link_faults.get(key, 0) + v
            in_flight.append(write(traffic.packets, traffic.src, traffic.dst, traffic.arena, []))
            clock["t"] = traffic.end_ns + self.timing.step_latency_ns

        def allreduce(per_rank, bucket):
            """Reduce one bucket in ring order and, while capturing, put it on the wire."""
            i = captured_buckets.get(bucket)
            # A bucket of the initial layout (iteration 0 of a rebuilt job, before capture
            # begins) is its own NCCL call with its own chunking, in the job's protocol (with
            # 'auto', the tuner's for its size).
            chunks = (chunk_of[i] if i is not None else
                      chunk_index(build_plan(tuned(one_call, [bucket.numel]), [bucket.numel]), 0))
            if not clock["capturing"]:
                # Nothing goes on the wire: the reduced values alone, one row written, not n.
                with phases("reduction"):
                    return ring_sum(per_rank, chunks)
            while len(builds) >= PARTIALS:
                wait_for(phases, [builds.popleft()])
            slot = clock["buckets"] % PARTIALS
            clock["buckets"] += 1
            with phases("reduction"):
                rows = ring_partials(per_rank, chunks, out=partials_buffer(per_rank[0].dtype, len(chunks), slot))
            builds.append(traffic_lane.submit(build, i, rows))
            reduced = rows[n - 1].copy()
            truth_lane.submit(truth.add_gradient, reduced)
            return reduced

        init = job.initial_state
        checkpoint = torch.load(init.checkpoint, weights_only=True) if init.checkpoint is not None else None
        trainer = build_trainer(job, job_buckets(job, "initial") if first else buckets, allreduce, self.seed,
                                checkpoint)
        model = trainer.model
        truth = TruthWriter(self.out / "truth", job, self.seed)
        grad_dtype = WIRE_NUMPY[job.ddp.grad_dtype]
        total_numel = sum(b.numel for b in buckets)
        captured = []
        started, started_cpu = time.perf_counter(), time.process_time()
        try:
            while trainer.iteration < first:     # a start checkpoint may be past it already
                progress("training iteration 0 (initial bucket layout, before capture)", 0, self.iterations)
                trainer.step()
            truth.layout(params, buckets, job.ddp.grad_dtype, trainer.iteration)
            # When the trainer's state was start.pt: the moment the capture begins (the appliance
            # numbers the captured iterations by it, gradtap/start.py). It is written while the
            # next iteration trains, and the truth lane is waited for before each optimizer step.
            truth_lane.submit(truth.start, {**trainer.state_dict(), "time_ns": clock["t"]})
            # The job as captured: its streams start from truth/start.pt, which the job names
            # (relative to job.yaml), so that a replay of it needs no --start.
            start = job.initial_state.model_copy(update={"seed": None, "checkpoint": Path("truth") / "start.pt"})
            (self.out / "job.yaml").write_text(dump_job(job.model_copy(update={"initial_state": start})))
            clock["capturing"] = True
            for k in range(self.iterations):
                it = trainer.iteration
                progress(f"iteration {it}: training {n} ranks and encoding {len(buckets)} buckets",
                         k, self.iterations)
                t0 = clock["t"]
                with phases("traffic"):
                    bg, bg_src, bg_dst = background.packets(t0, job.nccl.mtu, 0)
                    raw = background.raw_frames(t0)
                write(bg, bg_src, bg_dst, background.arena, raw)     # its arena is never reused
                clock["t"] = t0 + self.timing.compute_gap_ns
                truth_lane.submit(truth.begin_iteration, it, total_numel, grad_dtype)
                trainer.step(buckets, before_update=truth_lane.wait)
                traffic_lane.wait()              # clock["t"], the connection state and rng are its
                truth_lane.submit(truth.end_iteration, it, model, trainer.optimizer,
                                  (t0, clock["t"] + self.timing.step_latency_ns))
                captured.append(it)
                state.advance(plan)
            for lane in lanes:
                lane.wait()
            progress("done", self.iterations, self.iterations)
        finally:
            for lane in lanes:
                lane.close()
            for s in streams:
                s.writer.close()
            truth.close()
        total, total_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        phases.cpu["training"] = total_cpu - sum(phases.cpu.values())
        phases.wall["training"] = phases.main_wall["training"] = total - sum(phases.main_wall.values())
        encoding = phases.main_wall["traffic"] + phases.main_wall["waiting"]
        return Summary(self.out, captured, [s.summary for s in streams], link_faults,
                       total - encoding, encoding, phases.cpu, phases.wall, phases.main_wall)

    def _write_stream(self, s: _Stream, packets, src, dst, arena, raw, routes) -> None:
        """Append to stream ``s`` the frames it captures: those of ``packets`` (time-ordered
        descriptors with their sender and receiver positions) and of ``raw`` non-RoCE frames
        ``(ts_ns, src, dst, bytes)``; then apply its mirror faults. Runs on the stream's lane."""
        sel = s.select(src, dst)
        data, offsets, lengths = encode_frames(packets[sel], routes, arena, s.scratch)
        if data.base is not s.scratch and len(data) > len(s.scratch):
            s.scratch = data      # the next batches encode into it (written before reuse)
        ts = packets["ts_ns"][sel]
        extra = [f for f in raw if (f[1] == s.mirror.rank and s.mirror.direction != "ingress")
                 or (f[2] == s.mirror.rank and s.mirror.direction != "egress")]
        if extra:
            blob = np.frombuffer(b"".join(f[3] for f in extra), np.uint8)
            offsets = np.concatenate([offsets, len(data) + np.cumsum([0] + [len(f[3]) for f in extra[:-1]])])
            lengths = np.concatenate([lengths, [len(f[3]) for f in extra]]).astype(np.int32)
            ts = np.concatenate([ts, [f[0] for f in extra]])
            data = np.concatenate([data, blob])
        order = np.argsort(ts, kind="stable")
        if s.tunnel is not None:
            data, offsets, lengths = s.tunnel.encapsulate(data, offsets, lengths, ts, order)
        outcome = apply_mirror_faults(lengths[order], self.faults.for_stream(s.mirror.name), s.rng)
        pick = order[outcome.index]
        batch = FrameBatch(data=data, offsets=offsets[pick], caplens=outcome.caplen,
                           wirelens=lengths[pick], ts_ns=np.maximum.accumulate(ts[pick]),
                           linktype=LINKTYPE_ETHERNET)
        s.writer.write_batch(batch)
        s.summary.offered += len(lengths)
        s.summary.frames += len(pick)
        s.summary.bytes += int(outcome.caplen.sum())
        s.summary.roce_frames += int((pick < len(sel)).sum())
        for key, v in outcome.counts.items():
            s.summary.faults[key] = s.summary.faults.get(key, 0) + v


def build_trainer(job: JobSpec, buckets, allreduce, seed: int, checkpoint: dict | None = None) -> Trainer:
    """The job's N-rank trainer: the model of the job's seed (or ``checkpoint``, a
    ``{"model", "optimizer", "iteration"}`` dict such as a gradtap snapshot), its data shards
    under ``seed``, and its optimizer."""
    model = models.build(job.model.factory, job.model.kwargs, seed=job.initial_state.seed or 0)
    data = model.synthetic_data(batch_size=job.training.batch_size, seed=seed, **job.training.data_kwargs)
    trainer = Trainer(model, job_params(job), buckets, world_size=job.world_size, optimizer=job.optimizer,
                      wire_dtype=job.ddp.grad_dtype, predivide=job.ddp.predivide, data=data, allreduce=allreduce,
                      start_iteration=int(checkpoint.get("iteration", 0)) if checkpoint else 0)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        # A copy: Optimizer.load_state_dict keeps the given moment tensors (same dtype and
        # device) and steps them in place, which would change the caller's checkpoint.
        trainer.optimizer.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    return trainer


def resume(job: JobSpec, checkpoint: dict, seed: int, until: int) -> Trainer:
    """A trainer resumed from ``checkpoint`` and trained to iteration ``until`` (exclusive)
    on the same data shards, with NCCL's ring arithmetic: what a real job does after
    loading a gradtap snapshot."""
    _require_era(job)
    buckets = job_buckets(job)
    numels = [b.numel for b in buckets]
    trainer = build_trainer(job, buckets, plan_allreduce(build_plan(tuned(job, numels), numels)), seed,
                            checkpoint)
    while trainer.iteration < until:
        trainer.step()
    return trainer


def _require_era(job: JobSpec) -> None:
    """The simulator writes one NCCL release's wire: it cannot simulate ``nccl.era: auto``."""
    if job.nccl.era == "auto":
        raise ConfigError("nccl.era is 'auto': the simulator writes the wire of one NCCL release and cannot "
                          "learn it from a wire it has not written yet; give nccl.era, the major.minor of the "
                          "NCCL to simulate (e.g. '2.21')")
