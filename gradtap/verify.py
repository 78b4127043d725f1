"""Is the replica the trainer? Bit for bit, against the simulator's ground truth.

A replay directory holds ``iterations.jsonl`` (one line per merged iteration, with a digest of
the replica's state after every applied one) and ``snapshots/``. The ground truth
(``truth/``) holds the trainer's state after every iteration. Every digest is compared with
the truth's, and every snapshot kept is compared tensor by tensor, so that a difference is
reported with the first differing tensor and element.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradtap.core.errors import GradtapError
from gradtap.replica_sink import state_digest
from gradtap.updater import snapshot
from gradtap.workload.spec import ParamSpec


@dataclass
class Difference:
    iteration: int
    what: str                 # e.g. "exp_avg of fc1.weight", or "state digest"
    index: tuple[int, ...] | None = None
    replica: float | None = None
    truth: float | None = None

    def __str__(self) -> str:
        at = f" at {list(self.index)}" if self.index is not None else ""
        values = f": replica {self.replica!r}, truth {self.truth!r}" if self.replica is not None else ""
        return f"iteration {self.iteration}: {self.what} differs{at}{values}"


@dataclass
class Verification:
    digests_checked: list[int] = field(default_factory=list)
    snapshots_checked: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)          # iterations the replica did not apply
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences and bool(self.digests_checked or self.snapshots_checked)


def _truth_state(truth: Path, iteration: int) -> dict[str, np.ndarray]:
    path = truth / f"iter_{iteration:06d}" / "state.npz"
    try:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    except OSError as exc:
        raise GradtapError(f"{path}: no ground truth for iteration {iteration} ({exc.strerror or exc})") from None


def truth_digest(state: dict[str, np.ndarray], params: tuple[ParamSpec, ...]) -> str:
    names = [p.name for p in params]
    return state_digest([state[f"param/{n}"] for n in names], [state[f"exp_avg/{n}"] for n in names],
                        [state[f"exp_avg_sq/{n}"] for n in names], int(state["step"]))


def _first_difference(iteration: int, what: str, replica: np.ndarray, truth: np.ndarray) -> Difference | None:
    replica, truth = np.asarray(replica, np.float32), np.asarray(truth, np.float32)
    if replica.shape != truth.shape:
        return Difference(iteration, f"{what} (shape {replica.shape} vs {truth.shape})")
    differ = replica.view(np.uint32) != truth.view(np.uint32)
    if not differ.any():
        return None
    index = np.unravel_index(int(np.flatnonzero(differ.reshape(-1))[0]), replica.shape)
    return Difference(iteration, what, tuple(int(i) for i in index), float(replica[index]), float(truth[index]))


def compare_snapshot(path: Path, truth: Path, params: tuple[ParamSpec, ...]) -> tuple[int, Difference | None]:
    """``(iteration, first difference or None)`` of one snapshot against the truth."""
    state = snapshot.load(path)
    done = state["iteration"] - 1            # the snapshot is ready for `iteration`
    t = _truth_state(truth, done)
    opt = state["optimizer"]["state"]
    for i, p in enumerate(params):
        checks = [("value", state["model"][p.name].numpy(), t[f"param/{p.name}"])]
        if i in opt:
            checks += [("exp_avg", opt[i]["exp_avg"].numpy(), t[f"exp_avg/{p.name}"]),
                       ("exp_avg_sq", opt[i]["exp_avg_sq"].numpy(), t[f"exp_avg_sq/{p.name}"])]
        for what, replica, truth_value in checks:
            d = _first_difference(done, f"{what} of {p.name}", replica, truth_value)
            if d is not None:
                return done, d
        if i in opt and int(opt[i]["step"]) != int(t["step"]):
            return done, Difference(done, f"step of {p.name}", None, float(opt[i]["step"]), float(t["step"]))
    return done, None


def verify(replay_dir: Path, truth: Path, params: tuple[ParamSpec, ...]) -> Verification:
    result = Verification()
    lines_path = replay_dir / "iterations.jsonl"
    if not lines_path.exists():
        raise GradtapError(f"{replay_dir}: no iterations.jsonl; is it the --out directory of `gradtap replay`?")
    for line in lines_path.read_text().splitlines():
        rec = json.loads(line)
        if not rec["recovered"] or rec["stale"]:
            result.stale.append(rec["iteration"])
        if "digest" not in rec:
            continue
        want = truth_digest(_truth_state(truth, rec["iteration"]), params)
        result.digests_checked.append(rec["iteration"])
        if rec["digest"] != want:
            result.differences.append(Difference(rec["iteration"], "state digest"))
    snapshots = replay_dir / "snapshots"
    for path in sorted(snapshots.glob(snapshot.PREFIX + "*")) if snapshots.exists() else []:
        done, d = compare_snapshot(path, truth, params)
        result.snapshots_checked.append(done)
        if d is not None:
            result.differences.append(d)
    result.differences.sort(key=lambda d: d.iteration)
    return result
