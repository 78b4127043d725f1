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
