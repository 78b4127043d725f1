"""The learning-rate schedule of a job, evaluated exactly as the trainer evaluates it.

The trainer (``simulator/training.py``) and the updater's replica both take their learning
rate from here, so the float64 expression that becomes Adam's ``lr`` is the same function
in both: a replica that computed the same schedule in another order would drift in the last
bit of ``lr`` and stop being bit-exact.
"""

from __future__ import annotations

import math
from typing import Any

from gradtap.core.errors import ConfigError


def lr_factor(schedule: Any, step: int) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based).

    ``constant``: 1. ``warmup_cosine``: ``(step + 1) / warmup_steps`` during warm-up,
    then ``m + (1 - m) * 0.5 * (1 + cos(pi * p))`` with ``m = min_lr_ratio`` and
    ``p = min(1, (step - warmup_steps) / (total_steps - warmup_steps))`` (``p = 1`` when
    there are no decay steps). Evaluated in Python floats, in this order: the updater's
    replica must evaluate the same expression to stay bit-exact. Equivalent to
    ``LambdaLR(optimizer, lambda s: lr_factor(schedule, s))`` stepped after every
    ``optimizer.step()``.
    """
    if schedule.kind == "constant":
        return 1.0
    if schedule.kind != "warmup_cosine":
        raise ConfigError(f"optimizer.schedule.kind: {schedule.kind!r} is not one of "
                          "'constant', 'warmup_cosine'")
    if step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    decay_steps = schedule.total_steps - schedule.warmup_steps
    progress = min(1.0, (step - schedule.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    m = schedule.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(optimizer_cfg: Any, step: int) -> float:
    """``optimizer_cfg.lr * lr_factor(optimizer_cfg.schedule, step)``: the ``lr`` of the
    optimizer step of iteration ``step``."""
    return optimizer_cfg.lr * lr_factor(optimizer_cfg.schedule, step)
