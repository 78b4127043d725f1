"""``gradtap.verify`` must fail, and say what differs, whenever the replica is not the trainer.

One small job is simulated and replayed once (snapshots every 2 iterations, so iteration 2 is
checked by its digest only); each test corrupts a copy of the replay's output, or of the
ground truth, the way a wrong replica or a mixed-up directory would.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtap.replay import run_replay
from gradtap.store import snapshot
from gradtap.updater.replica import Replica
from gradtap.store.snapshot import Snapshots
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import JobSpec
from tests.simulator.test_simulate import make_job, simulate

pytestmark = pytest.mark.slow


@dataclass
class Run:
    job: JobSpec
    sim: Path
    replay: Path

    @property
    def params(self):
        return job_params(self.job)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("verify")
    job = make_job(3, "LL", 2, "fp32")
    job = job.model_copy(update={"appliance": job.appliance.model_copy(update={"snapshot_every": 2})})
    simulate(root / "sim", job, iterations=3)
    streams = {m.name: root / "sim" / "streams" / f"{m.name}.pcap" for m in job.mirrors}
    run_replay(job, streams, root / "replay", torch.load(root / "sim" / "truth" / "start.pt", weights_only=True))
    return Run(job, root / "sim", root / "replay")


@pytest.fixture
def copy(run, tmp_path) -> Run:
    """A copy of the replay's output and of the ground truth, to corrupt."""
    shutil.copytree(run.replay, tmp_path / "replay")
    shutil.copytree(run.sim / "truth", tmp_path / "sim" / "truth")
    return Run(run.job, tmp_path / "sim", tmp_path / "replay")


def check(r: Run):
    return verify(r.replay, r.sim / "truth", r.params)


def differences(r: Run) -> list[str]:
    v = check(r)
    assert not v.ok
    return [str(d) for d in v.differences]


def rewrite_snapshot(path: Path, change) -> None:
    """Change a snapshot's state with ``change(model, optimizer)`` and rewrite its manifest's
    checksums: a snapshot as a wrong replica would have written it, complete and consistent."""
    model = torch.load(path / "model.pt", weights_only=True)
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    change(model, optimizer)
    manifest = json.loads((path / "manifest.json").read_text())
    for name, obj in (("model.pt", model), ("optimizer.pt", optimizer)):
        torch.save(obj, path / name)
        manifest["sha256"][name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def flip(tensor: torch.Tensor, element: int) -> None:
    """Flip the lowest mantissa bit of one element (flat index)."""
    bits = tensor.view(-1).view(torch.int32)
    bits[element] ^= 1


def newest(r: Run) -> Path:
    return sorted((r.replay / "snapshots").glob(snapshot.PREFIX + "*"))[-1]


def test_the_untouched_run_verifies(run):
    v = check(run)
    assert v.ok and not v.stale, v
    assert v.digests_checked == [1, 2, 3] and v.snapshots_checked == [1, 3]


@pytest.mark.parametrize("kind", ["value", "exp_avg", "exp_avg_sq"])
def test_a_flipped_bit_in_a_snapshot_tensor_is_named_with_its_element(copy, kind):
    p = copy.params[1]
    shape = tuple(p.shape)

    def change(model, optimizer):
        flip(model[p.name] if kind == "value" else optimizer["state"][1][kind], 5)

    rewrite_snapshot(newest(copy), change)
    index = [int(i) for i in np.unravel_index(5, shape)]
    found = differences(copy)
    assert [d for d in found if d.startswith(f"iteration 3: {kind} of {p.name} differs at {index}: replica ")], found


def test_a_wrong_step_in_a_snapshot_is_named(copy):
    name = copy.params[0].name

    def change(model, optimizer):
        optimizer["state"][0]["step"] += 1

    rewrite_snapshot(newest(copy), change)
    assert f"iteration 3: step of {name} differs: replica 5, truth 4" in differences(copy)


@pytest.mark.parametrize("kind", ["param", "exp_avg", "exp_avg_sq"])
def test_a_flipped_bit_between_snapshots_fails_its_digest(copy, kind):
    """Iteration 2 has no snapshot: its digest alone must catch the difference, and name
    which kind of tensor it is in."""
    path = copy.sim / "truth" / "iter_000002" / "state.npz"
    with np.load(path) as z:
        state = {k: z[k] for k in z.files}
    state[f"{kind}/{copy.params[-1].name}"].view(np.uint32).reshape(-1)[3] ^= 1 << 30
    np.savez(path, **state)
    assert differences(copy) == [f"iteration 2: {kind} (digest over every parameter) differs"]


def test_a_wrong_step_between_snapshots_fails_its_digest(copy):
    path = copy.sim / "truth" / "iter_000002" / "state.npz"
    with np.load(path) as z:
        state = {k: z[k] for k in z.files}
    state["step"] = np.array(int(state["step"]) + 1, np.int64)
    np.savez(path, **state)
    assert differences(copy) == ["iteration 2: step differs: replica 3, truth 4"]


def test_a_missing_iteration_is_named(copy):
    lines = (copy.replay / "iterations.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["iteration"] != 2]
    (copy.replay / "iterations.jsonl").write_text("\n".join(kept) + "\n")
    assert differences(copy) == ["iteration 2: iterations.jsonl has no line for this captured iteration"]


def test_latest_naming_an_older_snapshot_is_named(copy):
    (copy.replay / "snapshots" / snapshot.LATEST).write_text(snapshot.snapshot_name(2) + "\n")
    assert differences(copy) == ["iteration 3: snapshots/LATEST names iteration-000002, not the newest snapshot "
                                 "iteration-000004"]


def test_a_snapshot_in_the_place_of_another_is_named(copy):
    snapshots = copy.replay / "snapshots"
    shutil.rmtree(snapshots / "iteration-000004")
    shutil.copytree(snapshots / "iteration-000002", snapshots / "iteration-000004")
    assert differences(copy) == ["iteration 1: snapshot iteration-000004 holds iteration 2"]


def test_a_snapshot_of_another_job_is_named(copy):
    manifest_path = newest(copy) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["job"] = "another-job"
    manifest_path.write_text(json.dumps(manifest))
    assert differences(copy) == [f"iteration 3: snapshot iteration-000004 is of job 'another-job', "
                                 f"not {copy.job.name!r}"]


def test_a_snapshot_from_another_run_is_named(copy):
    """The same job, trained from another initial model on the same gradients: a complete,
    consistent snapshot whose every value is wrong."""
    start = torch.load(copy.sim / "truth" / "start.pt", weights_only=True)
    for value in start["model"].values():
        value += 1e-3
    other = Replica(copy.job, start)
    for it in (1, 2, 3):
        other.apply(it, np.load(copy.sim / "truth" / f"iter_{it:06d}" / "grad.npy"))
    snapshots = Snapshots(copy.sim / "other", copy.job.name)
    written = snapshots.write_replica(other)
    snapshots.close()
    shutil.rmtree(newest(copy))
    shutil.copytree(written, copy.replay / "snapshots" / written.name)
    found = differences(copy)
    assert [d for d in found if d.startswith(f"iteration 3: value of {copy.params[0].name} differs at ")], found


def test_a_snapshot_that_does_not_match_its_manifest_is_named(copy):
    path = newest(copy) / "model.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    found = differences(copy)
    assert len(found) == 1 and found[0].startswith("iteration 3: snapshot iteration-000004 is unreadable: ")
    assert "model.pt has sha256" in found[0]
