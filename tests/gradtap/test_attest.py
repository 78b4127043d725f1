"""The trainer attests its state; the appliance checks its replica against it.

The trainer is the simulator's, resumed to an iteration with real PyTorch training
(``simulator.run.resume``): its fingerprint is taken from its torch model and optimizer
(``gradtap.trainer.attest.fingerprint``), the replica's from its flat arrays.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gradtap.control_server import ControlServer, ControlSettings
from gradtap.control_token import read_token
from gradtap.core.errors import ConfigError
from gradtap.metrics import ApplianceCollector
from gradtap.simulator.run import resume
from gradtap.trainer.attest import Attestor, fingerprint, fingerprint_of, positions
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from tests.gradtap.test_numbering import appliance, events
from tests.simulator.test_simulate import make_job, simulate


def test_positions_spread_over_the_tensor_and_take_small_ones_whole():
    assert positions(5).tolist() == [0, 1, 2, 3, 4]
    at = positions(1000, 4)
    assert at.tolist() == [0, 333, 666, 999]


def test_a_torch_fingerprint_equals_one_taken_from_numpy_arrays():
    model = torch.nn.Sequential(torch.nn.Linear(300, 7), torch.nn.Linear(7, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 300)).sum().backward()
    optimizer.step()
    got = fingerprint(3, model, optimizer)
    arrays = []
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        flat = {"param": p.detach().numpy().reshape(-1), "exp_avg": state["exp_avg"].numpy().reshape(-1),
                "exp_avg_sq": state["exp_avg_sq"].numpy().reshape(-1)}
        arrays.append((name, {k: v[[int(i) for i in positions(v.size)]] for k, v in flat.items()}))
    assert got == fingerprint_of(3, 1, arrays)
    assert list(got["params"]) == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    root = tmp_path_factory.mktemp("attest")
    job = make_job(3, "LL", 2, "fp32")
    simulate(root, job, iterations=3)
    start = torch.load(root / "truth" / "start.pt", weights_only=True)
    trainer = resume(job, {k: v for k, v in start.items() if k != "time_ns"}, seed=7, until=3)
    return job, root, start, fingerprint(3, trainer.model, trainer.optimizer)


def test_the_replica_matches_the_trainers_fingerprint(sim, tmp_path):
    job, root, start, fp = sim
    app = appliance(job, root, tmp_path / "run", start)
    answer = app.attest(fp)
    assert answer["accepted"] and not answer["checked"]      # held until the replica reaches iteration 3
    app.run()
    status = app.status()
    assert status.attested == 1 and status.diverged == 0 and not app.replica.stale
    assert not [e for e in events(tmp_path / "run") if e["event"] in ("integrity.mismatch", "fallback")]


@pytest.mark.parametrize("change", ["exp_avg", "step"])
def test_a_trainer_that_differs_makes_the_replica_stale_with_an_event(sim, tmp_path, change):
    """A trainer state the replica does not hold (say, the trainer skipped a step, or took
    another learning rate): a fallback, and nothing after it is applied or snapshotted."""
    job, root, start, fp = sim
    wrong = copy.deepcopy(fp)
    if change == "step":
        wrong["step"] += 1
    else:
        wrong["params"]["layers.2.bias"]["exp_avg"] = "0" * 16
    app = appliance(job, root, tmp_path / "run", start)
    app.attest(wrong)
    app.run()
    got = events(tmp_path / "run")
    mismatch = [e for e in got if e["event"] == "integrity.mismatch"]
    assert len(mismatch) == 1 and mismatch[0]["iteration"] == 3
    assert mismatch[0]["what"] == ("step" if change == "step" else "exp_avg of layers.2.bias")
    assert (mismatch[0]["tensor"], mismatch[0]["state"]) == (("step", "step") if change == "step" else
                                                            ("layers.2.bias", "exp_avg"))
    # The mismatch comes first, then the fallback that asks the trainer for a checkpoint.
    kinds = [e["event"] for e in got if e["event"] in ("integrity.mismatch", "fallback")]
    assert kinds == ["integrity.mismatch", "fallback"]
    assert [e["iteration"] for e in got if e["event"] == "fallback"] == [3]
    assert [e["request"] for e in got if e["event"] == "fallback"] == ["regular_checkpoint"]
    assert app.status().diverged == 1 and app.replica.stale
    metrics = {(m.name, tuple(x.labels.items())): x.value for m in ApplianceCollector(app.status).collect()
               for x in m.samples}
    assert metrics[("gradtap_attestations", (("result", "mismatch"),))] == 1
    # Iterations 1 and 2 were applied and are the trainer's (digests); the replica went stale
    # as it reached the state of iteration 3, and nothing was snapshotted from then on.
    v = verify(tmp_path / "run", root / "truth", job_params(job))
    assert not v.differences and v.digests_checked == [1, 2] and 3 in v.stale, v
    assert v.snapshots_checked == [1]


def test_fingerprints_that_cannot_be_checked_are_refused_with_the_reason(sim, tmp_path):
    job, root, start, fp = sim
    app = appliance(job, root, tmp_path / "run", start)
    for bad, why in [({"format": "x"}, "not a gradtap-attest/1 fingerprint"),
                     ({**fp, "iteration": -1}, "iteration is -1"),
                     ({**fp, "params": {"w": {}}}, "not the job's in order"),
                     ({**fp, "params": {**fp["params"], "layers.0.bias": {"param": "zz"}}}, "16 hex digits")]:
        with pytest.raises(ConfigError, match=why):
            app.attest(bad)
    with pytest.raises(ConfigError, match="the replica is past that state"):
        app.attest({**fp, "iteration": 0})


def test_the_trainer_attests_over_the_control_endpoint(sim, tmp_path):
    job, root, start, fp = sim
    app = appliance(job, root, tmp_path / "run", start)
    settings = ControlSettings(tmp_path / "control.token", 1 << 20, port=0)
    with ControlServer(app.offer, app.status, settings, attest=app.attest) as server:
        attestor = Attestor(f"http://127.0.0.1:{server.port}", tmp_path / "control.token")
        assert attestor.send(fp)["iteration"] == 3
        with pytest.raises(RuntimeError, match="HTTP 400: .*the replica is past that state"):
            attestor.send({**fp, "iteration": 0})
        assert read_token(tmp_path / "control.token")
    app.run()
    assert app.status().attested == 1


def test_the_replica_fingerprint_reads_the_state_of_its_iteration(sim, tmp_path):
    """Independent of the trainer: the replica's fingerprint after the run is the ground
    truth's state after iteration 3 (``truth/iter_000003/state.npz``), sampled the same way."""
    job, root, start, _ = sim
    app = appliance(job, root, tmp_path / "run", start)
    app.run()
    with np.load(root / "truth" / "iter_000003" / "state.npz") as truth:
        arrays = [(p.name, {k: truth[f"{k}/{p.name}"].reshape(-1)[positions(p.numel)]
                            for k in ("param", "exp_avg", "exp_avg_sq")}) for p in job_params(job)]
        want = fingerprint_of(4, int(truth["step"]), arrays)
    assert app.attestations.fingerprint() == want
