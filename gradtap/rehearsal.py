"""The live pipeline rehearsed on a miniature of the job, before the capture starts.

Numba compiles a kernel the first time it runs with a given set of argument types, and keeps
it on disk (``core/jit.py``) until gradtap's source changes. In a fresh install, or after an
upgrade, ``gradtap run`` would compile at the first live frames: one stream of GPT-2 small
took 10.7 s to lock on with no kernel cached, against 0.011 s with them. All that while the
capture workers fill their rings, which hold well under a second of traffic, and then drop
frames; the first iterations after the replica's start are lost and the replica is stale.

So before the workers listen, the appliance runs the whole chain once on a miniature of the
job (:func:`miniature`): the same ring, mirror streams, NCCL era and protocol (``auto``
stays ``auto`` and is read from the wire, as live), DDP layout, gradient dtype and
optimizer, with an MLP of :data:`MINI_SIZES` for the model. The simulator writes two
iterations of its traffic (``gradtap.simulator``) with the training-link faults of
:data:`FAULTS` (retransmitted, so no stream loses data and the replica must be exact), the
offline replay runs them through the same pipeline (``gradtap.replay.run_replay``), and the
replica is checked against the simulator's truth, bit for bit (``gradtap.verify``). Capture
files are mapped read-only and a ring lends its frames read-only too (``capture/ring.py``), so
the parser's kernels compiled here are the very ones the live frames run; the merger's and
the updater's take the same arrays either way. The miniature's batches are parsed in pieces of
:data:`PIECE_BYTES` wherever the live job's would be (``parser/pieces.py``: with the ICRC
checked in stage 1, a batch larger than half the L2 cache per thread; live batches are, the
miniature's are not). A few frames also pass through a frame ring, as a capture worker and
the appliance pass them, and the merger votes once on three copies of a bucket, one of them
wrong (:func:`_vote`): a clean miniature never reaches the vote, which live streams reach
whenever their copies diverge. Likewise a stream keeps a unit aside, and the merger lays it
over the shared gradient, once (:func:`_kept_aside`): a live stream does so when its copy of
a unit differs, or arrives before the stream that claimed the unit has written it, and
whether the miniature's streams race so depends on their threads' timing.

It is also a self-check of this host and job: a rehearsal that is not exact raises, and
``gradtap run`` stops before it listens, saying what differs. It takes 1.1 s in a fresh
process with the kernels cached, and 17 s with none cached (both on a 2-core AMD EPYC; with
none cached, 31 s on a 2-core Xeon of family 6 model 207 for a job of 3 streams or of one,
28 s before the piece and kept-aside kernels were rehearsed).
The socket sources' own kernels (``capture/af_packet.py``, ``af_xdp.py``) compile in their
worker processes, which call them once before they report ready (``capture/worker.py``).
What is left to compile when first needed: the updater's kernels for a model whose
parameters are not fp32.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gradtap.core.errors import GradtapError
from gradtap.workload.spec import SUPPORTED_ERAS, ApplianceSpec, JobSpec, parse_job

MINI_SIZES = [32, 64, 10]        # the miniature's MLP: 2,762 parameters
MINI_BUCKET_MB = 0.004          # about 1,000 parameters per DDP bucket: several buckets
MINI_ITERATIONS = 2
# Faults the NIC repairs (go-back-N retransmission after a loss or a bad ICRC), and mirror
# duplicates and reordering: every stream still carries every byte.
FAULTS = "link_loss=0.01,corrupt=0.01,reorder=0.02,duplicate=0.02"
RING_FRAMES = 32
PIECE_BYTES = 16384             # a few frames: the miniature's batches are cut as the live job's are
ROUND_FRAMES = 64               # per stream and round: the miniature's iterations span several


@dataclass
class Rehearsal:
    iterations: int             # iterations the replica applied, all equal to the truth
    seconds: float


class RehearsalFailed(GradtapError):
    """The pipeline was not exact on the job's miniature: the live run would not be either."""


def miniature(job: JobSpec, *, simulated: bool = False) -> JobSpec:
    """``job`` with a model of a few thousand parameters and nothing that reaches outside the
    process (no store tier, control endpoint, mirror group or resync directories).
    ``simulated``: the job the simulator writes, whose ``nccl.era`` cannot be ``auto``; it
    takes the newest release the job's other settings allow."""
    a = job.appliance
    doc = job.model_dump(mode="json", exclude_none=True)
    doc.update(
        name=f"{job.name}-rehearsal",
        model={"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": MINI_SIZES}},
        initial_state={"seed": 0},
        ddp={**doc["ddp"], "bucket_cap_mb": MINI_BUCKET_MB},
        training={"batch_size": 2},
        appliance=ApplianceSpec(verify_icrc=a.verify_icrc, iteration_gap_ns=a.iteration_gap_ns,
                                snapshot_buffers=0).model_dump(mode="json", exclude_none=True))
    if not (simulated and job.nccl.era == "auto"):
        return parse_job(doc, f"the rehearsal of job {job.name!r}")
    refused = []
    for era in reversed(SUPPORTED_ERAS):
        try:
            return parse_job({**doc, "nccl": {**doc["nccl"], "era": era}}, f"the rehearsal of job {job.name!r}")
        except GradtapError as exc:
            refused.append(f"{era}: {exc}")
    raise RehearsalFailed(f"job {job.name!r}: no NCCL release fits its other settings to simulate its "
                          f"rehearsal ({'; '.join(refused)})")


def rehearse(job: JobSpec, batch_frames: int, slot_size: int, *, digests: bool = False) -> Rehearsal:
    """Run the pipeline on :func:`miniature` of ``job`` and check it; :class:`RehearsalFailed`
    says what differs. It reads at most ``batch_frames`` per stream and round, as the live run
    reads its rings of ``slot_size``-byte slots, and at most :data:`ROUND_FRAMES`, so that the
    streams lock on in an early round and parse the later ones as locked streams do; with
    ``digests``, it makes a state digest per iteration, as the live run does."""
    import torch

    from gradtap.replay import run_replay
    from gradtap.simulator.faults import parse_faults
    from gradtap.simulator.run import Simulation
    from gradtap.simulator.traffic import Timing
    from gradtap.verify import verify
    from gradtap.workload.layout import job_params

    started = time.perf_counter()
    mini, written = miniature(job), miniature(job, simulated=True)
    with tempfile.TemporaryDirectory(prefix="gradtap-rehearsal-") as tmp:
        out = Path(tmp)
        # Iterations apart by twice the job's iteration gap, so that the parsers find them.
        pause = Timing(compute_gap_ns=max(Timing().compute_gap_ns, 2 * job.appliance.iteration_gap_ns))
        sim = Simulation(written, out / "sim", iterations=MINI_ITERATIONS, seed=0, timing=pause,
                         faults=parse_faults(FAULTS, tuple(m.name for m in written.mirrors))).run()
        _through_a_ring(sim.streams[0].path, slot_size)
        truth = out / "sim" / "truth"
        start = torch.load(truth / "start.pt", weights_only=True)
        result, sink = run_replay(mini, {s.name: s.path for s in sim.streams}, out / "replay", start,
                                  digests=digests, batch_frames=min(batch_frames, ROUND_FRAMES),
                                  piece_bytes=PIECE_BYTES)
        if len(sink.applied) != MINI_ITERATIONS:
            locked = ", ".join(f"{n} {'locked on' if ok else 'never locked on'}" for n, ok in result.locked.items())
            raise _failed(job, f"{len(sink.applied)} of {MINI_ITERATIONS} iterations applied; {locked}")
        check = verify(out / "replay", truth, job_params(mini))
    if not check.ok:
        raise _failed(job, "; ".join(str(d) for d in check.differences[:3]) or "nothing to check")
    if not _vote():
        raise _failed(job, "the merger's vote on three copies of a bucket did not take the majority's")
    if not _kept_aside():
        raise _failed(job, "a unit a stream kept aside was not laid over the shared gradient")
    return Rehearsal(len(sink.applied), time.perf_counter() - started)


def _failed(job: JobSpec, what: str) -> RehearsalFailed:
    return RehearsalFailed(f"job {job.name!r}: the pipeline rehearsed on a miniature of the job is not exact on "
                           f"this host ({what}); the capture was not started. Rerun with --no-rehearsal to run "
                           f"anyway, and report this with the job spec")


def _through_a_ring(path: Path, slot_size: int) -> None:
    """A few frames of ``path`` through a frame ring: pushed as a capture worker pushes them,
    read, copied (as lock-on keeps them) and released as the appliance does."""
    from gradtap.capture.pcap import read_pcap
    from gradtap.capture.ring import FrameRing

    frames = read_pcap(path)
    with FrameRing.create(2 * RING_FRAMES, slot_size, hugepages="off", name="gradtap-rehearsal") as ring:
        ring.push(frames.frames(0, RING_FRAMES))
        ring.read(RING_FRAMES, timeout=0).owned()
        ring.release()


def _vote() -> bool:
    """The merger's vote on three streams' copies of a two-block bucket, the first stream's
    wrong by a bit in its second block (``merger/union.py``): whether the majority's bytes
    win and the wrong stream is named."""
    import numpy as np

    from gradtap.merger.union import BucketBlocks, union

    right = np.arange(64, dtype=np.uint8)
    wrong = right.copy()
    wrong[40] ^= 1
    blocks = BucketBlocks(np.arange(2, dtype=np.int64), np.array([0, 32], np.int64), np.full(2, 32, np.int64))
    merged = union(blocks, [(name, copy, np.ones(2, bool)) for name, copy in
                            (("a", wrong), ("b", right), ("c", right.copy()))], len(right))
    groups = [m.groups for m in merged.mismatches]
    return bool(merged.covered.all()) and np.array_equal(merged.data, right) and groups == [(("b", "c"), ("a",))]


def _kept_aside() -> bool:
    """A stream's copy of one unit, other than the shared gradient's, kept aside
    (``parser/aside.py``), taken with its iteration and laid over the shared bytes as the merger
    reads the stream's copy of a bucket: whether the copy shows the unit's bytes and bit, the
    shared gradient is untouched, and the area is empty again."""
    import numpy as np

    from gradtap.parser.aside import aside_put, kept, new_aside
    from gradtap.wire.protocol import Protocol

    shared, unit, got = np.zeros(64, np.uint8), np.arange(1, 17, dtype=np.uint8), np.zeros(4, np.int32)
    aside = new_aside(len(unit), capacity=2)
    aside_put(aside, 0, 1, 1, 0, 0, int(Protocol.SIMPLE), 0, 16, len(unit), unit, 0, len(unit))
    copies, blocks = kept(aside, 0, free=True), np.arange(4, dtype=np.int64)
    view, got = copies.overlay(shared, 0, len(shared), blocks), copies.units(got, 0, len(shared), blocks)
    return (aside.used[0] == 0 and np.array_equal(view[16:32], unit) and not view[:16].any()
            and not view[32:].any() and got.tolist() == [0, 1, 0, 0] and not shared.any())
