"""The replica's state, flat in wire order, and its conversion to and from PyTorch state dicts.

Parameters, ``exp_avg`` and ``exp_avg_sq`` live in three flat float32 arrays laid out like
the gradient on the wire: buckets in launch order, each bucket's tensors densely in
buffer order (:class:`FlatLayout`). A bucket's state is then one contiguous slice that the
kernels update in a single call with the bucket's gradient buffer.

Going out, :func:`model_state_dict` and :func:`optimizer_state_dict` give exactly what a
trainer's ``model.state_dict()`` and ``torch.optim.Adam``/``AdamW``'s ``state_dict()`` hold:
the same keys (a tied weight under each of its names, sharing one tensor), parameter
shapes, ``step`` as a float32 0-d tensor, and ``param_groups`` as this torch builds them,
so ``model.load_state_dict`` and ``optimizer.load_state_dict`` take them as they are.
Coming in, :func:`from_checkpoint` reads the trainer's ``{"model", "optimizer",
"iteration"}`` dict and checks that it is the job's model and optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradtap.core.errors import ConfigError
from gradtap.core.heap import GiveBack
from gradtap.core.memory import aligned_bytes
from gradtap.updater.kernels import work_spans
from gradtap.workload.buckets import Bucket
from gradtap.workload.spec import OptimizerSpec, ParamSpec

TORCH_CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
TORCH_KWARGS = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


class FlatLayout:
    """Where each parameter and bucket sits in the flat state arrays (elements)."""

    def __init__(self, params: Sequence[ParamSpec], buckets: Sequence[Bucket]):
        covered = sorted(i for b in buckets for i in b.params)
        if covered != list(range(len(params))):
            raise ConfigError(f"buckets: must hold each of the {len(params)} parameters exactly once")
        self.params = tuple(params)
        self.buckets = tuple(buckets)
        self.bucket_start: list[int] = []
        self.param_start = [0] * len(params)
        start = 0
        for b in self.buckets:
            sizes = [self.params[i].numel for i in b.params]
            if list(b.offsets) != np.cumsum([0] + sizes[:-1]).tolist() or b.numel != sum(sizes):
                raise ConfigError(f"buckets[{b.index}]: offsets and numel do not lay its parameters "
                                  "out densely")
            self.bucket_start.append(start)
            for i, off in zip(b.params, b.offsets):
                self.param_start[i] = start + off
            start += b.numel
        self.total = start
        self._work: dict[tuple[int, str], np.ndarray] = {}
        self._spans: dict[int, np.ndarray] = {}

    def bucket(self, b: int) -> slice:
        return slice(self.bucket_start[b], self.bucket_start[b] + self.buckets[b].numel)

    def param(self, i: int) -> slice:
        return slice(self.param_start[i], self.param_start[i] + self.params[i].numel)

    def param_spans(self, b: int) -> np.ndarray:
        """int64[k, 2]: where each parameter of bucket ``b`` lies within the bucket (elements,
        in the bucket's order; made when first asked for, then kept)."""
        if b not in self._spans:
            bucket = self.buckets[b]
            sizes = [self.params[i].numel for i in bucket.params]
            self._spans[b] = np.array([(off, off + n) for off, n in zip(bucket.offsets, sizes)],
                                      np.int64).reshape(-1, 2)
        return self._spans[b]

    def work(self, b: int, implementation: str) -> np.ndarray:
        """The kernels' work list of bucket ``b`` (made for each bucket and implementation
        when first asked for, then kept)."""
        key = (b, implementation)
        if key not in self._work:
            self._work[key] = work_spans([self.params[i].numel for i in self.buckets[b].params], implementation,
                                         start=self.bucket_start[b])
        return self._work[key]


def aligned_empty(n: int) -> np.ndarray:
    """An uninitialised 1-D float32 array of ``n`` elements whose data starts on a cache line
    (``core.memory.aligned_bytes``): the work spans (``FlatLayout.work``) are cut on cache
    lines of arrays laid out like this."""
    return aligned_bytes(4 * n).view(np.float32)


@dataclass
class FlatState:
    """Everything that changes from step to step. ``iteration`` is the next iteration the
    replica expects; ``step`` the number of optimizer steps taken; ``lr`` the learning rate
    of the last step (what the trainer's ``param_groups`` show)."""

    param: np.ndarray
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray
    step: int
    iteration: int
    lr: float

    def copy(self) -> "FlatState":
        def copy(a: np.ndarray) -> np.ndarray:
            out = aligned_empty(a.size)
            out[:] = a
            return out

        return FlatState(copy(self.param), copy(self.exp_avg), copy(self.exp_avg_sq),
                         self.step, self.iteration, self.lr)


@dataclass(frozen=True)
class ModelKeys:
    """The keys of the model's ``state_dict`` in order: each a parameter index (a tied
    weight's second name maps to the same index) or a buffer, passed through unchanged
    (the replica sees only gradients, so buffers keep their initial value)."""

    keys: tuple[tuple[str, int | torch.Tensor], ...]


def _memory(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return t.data_ptr(), tuple(t.shape)


def model_keys(model_state: Mapping[str, torch.Tensor], params: Sequence[ParamSpec]) -> ModelKeys:
    """Map a ``state_dict``'s keys onto the parameter list; a tied weight's other names by
    the memory they share with it (same address and shape)."""
    index = {p.name: i for i, p in enumerate(params)}
    by_memory = {_memory(model_state[p.name]): i for i, p in enumerate(params) if p.name in model_state}
    missing = [p.name for p in params if p.name not in model_state]
    if missing:
        raise ConfigError(f"checkpoint model state_dict lacks parameters {missing[:3]} "
                          f"({len(missing)} of {len(params)}); is it this job's model?")
    keys: list[tuple[str, int | torch.Tensor]] = []
    for key, tensor in model_state.items():
        i = index.get(key)
        if i is None:
            i = by_memory.get(_memory(tensor)) if tensor.numel() else None
        keys.append((key, i if i is not None else tensor.detach().clone()))
    return ModelKeys(tuple(keys))


def _check_tensor(what: str, t: Any, spec: ParamSpec) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(spec.shape) or t.dtype != torch.float32:
        got = (type(t).__name__, tuple(getattr(t, "shape", ())), getattr(t, "dtype", None))
        raise ConfigError(f"checkpoint {what} of {spec.name!r} is {got}; the job says "
                          f"{tuple(spec.shape)} float32")


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy().reshape(-1)


def from_checkpoint(checkpoint: Mapping[str, Any], layout: FlatLayout, cfg: OptimizerSpec, *,
                    consume: bool = False) -> tuple[FlatState, ModelKeys]:
    """The flat state of a trainer checkpoint ``{"model", "optimizer", "iteration"}``.

    The optimizer state must be empty (no step taken) or hold ``step``, ``exp_avg`` and
    ``exp_avg_sq`` for every parameter with one common step; its hyperparameters must be
    the job's (a replica with other betas or weight decay could never be exact). Everything
    is checked before anything is copied.

    ``consume``: the caller hands the checkpoint over, and each parameter and moment tensor
    leaves it once copied, so that the checkpoint's tensors and the flat state (12 bytes per
    parameter each) are not both held at once. Other references to the tensors keep them. The
    heap's free pages go back to the system as the tensors leave (``core/heap.py``): glibc
    keeps a freed tensor of the heap resident otherwise.
    """
    for key in ("model", "optimizer"):
        if key not in checkpoint:
            raise ConfigError(f"checkpoint has no {key!r} entry; expected the dict "
                              "{'model': state_dict, 'optimizer': state_dict, 'iteration': k}")
    params = layout.params
    model = checkpoint["model"]
    keys = model_keys(model, params)
    for spec in params:
        _check_tensor("parameter", model[spec.name], spec)
    optimizer = checkpoint["optimizer"]
    groups = optimizer.get("param_groups", [])
    if len(groups) != 1 or list(groups[0].get("params", [])) != list(range(len(params))):
        raise ConfigError(f"checkpoint optimizer: expected one param group over parameters "
                          f"0..{len(params) - 1} (the model's parameters in order)")
    group = groups[0]
    for name, want in (("betas", tuple(cfg.betas)), ("eps", cfg.eps), ("weight_decay", cfg.weight_decay),
                       ("amsgrad", False), ("maximize", False)):
        got = tuple(group.get(name, ())) if name == "betas" else group.get(name)
        if got != want:
            raise ConfigError(f"checkpoint optimizer: {name} is {got!r} but the job's optimizer has {want!r}")
    state = optimizer.get("state", {})
    steps = set()
    for i, spec in enumerate(params if state else ()):
        entry = state.get(i)
        if entry is None:
            raise ConfigError(f"checkpoint optimizer: parameter {i} ({spec.name!r}) has no state "
                              "while others do")
        steps.add(float(entry["step"]))
        _check_tensor("exp_avg", entry["exp_avg"], spec)
        _check_tensor("exp_avg_sq", entry["exp_avg_sq"], spec)
    if len(steps) > 1:
        raise ConfigError(f"checkpoint optimizer: parameters are at different steps {sorted(steps)[:4]}")

    flat = [aligned_empty(layout.total) for _ in range(3)]
    given = GiveBack()
    # One kind at a time (parameters, then each moment): a checkpoint whose tensors are views
    # of one flat array per kind (``Replica.state_dict(copy=False)``) frees each array once
    # its last view leaves, so that consuming it holds 16 bytes per parameter at most, not 24.
    # A tied weight's other names (GPT-2's ``lm_head.weight``) leave with it: they hold its memory.
    kinds = [[(model, spec.name) for spec in params]]
    kinds += [[(state[i], name) for i in range(len(params))] for name in ("exp_avg", "exp_avg_sq") if state]
    aliases = [(key, ref) for key, ref in keys.keys if isinstance(ref, int) and key != params[ref].name]
    for k, sources in enumerate(kinds):
        for i, (holder, key) in enumerate(sources):
            flat[k][layout.param(i)] = _flat(holder[key])
            if consume:
                given.freed(holder.pop(key).nbytes)
                if k == 0:
                    for alias in [a for a, ref in aliases if ref == i]:
                        del holder[alias]
    if not state:
        flat[1][:] = 0
        flat[2][:] = 0
    step = int(steps.pop()) if steps else 0
    return FlatState(*flat, step=step, iteration=int(checkpoint.get("iteration", step)),
                     lr=float(group["lr"])), keys


def model_state_dict(keys: ModelKeys, layout: FlatLayout, param: np.ndarray) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` of the replica's parameters ``param`` (tensors share its memory)."""
    views = {}
    out = {}
    for key, ref in keys.keys:
        if isinstance(ref, torch.Tensor):
            out[key] = ref
            continue
        if ref not in views:
            spec = layout.params[ref]
            views[ref] = torch.from_numpy(param[layout.param(ref)]).view(spec.shape)
        out[key] = views[ref]
    return out


def param_group(cfg: OptimizerSpec, n_params: int, lr: float) -> dict[str, Any]:
    """The one ``param_groups`` entry this torch's Adam/AdamW would hold for ``cfg``."""
    probe = torch.nn.Parameter(torch.zeros(1))
    optimizer = TORCH_CLASSES[cfg.kind]([probe], lr=lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                        weight_decay=cfg.weight_decay, **TORCH_KWARGS[cfg.implementation])
    group = dict(optimizer.state_dict()["param_groups"][0])
    group["params"] = list(range(n_params))
    return group


def optimizer_state_dict(cfg: OptimizerSpec, layout: FlatLayout, state: FlatState) -> dict[str, Any]:
    """``optimizer.state_dict()`` of the replica (moment tensors share ``state``'s memory)."""
    per_param = {}
    if state.step:
        for i, spec in enumerate(layout.params):
            per_param[i] = {
                "step": torch.tensor(float(state.step), dtype=torch.float32),
                "exp_avg": torch.from_numpy(state.exp_avg[layout.param(i)]).view(spec.shape),
                "exp_avg_sq": torch.from_numpy(state.exp_avg_sq[layout.param(i)]).view(spec.shape),
            }
    return {"state": per_param, "param_groups": [param_group(cfg, len(layout.params), state.lr)]}
