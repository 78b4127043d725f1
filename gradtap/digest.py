"""The digest of an optimizer state: what a replay records after every iteration, and what
``gradtap verify`` recomputes from the ground truth, so that every iteration is checked and
not only the snapshots kept.

A digest is ``{"param": sha256, "exp_avg": sha256, "exp_avg_sq": sha256, "step": int}``: one
sha256 per kind of tensor, over that kind's float32 arrays in parameter order, and the step
count as it is. Two states are bit-identical exactly when their digests are equal, and when
they are not, the digest names which kind of tensor (or the step) differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

KINDS = ("param", "exp_avg", "exp_avg_sq")


def state_digest(tensors: Mapping[str, Sequence[np.ndarray]], step: int) -> dict:
    """The digest of ``tensors`` (kind -> one array per parameter, in parameter order) after ``step`` steps."""
    out: dict = {}
    for kind in KINDS:
        h = hashlib.sha256()
        for a in tensors[kind]:
            h.update(np.ascontiguousarray(a, np.float32))     # its buffer, not a copy
        out[kind] = h.hexdigest()
    out["step"] = int(step)
    return out


def replica_digest(replica) -> dict:
    """The digest of a :class:`gradtap.updater.replica.Replica` between iterations."""
    s, layout = replica.state, replica.layout
    views = {kind: [getattr(s, kind)[layout.param(i)] for i in range(len(layout.params))] for kind in KINDS}
    return state_digest(views, replica.step)


def truth_digest(state: Mapping[str, np.ndarray], names: Sequence[str]) -> dict:
    """The digest of a ground-truth state (``truth/iter_N/state.npz``: ``param/<name>``,
    ``exp_avg/<name>``, ``exp_avg_sq/<name>`` and ``step``) over parameters ``names``."""
    return state_digest({kind: [state[f"{kind}/{n}"] for n in names] for kind in KINDS}, int(state["step"]))
