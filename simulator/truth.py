"""The simulator's ground truth: what the replica must equal, iteration by iteration.

Layout of ``truth/`` (documented in the README):

- ``layout.json``: the bucket layout on the wire: for each bucket in launch order, its
  parameters (name, shape, element offset in the bucket) and its element offset in the flat
  gradient; the wire dtype; the first captured iteration.
- ``start.pt``: the trainer's state before the first captured iteration, as
  ``{"model": state_dict, "optimizer": state_dict, "iteration": k, "time_ns": t}``
  (``torch.load``), ``t`` the simulated time at which it was the trainer's state (the
  capture begins then).
- ``iter_NNNNNN/grad.npy``: the fully reduced gradient of that iteration as one flat array
  in the wire dtype (bf16 as its uint16 bit patterns), buckets concatenated in launch order.
- ``iter_NNNNNN/state.npz``: parameters, ``exp_avg``, ``exp_avg_sq`` (keys
  ``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, float32) and ``step`` after
  that iteration's optimizer step (``numpy.load``).
- ``manifest.json``: job name, seed, iterations, each iteration's span on the simulated clock
  (``span_ns``: first frame to the start of the next iteration, ns since the epoch), and the
  sha256 of every file above.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from gradtap.workload.buckets import Bucket
from gradtap.workload.layout import layout_document
from gradtap.workload.spec import JobSpec, ParamSpec


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def iteration_dir(truth: Path, iteration: int) -> Path:
    return truth / f"iter_{iteration:06d}"


def optimizer_arrays(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                     copy: bool = True) -> dict[str, np.ndarray]:
    """The trainer's parameters and Adam moments as named float32 arrays: copies, or with
    ``copy=False`` views of the live tensors (valid until the next optimizer step; what a
    writer that saves them at once needs, without 3 x 4 bytes per parameter of copies)."""
    out: dict[str, np.ndarray] = {}
    step = 0
    own = np.copy if copy else np.asarray
    for name, p in model.named_parameters():
        out[f"param/{name}"] = own(p.detach().numpy())
        state = optimizer.state.get(p, {})
        if state:
            out[f"exp_avg/{name}"] = own(state["exp_avg"].numpy())
            out[f"exp_avg_sq/{name}"] = own(state["exp_avg_sq"].numpy())
            step = int(state["step"])
    out["step"] = np.array(step, np.int64)
    return out


class TruthWriter:
    def __init__(self, root: Path, job: JobSpec, seed: int):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.job, self.seed = job, seed
        self.files: dict[str, str] = {}
        self.iterations: list[int] = []
        self.spans: dict[int, tuple[int, int]] = {}

    def _record(self, path: Path) -> None:
        self.files[str(path.relative_to(self.root))] = _sha256(path)

    def layout(self, params: tuple[ParamSpec, ...], buckets: tuple[Bucket, ...], wire_dtype: str,
               first_iteration: int) -> None:
        path = self.root / "layout.json"
        path.write_text(json.dumps(layout_document(params, buckets, wire_dtype, first_iteration), indent=1))
        self._record(path)

    def start(self, state: dict) -> None:
        path = self.root / "start.pt"
        torch.save(state, path)
        self._record(path)

    def iteration(self, iteration: int, reduced: tuple[np.ndarray, ...], model, optimizer,
                  span_ns: tuple[int, int]) -> None:
        d = iteration_dir(self.root, iteration)
        d.mkdir(exist_ok=True)
        np.save(d / "grad.npy", np.concatenate(reduced))
        np.savez(d / "state.npz", **optimizer_arrays(model, optimizer, copy=False))
        self._record(d / "grad.npy")
        self._record(d / "state.npz")
        self.iterations.append(iteration)
        self.spans[iteration] = span_ns

    def close(self) -> None:
        manifest = {"job": self.job.name, "seed": self.seed, "iterations": self.iterations,
                    "span_ns": {str(i): list(span) for i, span in self.spans.items()}, "sha256": self.files}
        (self.root / "manifest.json").write_text(json.dumps(manifest, indent=1))
