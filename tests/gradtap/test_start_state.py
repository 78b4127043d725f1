"""The start state names the iteration a capture starts at, and must be one the job's traffic
can start at: a job in DDP's rebuilt bucket layout is never at iteration 0 on the wire."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradtap.checkpoints import start_checkpoint
from gradtap.core.errors import ConfigError
from gradtap.workload.spec import load_job

ROOT = Path(__file__).resolve().parents[2]


def test_a_rebuilt_job_refuses_a_start_at_iteration_0():
    job = load_job(ROOT / "configs" / "small.yaml")
    assert job.ddp.layout == "rebuilt" and job.initial_state.checkpoint is None
    with pytest.raises(ConfigError) as err:
        start_checkpoint(job, None)
    message = str(err.value)
    assert "initial_state (seed 0)" in message and "ddp.layout 'rebuilt'" in message and "--start" in message


def test_a_start_checkpoint_of_iteration_0_is_refused_too(tmp_path):
    job = load_job(ROOT / "configs" / "small.yaml")
    initial = job.model_copy(update={"ddp": job.ddp.model_copy(update={"layout": "initial"})})
    state = start_checkpoint(initial, None)          # iteration 0: right for the initial layout
    assert state["iteration"] == 0
    torch.save(state, tmp_path / "zero.pt")
    with pytest.raises(ConfigError, match=r"--start .*zero.pt: the start state is iteration 0"):
        start_checkpoint(job, tmp_path / "zero.pt")
    state["iteration"] = 1                           # the trainer's state after iteration 0
    torch.save(state, tmp_path / "one.pt")
    assert start_checkpoint(job, tmp_path / "one.pt")["iteration"] == 1


def test_the_simulators_job_names_the_state_its_capture_starts_from(tmp_path, monkeypatch):
    """``gradtap simulate``'s job.yaml names truth/start.pt (relative to itself), so a replay of
    it needs no --start, from any working directory."""
    from gradtap.replay import run_replay
    from gradtap.verify import verify
    from gradtap.workload.layout import job_params
    from tests.gradtap.test_replay import streams_of
    from tests.simulator.test_simulate import make_job, simulate

    job = make_job(2, "LL", 1, "fp32")
    assert job.ddp.layout == "rebuilt"
    simulate(tmp_path / "sim", job, iterations=2)
    monkeypatch.chdir(tmp_path / "sim" / "streams")
    written = load_job(tmp_path / "sim" / "job.yaml")
    assert written.initial_state.checkpoint == tmp_path / "sim" / "truth" / "start.pt"
    start = start_checkpoint(written, None)
    assert start["iteration"] == 1
    run_replay(written, streams_of(tmp_path / "sim", job), tmp_path / "replay", start)
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and v.digests_checked == [1, 2], v


def test_a_simulation_from_its_own_job_yaml_captures_the_same_iterations(tmp_path):
    """Simulating the job.yaml a simulation wrote (which starts from its start.pt, iteration 1)
    captures iterations 1 and 2 again, not 2 and 3."""
    import json

    from tests.simulator.test_simulate import make_job, simulate

    simulate(tmp_path / "a", make_job(2, "LL", 1, "fp32"), iterations=2)
    simulate(tmp_path / "b", load_job(tmp_path / "a" / "job.yaml"), iterations=2)
    for d in ("a", "b"):
        assert json.loads((tmp_path / d / "truth" / "manifest.json").read_text())["iterations"] == [1, 2]
    for it in (1, 2):
        grads = [(tmp_path / d / "truth" / f"iter_{it:06d}" / "grad.npy").read_bytes() for d in ("a", "b")]
        assert grads[0] == grads[1]
