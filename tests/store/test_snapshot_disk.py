"""Snapshots on a real, small filesystem (a size-limited tmpfs): retention makes room before
writing, a full disk is named and cleaned up, a read-only one is a clear error, and in every
case LATEST keeps naming a complete snapshot that loads."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from gradtap.core.errors import ConfigError
from gradtap.store import snapshot
from gradtap.updater.replica import Replica
from gradtap.store.snapshot import Snapshots, SnapshotWriteError
from tests.tmpfs import fill, free_bytes, on_disk, read_only, tmpfs
from tests.updater.naive_adam import random_reduced
from tests.updater.test_replica import job

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(120)]

# About 86 k parameters: a snapshot of about 1 MiB, so a few fit in a tmpfs of a few MiB.
MODEL = ("gradtap.workload.models:mlp", {"sizes": [128, 256, 200, 10]})


@pytest.fixture(scope="module")
def snapshot_size(tmp_path_factory) -> int:
    """Bytes one snapshot of MODEL (with its Adam moments) occupies, measured on an ordinary directory."""
    snaps = Snapshots(tmp_path_factory.mktemp("probe"), "probe")
    path = snaps.write_replica(Run().step())
    snaps.close()
    return on_disk(path)


class Run:
    """A replica of MODEL stepped one iteration at a time."""

    def __init__(self):
        self.job = job(factory=MODEL)
        self.replica = Replica.from_job(self.job)
        self.rng = np.random.default_rng(0)

    def step(self) -> Replica:
        self.replica.apply(self.replica.iteration, np.concatenate(random_reduced(self.job, self.rng)))
        return self.replica


def assert_latest_is(directory, replica_state: dict) -> None:
    """LATEST names a verified snapshot whose tensors are ``replica_state``'s, bit for bit."""
    loaded = snapshot.load(snapshot.latest(directory))
    assert loaded["iteration"] == replica_state["iteration"]
    for key, value in replica_state["model"].items():
        assert torch.equal(loaded["model"][key].view(torch.int32), value.view(torch.int32)), key


def temporaries(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(snapshot.TMP_PREFIX)]


@pytest.mark.parametrize("keep", [1, 3])
def test_retention_makes_room_before_writing(tmp_path, snapshot_size, keep):
    """``keep: K`` snapshots fit in K and a half snapshots' space (2 and a half for K = 1,
    where the one LATEST names must outlive the writing of the next)."""
    run = Run()
    with tmpfs(tmp_path / "fs", int((max(keep, 2) + 0.5) * snapshot_size)) as fs:
        snaps = Snapshots(fs / "snapshots", run.job.name, keep=keep)
        for _ in range(keep + 3):
            snaps.write_replica(run.step())
            assert len(snaps.snapshots()) <= keep
        names = [p.name for p in snaps.snapshots()]
        assert names == [snapshot.snapshot_name(i) for i in range(keep + 4 - keep, keep + 4)]
        for path in snaps.snapshots():
            snapshot.verify(path)
        assert_latest_is(fs / "snapshots", run.replica.state_dict())
        snaps.close()


def test_a_full_disk_is_refused_before_writing_and_named(tmp_path, snapshot_size):
    run = Run()
    with tmpfs(tmp_path / "fs", int(3.5 * snapshot_size)) as fs:
        snaps = Snapshots(fs / "snapshots", run.job.name, keep=3)
        snaps.write_replica(run.step())
        snaps.write_replica(run.step())
        kept = run.replica.state_dict()
        filler = fill(fs, leave=snapshot_size // 2)
        before = free_bytes(fs)
        with pytest.raises(SnapshotWriteError) as caught:
            snaps.write_replica(run.step())
        error = caught.value
        assert error.reason == "disk_full" and error.iteration == 3
        assert error.needed_bytes > error.free_bytes == before
        message = str(error)
        assert "disk full" in message and "LATEST still names iteration-000002" in message
        assert "Free space there" in message and "appliance.snapshot_keep: 3" in message
        assert temporaries(fs / "snapshots") == [] and free_bytes(fs) == before
        assert_latest_is(fs / "snapshots", kept)

        filler.unlink()                                 # space again: the next snapshot is written
        assert snaps.write_replica(run.step()).name == "iteration-000004"
        assert_latest_is(fs / "snapshots", run.replica.state_dict())
        snaps.close()


def test_a_disk_that_fills_while_writing_is_named_and_cleaned_up(tmp_path, snapshot_size, monkeypatch):
    """The space check passed (here: told a snapshot takes nothing), then the disk filled
    mid-write: torch.save's "unexpected pos" becomes the disk-full error, and nothing of the
    half-written snapshot stays."""
    run = Run()
    with tmpfs(tmp_path / "fs", int(3.5 * snapshot_size)) as fs:
        snaps = Snapshots(fs / "snapshots", run.job.name, keep=3)
        snaps.write_replica(run.step())
        kept = run.replica.state_dict()
        fill(fs, leave=snapshot_size // 2)
        before = free_bytes(fs)
        monkeypatch.setattr(snapshot, "snapshot_bytes", lambda state, block: 0)
        with pytest.raises(SnapshotWriteError) as caught:
            snaps.write_replica(run.step())
        message = str(caught.value)
        assert caught.value.reason == "disk_full"
        assert "disk full" in message and "No space left on device" in message and "unexpected pos" not in message
        assert "LATEST still names iteration-000001" in message
        assert temporaries(fs / "snapshots") == [] and free_bytes(fs) == before
        assert [p.name for p in snaps.snapshots()] == ["iteration-000001"]
        assert_latest_is(fs / "snapshots", kept)
        snaps.close()


def test_a_read_only_directory_is_a_clear_error(tmp_path, snapshot_size):
    run = Run()
    with tmpfs(tmp_path / "fs", 4 * snapshot_size) as fs:
        snaps = Snapshots(fs / "snapshots", run.job.name)
        snaps.write_replica(run.step())
        kept = run.replica.state_dict()
        (fs / "new").mkdir()
        with read_only(fs):                             # mid-run
            with pytest.raises(SnapshotWriteError) as caught:
                snaps.write_replica(run.step())
            assert caught.value.reason == "read_only"
            assert "Read-only file system" in str(caught.value) and "remounted read-only" in str(caught.value)
            assert "LATEST still names iteration-000001" in str(caught.value)
            assert_latest_is(fs / "snapshots", kept)
            with pytest.raises(SnapshotWriteError, match="Read-only file system"):
                snaps.close(run.replica)                # the final snapshot: an error, the lock released
            for directory in (fs / "snapshots", fs / "new" / "snapshots"):   # at start: refused, named
                with pytest.raises(ConfigError, match=rf"{directory}: cannot write snapshots there "
                                                      r"\(Read-only file system\).*--out"):
                    Snapshots(directory, run.job.name)
        assert temporaries(fs / "snapshots") == []


def test_latest_that_cannot_be_replaced_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    """The snapshot is complete but LATEST cannot be replaced (the disk filled in between):
    the new snapshot is removed, since nothing names it, and LATEST names the previous one."""
    run = Run()
    snaps = Snapshots(tmp_path, run.job.name)
    snaps.write_replica(run.step())
    kept = run.replica.state_dict()
    write_small = snapshot._write_small

    def full_for_latest(path, text):
        if path.name.startswith(snapshot.TMP_PREFIX + snapshot.LATEST):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write_small(path, text)

    monkeypatch.setattr(snapshot, "_write_small", full_for_latest)
    with pytest.raises(SnapshotWriteError, match="disk full"):
        snaps.write_replica(run.step())
    assert [p.name for p in snaps.snapshots()] == ["iteration-000001"] and temporaries(tmp_path) == []
    assert_latest_is(tmp_path, kept)
    snaps.close()
