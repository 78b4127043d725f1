"""Is the replica the trainer? Bit for bit, against the simulator's ground truth.

A replay directory holds ``iterations.jsonl`` (one line per merged iteration, with the
replica's state digest after every applied one: ``gradtap/digest.py``) and ``snapshots/``.
The ground truth (``truth/``) holds the trainer's state after every captured iteration.
:func:`verify` checks that

- every captured iteration from the replica's first has its line, and every line's
  iteration was captured (iterations captured before the trainer's checkpoint the replica
  began from, which it never applies, are listed as :attr:`Verification.before_start`);
- every digest equals the truth's (a difference names the kind of tensor, or the step);
- every snapshot kept is the truth's job, holds the iteration its directory names, and
  equals the truth tensor by tensor (a difference names the first differing tensor and
  element, or the step);
- ``LATEST`` names the newest snapshot kept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gradtap.core.errors import GradtapError
from gradtap.digest import KINDS, truth_digest
from gradtap.simulator.truth import iteration_dir
from gradtap.store import snapshot
from gradtap.workload.spec import ParamSpec


@dataclass
class Difference:
    """One way the replica is not the trainer after ``iteration``. ``detail``, when given,
    says what is wrong in words; otherwise ``what`` differs (at ``index``, with the values)."""

    iteration: int
    what: str                 # e.g. "exp_avg of fc1.weight", "step", "snapshots/LATEST"
    index: tuple[int, ...] | None = None
    replica: float | int | None = None
    truth: float | int | None = None
    detail: str | None = None

    def __str__(self) -> str:
        if self.detail is not None:
            return f"iteration {self.iteration}: {self.what} {self.detail}"
        at = f" at {list(self.index)}" if self.index is not None else ""
        values = f": replica {self.replica!r}, truth {self.truth!r}" if self.replica is not None else ""
        return f"iteration {self.iteration}: {self.what} differs{at}{values}"


@dataclass
class Verification:
    digests_checked: list[int] = field(default_factory=list)
    snapshots_checked: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)          # iterations the replica did not apply
    before_start: list[int] = field(default_factory=list)   # captured before the replica began (no line)
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences and bool(self.digests_checked or self.snapshots_checked)


def _describe(key: str) -> str:
    """``param/fc1.weight`` -> ``value of fc1.weight``; ``exp_avg/x`` -> ``exp_avg of x``; ``step``."""
    kind, _, name = key.partition("/")
    return key if not name else f"{'value' if kind == 'param' else kind} of {name}"


def first_difference(iteration: int, what: str, replica: np.ndarray, truth: np.ndarray) -> Difference | None:
    """Where two float32 tensors first differ bit for bit (None when identical)."""
    replica, truth = np.asarray(replica, np.float32), np.asarray(truth, np.float32)
    if replica.shape != truth.shape:
        return Difference(iteration, what, detail=f"has shape {replica.shape}, the truth {truth.shape}")
    differ = replica.view(np.uint32) != truth.view(np.uint32)
    if not differ.any():
        return None
    index = np.unravel_index(int(np.flatnonzero(differ.reshape(-1))[0]), replica.shape)
    return Difference(iteration, what, tuple(int(i) for i in index), float(replica[index]), float(truth[index]))


def compare_state(iteration: int, replica: Mapping[str, np.ndarray],
                  truth: Mapping[str, np.ndarray]) -> Difference | None:
    """The first difference between two optimizer states keyed as the ground truth keys them
    (``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, ``step``), in the truth's
    order; None when the replica holds every tensor of the truth, bit for bit."""
    for key, want in truth.items():
        what = _describe(key)
        if key not in replica:
            return Difference(iteration, what, detail="is missing")
        if key == "step":
            if int(replica[key]) != int(want):
                return Difference(iteration, what, replica=int(replica[key]), truth=int(want))
            continue
        d = first_difference(iteration, what, replica[key], want)
        if d is not None:
            return d
    return None


def _truth_state(truth: Path, iteration: int) -> dict[str, np.ndarray]:
    path = iteration_dir(truth, iteration) / "state.npz"
    try:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    except OSError as exc:
        raise GradtapError(f"{path}: no ground truth for iteration {iteration} ({exc.strerror or exc})") from None


def _truth_manifest(truth: Path) -> dict:
    try:
        return json.loads((truth / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise GradtapError(f"{truth}: no readable manifest.json; is it the truth/ of `gradtap simulate`? "
                           f"({exc})") from None


def compare_digest(iteration: int, replica: Mapping, truth: Mapping) -> list[Difference]:
    """Every kind of tensor (and the step) whose digest differs."""
    out = [Difference(iteration, f"{kind} (digest over every parameter)") for kind in KINDS
           if replica.get(kind) != truth[kind]]
    if replica.get("step") != truth["step"]:
        out.append(Difference(iteration, "step", replica=replica.get("step"), truth=truth["step"]))
    return out


def compare_snapshot(path: Path, truth: Path, params: tuple[ParamSpec, ...],
                     job: str | None = None) -> tuple[int, Difference | None]:
    """``(iteration, first difference or None)`` of one snapshot against the truth; ``job``:
    the job the snapshot must belong to."""
    state = snapshot.load(path)
    done = state["iteration"] - 1            # the snapshot is ready for `iteration`
    if path.name != snapshot.snapshot_name(state["iteration"]):
        return done, Difference(done, f"snapshot {path.name}", detail=f"holds iteration {state['iteration']}")
    owner = json.loads((path / "manifest.json").read_text()).get("job")
    if job is not None and owner != job:
        return done, Difference(done, f"snapshot {path.name}", detail=f"is of job {owner!r}, not {job!r}")
    t = _truth_state(truth, done)
    opt = state["optimizer"]["state"]
    arrays: dict[str, np.ndarray] = {}
    for i, p in enumerate(params):
        if p.name in state["model"]:
            arrays[f"param/{p.name}"] = state["model"][p.name].numpy()
        if i in opt:
            arrays[f"exp_avg/{p.name}"] = opt[i]["exp_avg"].numpy()
            arrays[f"exp_avg_sq/{p.name}"] = opt[i]["exp_avg_sq"].numpy()
    d = compare_state(done, arrays, {k: v for k, v in t.items() if k != "step"})
    if d is not None:
        return done, d
    for i, p in enumerate(params):
        if i in opt and int(opt[i]["step"]) != int(t["step"]):
            return done, Difference(done, f"step of {p.name}", replica=int(opt[i]["step"]), truth=int(t["step"]))
    return done, None


def _check_snapshots(directory: Path, truth: Path, params: tuple[ParamSpec, ...], job: str,
                     result: Verification) -> None:
    paths = sorted(directory.glob(snapshot.PREFIX + "*")) if directory.exists() else []
    for path in paths:
        try:
            done, d = compare_snapshot(path, truth, params, job)
        except GradtapError as exc:          # incomplete, or not what its manifest says
            done = int(path.name.removeprefix(snapshot.PREFIX)) - 1
            d = Difference(done, f"snapshot {path.name}", detail=f"is unreadable: {exc}")
        result.snapshots_checked.append(done)
        if d is not None:
            result.differences.append(d)
    if paths:
        try:
            latest = (directory / snapshot.LATEST).read_text().strip()
        except OSError:
            latest = None
        if latest != paths[-1].name:
            result.differences.append(Difference(
                result.snapshots_checked[-1], f"snapshots/{snapshot.LATEST}",
                detail=f"names {latest or 'nothing'}, not the newest snapshot {paths[-1].name}"))


def verify(replay_dir: Path, truth: Path, params: tuple[ParamSpec, ...]) -> Verification:
    """Compare the output of a replay (or a run with digests) in ``replay_dir`` with the
    simulator's ``truth``; ``params``: the job's parameters (``job_params``)."""
    result = Verification()
    lines_path = replay_dir / "iterations.jsonl"
    if not lines_path.exists():
        raise GradtapError(f"{replay_dir}: no iterations.jsonl; is it the --out directory of `gradtap replay`?")
    manifest = _truth_manifest(truth)
    captured = set(manifest["iterations"])
    names = [p.name for p in params]
    seen = set()
    for line in lines_path.read_text().splitlines():
        rec = json.loads(line)
        it = rec["iteration"]
        seen.add(it)
        if it not in captured:
            result.differences.append(Difference(it, "iterations.jsonl", detail="has a line for an iteration "
                                                                                "the ground truth does not hold"))
            continue
        if not rec["recovered"] or rec["stale"]:
            result.stale.append(it)
        if "digest" in rec:
            result.digests_checked.append(it)
            result.differences += compare_digest(it, rec["digest"], truth_digest(_truth_state(truth, it), names))
    first = min(seen, default=None)
    result.before_start = sorted(it for it in captured - seen if first is not None and it < first)
    result.differences += [Difference(it, "iterations.jsonl", detail="has no line for this captured iteration")
                           for it in sorted(captured - seen - set(result.before_start))]
    _check_snapshots(replay_dir / "snapshots", truth, params, manifest["job"], result)
    result.differences.sort(key=lambda d: d.iteration)
    return result
