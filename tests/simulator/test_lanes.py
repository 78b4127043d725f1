"""The simulator's background lanes and the truth written bucket by bucket beside the run."""

from __future__ import annotations

import hashlib
import json
import threading
import types

import numpy as np
import pytest
import torch

from gradtap.simulator.lanes import Lane, PhaseClock
from gradtap.simulator.truth import TruthWriter


def test_lane_runs_jobs_in_order_off_the_main_thread_and_times_them():
    clock = PhaseClock()
    lane = Lane("t", clock, "frames")
    seen = []
    try:
        for i in range(50):
            lane.submit(lambda i=i: seen.append((i, threading.current_thread() is threading.main_thread())))
        lane.wait()
    finally:
        lane.close()
    assert seen == [(i, False) for i in range(50)]
    assert clock.wall["frames"] > 0 and clock.main_wall["frames"] == 0
    assert clock.main_wall["waiting"] == clock.wall["waiting"] >= 0


def test_lane_raises_a_job_error_at_wait_and_runs_later_jobs():
    lane = Lane("t", PhaseClock(), "truth")
    done = []

    def fail():
        raise OSError(28, "No space left on device")
    try:
        lane.submit(fail)
        lane.submit(done.append, 1)
        with pytest.raises(OSError, match="No space"):
            lane.wait()
        lane.wait()                  # the failed job is reported once
    finally:
        lane.close()
    assert done == [1]


def _job():
    return types.SimpleNamespace(name="t")


def test_truth_gradient_bucket_by_bucket_is_what_np_save_writes(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    rng = np.random.default_rng(0)
    buckets = (rng.standard_normal(5).astype(np.float32), rng.standard_normal(7).astype(np.float32))
    truth = TruthWriter(tmp_path / "truth", _job(), seed=0)
    truth.iteration(4, buckets, model, optimizer, (10, 20))
    truth.close()
    grad = tmp_path / "truth" / "iter_000004" / "grad.npy"
    want = tmp_path / "want.npy"
    np.save(want, np.concatenate(buckets))
    assert grad.read_bytes() == want.read_bytes()
    manifest = json.loads((tmp_path / "truth" / "manifest.json").read_text())
    assert list(manifest["sha256"]) == ["iter_000004/grad.npy", "iter_000004/state.npz"]
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((tmp_path / "truth" / name).read_bytes()).hexdigest() == digest
    assert manifest["span_ns"] == {"4": [10, 20]}


def test_truth_refuses_a_gradient_of_the_wrong_size_or_dtype(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    truth = TruthWriter(tmp_path, _job(), seed=0)
    truth.begin_iteration(1, 8, np.float32)
    with pytest.raises(ValueError, match="float16"):
        truth.add_gradient(np.zeros(4, np.float16))
    truth.add_gradient(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="holds 4 of 8 elements"):
        truth.end_iteration(1, model, optimizer, (0, 1))
