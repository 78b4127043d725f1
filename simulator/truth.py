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
import io
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


class _HashingFile:
    """A file written front to back, hashed (sha256) as it is written."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()
        self.data_bytes = 0      # bytes after the header, counted by the writer

    def write(self, data) -> None:
        self.h.update(data)
        self.f.write(data)

    def close(self) -> None:
        self.f.close()

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class TruthWriter:
    def __init__(self, root: Path, job: JobSpec, seed: int):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.job, self.seed = job, seed
        self.files: dict[str, str] = {}
        self.iterations: list[int] = []
        self.spans: dict[int, tuple[int, int]] = {}
        self._grad: tuple | None = None       # the open grad.npy: (iteration, dtype, numel, file)

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
        """All of one iteration's files at once: :meth:`begin_iteration`, :meth:`add_gradient`
        of each bucket, :meth:`end_iteration`."""
        self.begin_iteration(iteration, sum(len(r) for r in reduced), reduced[0].dtype)
        for r in reduced:
            self.add_gradient(r)
        self.end_iteration(iteration, model, optimizer, span_ns)

    def begin_iteration(self, iteration: int, numel: int, dtype: np.dtype) -> None:
        """Open ``iter_NNNNNN/grad.npy`` for ``numel`` elements of ``dtype``, to be filled
        bucket by bucket (:meth:`add_gradient`) as the reduction produces them. The file is
        what ``np.save`` writes of the concatenated buckets; it is hashed as it is written."""
        if self._grad is not None:
            raise RuntimeError(f"iteration {self._grad[0]} of the truth is not ended")
        d = iteration_dir(self.root, iteration)
        d.mkdir(exist_ok=True)
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                      "fortran_order": False, "shape": (numel,)})
        f = _HashingFile((d / "grad.npy").open("wb"))
        f.write(header.getvalue())
        self._grad = (iteration, np.dtype(dtype), numel, f)

    def add_gradient(self, reduced: np.ndarray) -> None:
        """Append one bucket's reduced values (the next in launch order) to grad.npy."""
        iteration, dtype, numel, f = self._grad
        if reduced.dtype != dtype or reduced.ndim != 1:
            raise ValueError(f"iteration {iteration}: a bucket of {reduced.dtype} {reduced.shape} in a "
                             f"gradient of {dtype}")
        data = memoryview(np.ascontiguousarray(reduced)).cast("B")
        f.write(data)
        f.data_bytes += len(data)

    def end_iteration(self, iteration: int, model, optimizer, span_ns: tuple[int, int]) -> None:
        """Close grad.npy (all its elements written) and save the trainer's state after the
        step (``state.npz``) from the live tensors: call before the next optimizer step."""
        it, dtype, numel, f = self._grad
        if it != iteration or f.data_bytes != numel * dtype.itemsize:
            raise ValueError(f"iteration {iteration}: grad.npy of iteration {it} holds "
                             f"{f.data_bytes // dtype.itemsize} of {numel} elements")
        f.close()
        self._grad = None
        d = iteration_dir(self.root, iteration)
        self.files[str((d / "grad.npy").relative_to(self.root))] = f.hexdigest()
        np.savez(d / "state.npz", **optimizer_arrays(model, optimizer, copy=False))
        self._record(d / "state.npz")
        self.iterations.append(iteration)
        self.spans[iteration] = span_ns

    def close(self) -> None:
        manifest = {"job": self.job.name, "seed": self.seed, "iterations": self.iterations,
                    "span_ns": {str(i): list(span) for i, span in self.spans.items()}, "sha256": self.files}
        (self.root / "manifest.json").write_text(json.dumps(manifest, indent=1))
