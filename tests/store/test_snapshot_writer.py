"""Snapshots written in the background (store/snapshot_writer.py): byte for byte what the
synchronous writer writes and PyTorch's Adam holds, the replica never waiting for the disk
(a snapshot due with no free buffer is skipped and counted), every snapshot written handed to
the store tier in order, a shutdown that waits for the writer, disk failures as events, and a
writer SIGKILLed mid-write leaving the previous snapshot whole.

The disk is made "slow" by holding ``Snapshots.write_lock`` from the test: the real writer
thread takes the snapshot from its queue and then waits on that lock, exactly as it would
wait on a disk that has not finished the previous write."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError, GradtapError
from gradtap.merger.merger import IterationReport
from gradtap.replica_sink import ReplicaSink
from gradtap.store import snapshot
from gradtap.store.snapshot_writer import SnapshotWriter
from gradtap.updater.replica import Replica
from tests.forked import Child
from tests.updater.naive_adam import TorchStep, random_reduced
from tests.updater.test_replica import assert_equal_state, job

pytestmark = pytest.mark.timeout(120)

TINY_GPT = ("gradtap.workload.models:gpt2", {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 37,
                                             "block_size": 8})        # a tied weight and a buffer


class Uploader:
    """What the store tier is handed, in order."""

    def __init__(self):
        self.submitted: list[int] = []

    def submit(self, iteration: int, staged: Path) -> None:
        self.submitted.append(iteration)
        for f in staged.iterdir():
            f.unlink()
        staged.rmdir()

    def close(self, timeout: float) -> None:
        del timeout


class Driven:
    """A replica fed random reduced gradients, PyTorch's Adam fed the same."""

    def __init__(self, j, seed: int = 3):
        self.job, self.replica, self.reference = j, Replica.from_job(j), TorchStep(j)
        self.rng = np.random.default_rng(seed)

    def step(self) -> Replica:
        reduced = random_reduced(self.job, self.rng)
        self.reference.step(self.replica.iteration, reduced)
        self.replica.apply(self.replica.iteration, np.concatenate(reduced))
        return self.replica


def held(lock: threading.Lock, writer: SnapshotWriter, queued: int) -> None:
    """Wait until the writer thread has taken a snapshot and waits on ``lock`` (held by the
    test) with ``queued`` more behind it."""
    deadline = time.monotonic() + 30
    while not (writer._writing is not None and len(writer._queue) == queued):
        assert time.monotonic() < deadline, "the writer never picked up the snapshot"
        time.sleep(0.001)


def assert_state(replica: Replica, arrays: dict[str, np.ndarray]) -> None:
    """``replica``'s state is ``arrays`` (``TorchStep.arrays()``) bit for bit."""
    sd = replica.state_dict()
    names = [p.name for p in replica.layout.params]
    for key, value in arrays.items():
        kind, name = key.split("/", 1)
        got = sd["model"][name] if kind == "param" else sd["optimizer"]["state"][names.index(name)][kind]
        assert np.array_equal(got.numpy().view(np.uint32).ravel(), value.view(np.uint32).ravel()), key


@pytest.mark.parametrize("factory", [("gradtap.workload.models:mlp", {"sizes": [33, 129, 65, 17, 5]}), TINY_GPT])
def test_background_snapshots_are_the_synchronous_ones_byte_for_byte(tmp_path, factory):
    """Each snapshot the background writer writes has the files (sha256) the synchronous
    writer writes of the same state, and loads into the state PyTorch's Adam held after those
    iterations, although the replica stepped on while they waited to be written."""
    j = job(kind="adamw", weight_decay=0.1, factory=factory)
    run = Driven(j)
    sync = snapshot.Snapshots(tmp_path / "sync", j.name, keep=10)
    background = snapshot.Snapshots(tmp_path / "bg", j.name, keep=10, buffers=2)
    writer = SnapshotWriter(background, run.replica)
    truth = {}
    with background.write_lock:                 # the disk is busy: both buffers wait
        for _ in range(2):
            replica = run.step()
            sync.write_replica(replica)
            truth[replica.iteration] = run.reference.arrays()
            assert writer.take(replica) == tmp_path / "bg" / snapshot.snapshot_name(replica.iteration)
        held(background.write_lock, writer, queued=1)
        for _ in range(3):
            run.step()                          # the replica goes on meanwhile
    assert writer.wait_idle(60)
    for iteration, arrays in truth.items():
        name = snapshot.snapshot_name(iteration)
        written = snapshot.verify(tmp_path / "bg" / name)
        assert written["sha256"] == snapshot.verify(tmp_path / "sync" / name)["sha256"]
        assert written["step"] == iteration
        assert_state(Replica(j, snapshot.load(tmp_path / "bg" / name)), arrays)
    assert snapshot.latest(tmp_path / "bg").name == snapshot.snapshot_name(2)
    if factory is TINY_GPT:
        sd = torch.load(tmp_path / "bg" / snapshot.snapshot_name(2) / "model.pt", weights_only=True)
        assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()   # still tied
    assert background.counts() == {"written": 2, "failed": 0, "skipped": 0, "last_written": 2}
    background.close()
    sync.close()


def test_a_busy_disk_skips_snapshots_and_counts_them(tmp_path):
    """Through the sink, a snapshot every iteration with one buffer: while the writer is held,
    the due snapshots are skipped (the report line says so, ``snapshot.skipped`` once, the
    counter) and the replica steps on, bit for bit; the next one taken is
    ``snapshot.caught_up`` naming the skipped; the store tier is handed every snapshot written,
    in order; the shutdown writes the final one after the writer has finished."""
    j = job()
    run = Driven(j)
    uploader = Uploader()
    snaps = snapshot.Snapshots(tmp_path / "out" / "snapshots", j.name, every=1, keep=3, uploader=uploader,
                               buffers=1)
    sink = ReplicaSink(run.replica, ControlPlane(tmp_path / "out" / "events.jsonl"), snapshots=snaps)

    def iterate() -> dict:
        reduced = random_reduced(j, run.rng)
        iteration = run.replica.iteration
        for bucket, data in enumerate(reduced):
            sink.bucket(iteration, bucket, data)
        sink.iteration_done(iteration, IterationReport(iteration, 0))
        run.reference.step(iteration, reduced)
        return sink.lines[-1]

    assert iterate()["snapshot_taken"].endswith("iteration-000001")
    sink.writer.wait_idle(60)
    with snaps.write_lock:
        assert iterate()["snapshot_taken"].endswith("iteration-000002")
        held(snaps.write_lock, sink.writer, queued=0)
        for _ in range(3):
            assert iterate()["snapshot_skipped"] == "writer busy"
        assert_equal_state(run.replica, run.reference)        # it never waited for the disk
    sink.writer.wait_idle(60)
    assert iterate()["snapshot_taken"].endswith("iteration-000006")
    sink.writer.wait_idle(60)
    events = [json.loads(x) for x in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    kinds = [(e["event"], e["iteration"]) for e in events]
    assert kinds == [("snapshot.skipped", 3), ("snapshot.caught_up", 6)], kinds
    assert events[0]["writing"] == 2 and events[0]["next_attempt"] == 4 and events[1]["skipped"] == [3, 4, 5]
    assert snaps.counts() == {"written": 3, "failed": 0, "skipped": 3, "last_written": 6}
    assert uploader.submitted == [1, 2, 6]
    # The shutdown: a snapshot taken and waiting for the disk, the replica one iteration on; close
    # waits for the writer, then writes the final snapshot.
    with snaps.write_lock:
        assert iterate()["snapshot_taken"].endswith("iteration-000007")
        held(snaps.write_lock, sink.writer, queued=0)
        run.step()                                             # 8, not due through the sink
        closing = threading.Thread(target=snaps.close, args=(run.replica,))
        closing.start()
        time.sleep(0.2)
        assert closing.is_alive()                              # it waits for the disk
    closing.join(60)
    assert not closing.is_alive()
    assert [p.name for p in snaps.snapshots()] == [snapshot.snapshot_name(i) for i in (6, 7, 8)]
    assert snapshot.latest(snaps.directory).name == snapshot.snapshot_name(8)
    assert uploader.submitted == [1, 2, 6, 7, 8]
    assert_equal_state(Replica(j, snapshot.load(snapshot.latest(snaps.directory))), run.reference)
    with pytest.raises(GradtapError, match="closed"):
        sink.writer.take(run.replica)


@pytest.mark.privileged
def test_a_full_disk_under_the_background_writer_is_an_event(tmp_path):
    """The failures of the writer's thread are today's events: ``snapshot.failed`` once for a
    run of failures (disk full, with what to do), the replica going on in memory, nothing of the
    failed snapshots left, ``LATEST`` on the last one written; ``snapshot.resumed`` (how many
    were missed) when there is room again."""
    from tests.gradtap.test_out_dir import MODEL, snapshot_size
    from tests.tmpfs import fill, tmpfs

    j = job(factory=MODEL)
    with tmpfs(tmp_path / "out", int(3.5 * snapshot_size(j, tmp_path / "probe"))) as out:
        run = Driven(j)
        snaps = snapshot.Snapshots(out / "snapshots", j.name, every=1, keep=3, buffers=1)
        sink = ReplicaSink(run.replica, ControlPlane(out / "events.jsonl"), snapshots=snaps)

        def iterate() -> dict:
            reduced = random_reduced(j, run.rng)
            iteration = run.replica.iteration
            for bucket, data in enumerate(reduced):
                sink.bucket(iteration, bucket, data)
            sink.iteration_done(iteration, IterationReport(iteration, 0))
            run.reference.step(iteration, reduced)
            assert sink.writer.wait_idle(60)
            return sink.lines[-1]

        for _ in range(3):
            iterate()
        filler = fill(out, leave=0)
        for _ in range(3):
            assert "snapshot_taken" in iterate()
        assert_equal_state(run.replica, run.reference)
        events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
        (event,) = [e for e in events if e["event"].startswith("snapshot.")]
        assert event["event"] == "snapshot.failed" and event["reason"] == "disk_full"
        assert event["iteration"] == 4 and event["next_attempt"] == 5 and event["replica"] == "updating in memory"
        assert "Free space there" in event["error"]
        assert snapshot.latest(out / "snapshots").name == "iteration-000003"
        assert not [p for p in (out / "snapshots").iterdir() if p.name.startswith(snapshot.TMP_PREFIX)]
        filler.unlink()
        iterate()
        resumed = json.loads((out / "events.jsonl").read_text().splitlines()[-1])
        assert resumed["event"] == "snapshot.resumed" and resumed["missed"] == 3 and resumed["iteration"] == 7
        assert_equal_state(Replica(j, snapshot.load(snapshot.latest(out / "snapshots"))), run.reference)
        assert snaps.counts() == {"written": 4, "failed": 3, "skipped": 0, "last_written": 7}
        snaps.close()


def test_buffers_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="snapshot buffers: -1 must be at least 0"):
        snapshot.Snapshots(tmp_path, "j", buffers=-1)
    snaps = snapshot.Snapshots(tmp_path, "j")
    with pytest.raises(GradtapError, match="needs at least one buffer"):
        SnapshotWriter(snaps, Replica.from_job(job()))
    snaps.close()


WRITER = """
import sys
from pathlib import Path
from tests.store.test_snapshot_writer import KILLED, gradient
from gradtap.store import snapshot
from gradtap.store.snapshot_writer import SnapshotWriter
from gradtap.updater.replica import Replica
out = Path(sys.argv[1])
snaps = snapshot.Snapshots(out, KILLED.name, keep=2, buffers=1)
if (out / "LATEST").exists():
    replica = Replica(KILLED, snapshot.load(snapshot.latest(out)))
else:
    replica = Replica.from_job(KILLED)
writer = SnapshotWriter(snaps, replica)
while True:                      # a snapshot due every iteration; most are skipped while one is written
    replica.apply(replica.iteration, gradient(replica.iteration, replica.layout.total))
    taken = writer.take(replica)
    if taken is not None:
        print(taken.name, flush=True)
"""
KILLED = job(factory=("gradtap.workload.models:mlp", {"sizes": [1024, 1536, 1024, 10]}))   # 3.2 M parameters


def gradient(iteration: int, numel: int) -> np.ndarray:
    """The reduced gradient of ``iteration`` in the killed writer's job (the same in every life)."""
    return (np.random.default_rng(iteration).random(numel, dtype=np.float32) - np.float32(0.5)) * np.float32(1e-3)


def latest_name(directory: Path) -> str:
    try:
        return (directory / snapshot.LATEST).read_text().strip()
    except FileNotFoundError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_while_the_background_writer_writes(tmp_path):
    """Six lives of a process whose replica steps on while its background writer writes, each
    SIGKILLed at a random moment or a random moment into a write (a temporary directory
    there). After each kill every snapshot directory verifies, ``LATEST`` names the newest
    whole one (never an older one than before), and it is the state of a replica stepped
    through the same gradients on its own, bit for bit; the next life starts from it."""
    from tests.store.test_snapshot import wait_for_a_write

    rng = np.random.default_rng(21)
    truth = Replica.from_job(KILLED)
    kills_mid_write = 0
    for attempt in range(6):
        log = tmp_path.parent / f"{tmp_path.name}-life{attempt}.log"     # its skip warnings: never a full pipe
        with Child(WRITER, str(tmp_path), stderr=log) as child:
            first = child.stdout.readline()          # a snapshot taken in this life, and then written
            assert first.startswith(snapshot.PREFIX), log.read_text()[-2000:] if not first else first
            deadline = time.monotonic() + 60
            while latest_name(tmp_path) < first.strip():
                assert time.monotonic() < deadline and child.poll() is None, "the first snapshot was never written"
                time.sleep(0.002)
            if attempt % 2:
                wait_for_a_write(tmp_path, child)
                time.sleep(rng.uniform(0.0, 0.1))
            else:
                time.sleep(rng.uniform(0.0, 1.5))
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
        kills_mid_write += any(p.name.startswith(snapshot.TMP_PREFIX + snapshot.PREFIX) for p in tmp_path.iterdir())
        for path in tmp_path.glob(snapshot.PREFIX + "*"):
            snapshot.verify(path)
        latest = snapshot.latest(tmp_path)
        loaded = Replica(KILLED, snapshot.load(latest))
        assert loaded.iteration >= truth.iteration, f"LATEST went back to {latest.name}"
        while truth.iteration < loaded.iteration:
            truth.apply(truth.iteration, gradient(truth.iteration, truth.layout.total))
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert np.array_equal(getattr(loaded.state, name).view(np.uint32),
                                  getattr(truth.state, name).view(np.uint32)), f"{latest.name}: {name} differs"
        assert loaded.step == truth.step
    assert kills_mid_write >= 2, f"only {kills_mid_write} kills landed inside a write"
