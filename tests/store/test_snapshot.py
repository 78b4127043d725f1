"""Snapshots: atomic, verified, retained, loadable with torch.load + load_state_dict, and a writer
killed with SIGKILL at random moments never leaves LATEST pointing at anything incomplete."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.workload.models import build
from gradtap.workload.spec import MirrorSpec
from gradtap.simulator.training import make_optimizer
from tests.forked import Child
from tests.updater.naive_adam import TorchStep, random_reduced
from tests.updater.test_replica import assert_equal_state, job, train_on_alike
from gradtap.store import snapshot
from gradtap.updater.replica import Replica, seed_checkpoint
from gradtap.updater.replica_origin import ORIGIN, ReplicaOrigin, parse_origin


def stepped(j, iterations, seed=0):
    replica, reference = Replica.from_job(j), TorchStep(j)
    rng = np.random.default_rng(seed)
    for it in range(iterations):
        reduced = random_reduced(j, rng)
        reference.step(it, reduced)
        replica.apply(it, np.concatenate(reduced))
    return replica, reference


def test_schedule_latest_and_retention(tmp_path):
    j = job()
    replica = Replica.from_job(j)
    snaps = snapshot.Snapshots(tmp_path, j.name, every=2, keep=2)
    rng = np.random.default_rng(0)
    written = []
    for it in range(7):
        replica.apply(it, np.concatenate(random_reduced(j, rng)))
        if snaps.due(replica.iteration):
            written.append(snaps.write_replica(replica).name)
    assert written == ["iteration-000002", "iteration-000004", "iteration-000006"]
    assert [p.name for p in snaps.snapshots()] == written[-2:]
    assert (tmp_path / "LATEST").read_text() == "iteration-000006\n"
    manifest = snapshot.verify(snapshot.latest(tmp_path))
    assert manifest["iteration"] == 6 and manifest["step"] == 6 and manifest["job"] == j.name
    assert not snaps.due(0) and not snaps.due(3)
    on_request = snaps.write_replica(Replica.from_job(j))          # on request, an older state
    assert on_request.name == "iteration-000000" and snapshot.latest(tmp_path) == on_request
    assert [p.name for p in snaps.snapshots()] == ["iteration-000000", "iteration-000006"]
    snaps.close()


def test_verify_catches_damage_and_policy_is_validated(tmp_path):
    j = job()
    replica, _ = stepped(j, 2)
    snaps = snapshot.Snapshots(tmp_path, j.name)
    path = snaps.write_replica(replica)
    assert snaps.write_replica(replica) == path                      # same state: kept as is
    blob = bytearray((path / "optimizer.pt").read_bytes())
    blob[len(blob) // 2] ^= 1
    (path / "optimizer.pt").write_bytes(bytes(blob))
    with pytest.raises(GradtapError, match="optimizer.pt has sha256"):
        snapshot.latest(tmp_path)
    assert snaps.write_replica(replica) == path                      # damaged: rewritten
    snapshot.verify(path)
    with pytest.raises(GradtapError, match="another process"):
        snapshot.Snapshots(tmp_path, j.name)
    snaps.close()
    with pytest.raises(ConfigError, match="holds snapshots of job"):
        snapshot.Snapshots(tmp_path, "another-job")
    with pytest.raises(ConfigError, match="keep"):
        snapshot.Snapshots(tmp_path / "x", j.name, keep=0)
    with pytest.raises(ConfigError, match="every"):
        snapshot.Snapshots(tmp_path / "y", j.name, every=0)
    with pytest.raises(GradtapError, match="no LATEST"):
        snapshot.latest(tmp_path / "x")


def test_shutdown_writes_a_final_snapshot_but_never_a_stale_one(tmp_path):
    j = job()
    replica, _ = stepped(j, 3)
    snapshot.Snapshots(tmp_path, j.name).close(replica)
    assert snapshot.latest(tmp_path).name == "iteration-000003"
    replica.begin(3)
    replica.abort()
    snaps = snapshot.Snapshots(tmp_path, j.name)
    with pytest.raises(GradtapError, match="stale"):
        snaps.write_replica(replica)
    snaps.close(replica)                                              # shutdown: nothing written
    assert snapshot.latest(tmp_path).name == "iteration-000003"
    snapshot.Snapshots(tmp_path, j.name).close()                      # the lock was released


def test_a_trainer_resumes_with_two_lines(tmp_path):
    j = job(kind="adamw", weight_decay=0.1, clip=1e-2)
    replica, reference = stepped(j, 4)
    snaps = snapshot.Snapshots(tmp_path, j.name)
    snaps.write_replica(replica)
    snaps.close()
    model = build(j.model.factory, j.model.kwargs, seed=123)
    optimizer = make_optimizer(list(model.parameters()), j.optimizer)
    snap = snapshot.latest(tmp_path)
    model.load_state_dict(torch.load(snap / "model.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(snap / "optimizer.pt", weights_only=True))
    start = json.loads((snap / "manifest.json").read_text())["iteration"]
    train_on_alike(j, model, optimizer, reference, replica, range(start, start + 3), seed=4)
    assert Replica(j, snapshot.load(snap)).iteration == start == 4


WRITER = """
import sys, numpy as np
from pathlib import Path
from tests.updater.test_replica import job
from gradtap.store import snapshot
from gradtap.updater.replica import Replica
out = Path(sys.argv[1])
j = job(factory=("gradtap.workload.models:mlp", {"sizes": [1024, 1536, 1024, 10]}))
snaps = snapshot.Snapshots(out, j.name, keep=2)
replica = Replica(j, snapshot.load(snapshot.latest(out))) if (out / "LATEST").exists() else Replica.from_job(j)
rng = np.random.default_rng(replica.iteration)
grad = (rng.standard_normal(replica.layout.total) * 1e-3).astype(np.float32)
while True:                      # nearly all the time goes into writing
    replica.apply(replica.iteration, grad)
    path = snaps.write_replica(replica)
    print(path.name, flush=True)
"""


def check_directory(out: Path) -> dict:
    """Every snapshot directory is complete, LATEST names one, and it loads into torch."""
    for path in out.glob(snapshot.PREFIX + "*"):
        snapshot.verify(path)
    latest = snapshot.latest(out)
    j = job(factory=("gradtap.workload.models:mlp", {"sizes": [1024, 1536, 1024, 10]}))
    model = build(j.model.factory, j.model.kwargs, seed=1)
    optimizer = torch.optim.Adam(model.parameters())
    model.load_state_dict(torch.load(latest / "model.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(latest / "optimizer.pt", weights_only=True))
    return json.loads((latest / "manifest.json").read_text())


def wait_for_a_write(out: Path, child, limit_s: float = 30.0) -> None:
    """Return as soon as the child has a snapshot write in progress (a temporary directory)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and child.poll() is None:
        if any(p.name.startswith(snapshot.TMP_PREFIX + snapshot.PREFIX) for p in out.iterdir()):
            return
        time.sleep(0.002)


@pytest.mark.slow
def test_sigkill_mid_write_leaves_the_previous_snapshot(tmp_path):
    """Six lives of a writer, each SIGKILLed: at a random moment, or a random moment into a
    write. After every kill the directory must be consistent and load into torch."""
    rng = np.random.default_rng(12)
    seen_iteration = 0
    kills_mid_write = 0
    for attempt in range(6):
        log = tmp_path.parent / f"{tmp_path.name}-life{attempt}.log"   # beside the directory checked
        with Child(WRITER, str(tmp_path), stderr=log) as child:
            first = child.stdout.readline()          # one complete snapshot in this life
            assert first.startswith(snapshot.PREFIX), log.read_text()[-2000:] if not first else first
            if attempt % 2:
                wait_for_a_write(tmp_path, child)
                time.sleep(rng.uniform(0.0, 0.25))
            else:
                time.sleep(rng.uniform(0.0, 1.5))
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
        kills_mid_write += any(p.name.startswith(snapshot.TMP_PREFIX) for p in tmp_path.iterdir())
        manifest = check_directory(tmp_path)
        assert manifest["iteration"] >= max(seen_iteration, 1)       # never goes back
        seen_iteration = manifest["iteration"]
    assert kills_mid_write >= 2, f"only {kills_mid_write} kills landed inside a write"


def test_a_directory_refuses_the_snapshots_of_another_replica(tmp_path):
    """Issue 11, item 5: a wrong job replayed into a directory, then the right one. Snapshot
    names carry only the iteration, so the wrong replica's snapshots would pass every
    checksum and LATEST would name them; the directory records its replica's origin and
    refuses another, naming the directory, whose it is, what differs and the fix."""
    right, wrong = job(), job(eps=1e-6)                   # the same name, another optimizer
    wrong_replica = Replica.from_job(wrong)
    snaps = snapshot.Snapshots(tmp_path, wrong.name, origin=ReplicaOrigin.of(wrong_replica))
    wrong_replica.apply(0, np.concatenate(random_reduced(wrong, np.random.default_rng(0))))
    snaps.write_replica(wrong_replica)
    snaps.close()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))

    right_replica = Replica.from_job(right)
    origin = ReplicaOrigin.of(right_replica)
    with pytest.raises(ConfigError) as caught:
        snapshot.Snapshots(tmp_path, right.name, origin=origin)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path}: holds the snapshots of job 'replica-test' begun at iteration 0 ")
    assert "(the job spec's optimizer section differs)" in message
    assert "another output directory (--out), or pass --force" in message
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before   # untouched

    other_start = Replica(right, seed_checkpoint(right, 1))
    with pytest.raises(ConfigError, match=r"\(the job spec's optimizer section and the start state differ\)"):
        snapshot.Snapshots(tmp_path, right.name, origin=ReplicaOrigin.of(other_start))

    snaps = snapshot.Snapshots(tmp_path, right.name, origin=origin, force=True)     # cleared
    assert snaps.snapshots() == [] and not (tmp_path / snapshot.LATEST).exists()
    right_replica.apply(0, np.concatenate(random_reduced(right, np.random.default_rng(0))))
    path = snaps.write_replica(right_replica)
    snaps.close()
    assert path.name == "iteration-000001"                # the name the wrong replica's had
    loaded = snapshot.load(snapshot.latest(tmp_path))
    assert_equal_state(Replica(right, loaded), right_replica_reference(right))


def right_replica_reference(j):
    """PyTorch's Adam over the gradient the test above applied: the state the snapshot must hold."""
    reference = TorchStep(j)
    reference.step(0, random_reduced(j, np.random.default_rng(0)))
    return reference


def test_one_replica_may_reopen_its_directory_with_other_appliance_settings(tmp_path):
    j = job()
    replica = Replica.from_job(j)
    snaps = snapshot.Snapshots(tmp_path, j.name, origin=ReplicaOrigin.of(replica))
    replica.apply(0, np.concatenate(random_reduced(j, np.random.default_rng(0))))
    first = snaps.write_replica(replica)
    snaps.close()
    assert json.loads((tmp_path / ORIGIN).read_text())["start_iteration"] == 0
    settings = j.model_copy(update={"appliance": j.appliance.model_copy(update={"snapshot_keep": 5}),
                                    "mirrors": (*j.mirrors, MirrorSpec(name="m2", rank=1, direction="ingress"))})
    again = snapshot.Snapshots(tmp_path, j.name, origin=ReplicaOrigin.of(Replica.from_job(settings)))
    assert again.snapshots() == [first]
    again.close()


def test_snapshots_of_an_unknown_replica_are_refused(tmp_path):
    j = job()
    replica, _ = stepped(j, 1)
    snaps = snapshot.Snapshots(tmp_path, j.name)          # no origin recorded
    snaps.write_replica(replica)
    snaps.close()
    origin = ReplicaOrigin.of(Replica.from_job(j))
    with pytest.raises(ConfigError, match=r"holds snapshots of an unknown replica \(no readable ORIGIN.json"):
        snapshot.Snapshots(tmp_path, j.name, origin=origin)
    (tmp_path / ORIGIN).write_text("{not json")
    with pytest.raises(ConfigError, match="unknown replica"):
        snapshot.Snapshots(tmp_path, j.name, origin=origin)
    snapshot.Snapshots(tmp_path / "new", j.name, origin=origin).close()                # an empty one is claimed
    assert parse_origin((tmp_path / "new" / ORIGIN).read_text()) == origin
