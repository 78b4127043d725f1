"""``gradtap replay --gradients DIR``: each recovered iteration's reduced gradient, against the
trainer's own (the simulator's ``truth/iter_NNNNNN/grad.npy``, which its ring reduction wrote)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtap.replay import run_replay
from gradtap.simulator.truth import iteration_dir
from tests.forked import run_cli
from tests.gradtap.test_replay import drop_allgather, start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_gradients_written_are_the_trainers(tmp_path, dtype):
    job = make_job(3, "LL", 2, dtype)
    simulate(tmp_path / "sim", job, iterations=3)
    run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"),
               gradients=tmp_path / "grads")
    truth = tmp_path / "sim" / "truth"
    assert sorted(p.name for p in (tmp_path / "grads").iterdir()) == \
        ["iter_000001.npy", "iter_000002.npy", "iter_000003.npy", "layout.json"]
    for it in (1, 2, 3):
        got, want = np.load(tmp_path / "grads" / f"iter_{it:06d}.npy"), np.load(iteration_dir(truth, it) / "grad.npy")
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), it
        assert got.dtype == (np.float32 if dtype == "fp32" else np.uint16)
    assert json.loads((tmp_path / "grads" / "layout.json").read_text()) == \
        json.loads((truth / "layout.json").read_text())


def test_an_unrecoverable_iteration_writes_no_gradient(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=3)
    assert drop_allgather(tmp_path / "sim", job, ordinal=1, bucket=0) > 0
    done = run_cli("replay", str(tmp_path / "sim" / "job.yaml"),
                   *[f"{n}={p}" for n, p in streams_of(tmp_path / "sim", job).items()],
                   "-o", str(tmp_path / "replay"), "--gradients", str(tmp_path / "grads"))
    assert done.returncode == 0, done.stderr
    assert "reduced gradients of the recovered iterations in" in " ".join(done.stdout.split())
    assert sorted(p.name for p in (tmp_path / "grads").iterdir()) == ["iter_000001.npy", "iter_000003.npy",
                                                                     "layout.json"]
    truth = tmp_path / "sim" / "truth"
    for it in (1, 3):
        assert np.load(tmp_path / "grads" / f"iter_{it:06d}.npy").tobytes() == \
            np.load(iteration_dir(truth, it) / "grad.npy").tobytes()
