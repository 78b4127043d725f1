"""Trainer checkpoints the shell loads: the one a replica starts from, and the ones handed to
it for a resync.

A trainer checkpoint is ``{"model": state_dict, "optimizer": state_dict, "iteration": k}``
(``torch.save``d by the trainer, or the simulator's ``truth/start.pt``); a gradtap snapshot
directory holds the same as its ``model.pt``/``optimizer.pt`` pair.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from gradtap.core.errors import ConfigError
from gradtap.updater import snapshot
from gradtap.updater.replica import seed_checkpoint
from gradtap.workload.spec import JobSpec


def _load(path: Path, what: str) -> dict:
    try:
        checkpoint = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{what} {path}: cannot load a trainer checkpoint ({reason})") from None
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "iteration"} <= set(checkpoint):
        raise ConfigError(f"{what} {path}: not a trainer checkpoint (a dict of model, optimizer and iteration)")
    return checkpoint


def start_checkpoint(job: JobSpec, path: Path | None) -> dict:
    """The checkpoint at ``path`` (``--start``), else the job's ``initial_state``: its
    checkpoint file, or the model built under its seed."""
    path = path or job.initial_state.checkpoint
    if path is None:
        return seed_checkpoint(job, job.initial_state.seed or 0)
    return _load(Path(path), "--start")


def load_checkpoint(path: Path) -> dict:
    """A trainer checkpoint file, or a gradtap snapshot directory, to resynchronise from
    (``GradtapError`` naming the path when it is neither)."""
    if path.is_dir():
        return snapshot.load(path)
    return _load(path, "checkpoint")
