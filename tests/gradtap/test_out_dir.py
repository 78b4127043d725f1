"""The appliance's output directory on a real, small filesystem (a size-limited tmpfs): a
full disk stops snapshots, never the replica, and says so once; report lines wait in memory
until there is room. The replica is checked against PyTorch's Adam throughout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtap.control import ControlPlane
from gradtap.merger.merger import IterationReport
from gradtap.replica_sink import ReplicaSink
from gradtap.store import snapshot
from gradtap.updater.replica import Replica
from gradtap.updater.replica_origin import ReplicaOrigin
from gradtap.store.snapshot import Snapshots
from tests.tmpfs import fill, on_disk, tmpfs
from tests.updater.naive_adam import TorchStep, random_reduced
from tests.updater.test_replica import assert_equal_state, job

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(120)]

MODEL = ("gradtap.workload.models:mlp", {"sizes": [128, 256, 200, 10]})   # snapshots of about 1 MiB


class Driven:
    """A sink over ``replica`` fed one random iteration at a time, and PyTorch's Adam over the same."""

    def __init__(self, j, sink: ReplicaSink):
        self.job, self.sink = j, sink
        self.reference = TorchStep(j)
        self.rng = np.random.default_rng(3)

    def iterate(self, iteration: int) -> dict:
        reduced = random_reduced(self.job, self.rng)
        for bucket, data in enumerate(reduced):
            self.sink.bucket(iteration, bucket, data)
        self.sink.iteration_done(iteration, IterationReport(iteration, 0))
        self.reference.step(iteration, reduced)
        return self.sink.lines[-1]


def snapshot_size(j, directory) -> int:
    """Bytes a snapshot of ``j`` with its Adam moments occupies, measured on an ordinary directory."""
    replica = Replica.from_job(j)
    replica.apply(0, np.concatenate(random_reduced(j, np.random.default_rng(0))))
    probe = Snapshots(directory, j.name)
    size = on_disk(probe.write_replica(replica))
    probe.close()
    return size


def events(out) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_a_full_disk_stops_snapshots_not_the_replica(tmp_path):
    j = job(factory=MODEL)
    with tmpfs(tmp_path / "out", int(3.5 * snapshot_size(j, tmp_path / "probe"))) as out:
        replica = Replica.from_job(j)
        snaps = Snapshots(out / "snapshots", j.name, every=1, keep=3, origin=ReplicaOrigin.of(replica))
        sink = ReplicaSink(replica, ControlPlane(out / "events.jsonl"), snapshots=snaps,
                           report_path=out / "iterations.jsonl", digests=True)
        run = Driven(j, sink)
        for it in range(3):
            assert run.iterate(it)["snapshot"].endswith(snapshot.snapshot_name(it + 1))
        filler = fill(out, leave=0)                     # someone else fills the disk
        for it in range(3, 6):
            line = run.iterate(it)
            assert line["snapshot_failed"] == "disk_full" and "snapshot" not in line and not line["stale"]
        assert_equal_state(replica, run.reference)      # it went on in memory, bit for bit
        assert replica.iteration == 6
        failed = [e for e in events(out) if e["event"].startswith("snapshot.")]
        assert len(failed) == 1, failed                 # once for the run of failures
        (event,) = failed
        assert event["event"] == "snapshot.failed" and event["reason"] == "disk_full"
        assert event["iteration"] == 4 and event["next_attempt"] == 5 and event["replica"] == "updating in memory"
        assert "disk full" in event["error"] and "Free space there" in event["error"]
        assert event["needed_bytes"] > event["free_bytes"]
        latest = snapshot.latest(out / "snapshots")     # the last one written, complete
        assert latest.name == "iteration-000003"
        assert [p.name for p in (out / "snapshots").iterdir() if p.name.startswith(snapshot.TMP_PREFIX)] == []

        filler.unlink()                                 # space again
        line = run.iterate(6)
        assert line["snapshot"].endswith("iteration-000007")
        resumed = events(out)[-1]
        assert resumed["event"] == "snapshot.resumed" and resumed["missed"] == 3
        assert_equal_state(Replica(j, snapshot.load(snapshot.latest(out / "snapshots"))), run.reference)
        report = [json.loads(x) for x in (out / "iterations.jsonl").read_text().splitlines()]
        assert [x["iteration"] for x in report] == list(range(7))
        snaps.close()


@pytest.mark.parametrize("leave", [0, 4096])
def test_report_lines_wait_for_room(tmp_path, leave):
    """With no room (or one page: some lines fit, then a write comes up short) the report
    file only ever holds whole lines; once there is room again every line is there, in order."""
    j = job()
    with tmpfs(tmp_path / "out", 1 << 20) as out:
        sink = ReplicaSink(Replica.from_job(j), ControlPlane(tmp_path / "events.jsonl"),
                           report_path=out / "iterations.jsonl", digests=True)
        run = Driven(j, sink)
        (out / "iterations.jsonl").touch()
        filler = fill(out, leave=leave)
        for it in range(14):
            run.iterate(it)
            text = (out / "iterations.jsonl").read_text()
            assert text == "".join(json.dumps(x) + "\n" for x in sink.lines[:text.count("\n")])
        assert len(text) < len(json.dumps(sink.lines)), "the disk never filled"
        filler.unlink()
        run.iterate(14)
        assert (out / "iterations.jsonl").read_text() == "".join(json.dumps(x) + "\n" for x in sink.lines)
        assert_equal_state(sink.replica, run.reference)
