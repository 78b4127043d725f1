"""Data-parallel training of N ranks inside one process, gradient-exact with DDP.

All data-parallel ranks hold identical parameters, so one model replica suffices: each
iteration runs forward and backward once per rank on that rank's data shard and captures
the rank's gradient as the flat DDP bucket buffers it would put on the wire. An injected
``allreduce`` (the NCCL-order ring arithmetic) combines the ranks' buffers bucket by
bucket; the result is scattered back into ``.grad`` exactly as DDP does, and the real
``torch.optim.Adam``/``AdamW`` steps the replica.

What DDP (torch 2.13.0) puts in a bucket, per wire dtype (``reducer.cpp``
``mark_variable_ready_dense``/``finalize_bucket_dense``, and
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``):

==========  ===========  =========================================  =====================================
wire dtype  predivide    wire buffer of rank r                      gradient after the allreduce
==========  ===========  =========================================  =====================================
fp32        yes          ``torch.mul(g_r, 1.0 / N)`` (no comm       ``reduced`` as is
                         hook: the reducer multiplies by the
                         reciprocal while copying into the bucket)
fp32        no           ``g_r``                                    ``reduced / N`` (float32 division)
bf16, fp16  yes          ``g_r.to(dtype).div_(N)`` (division in     ``reduced`` cast to float32
                         the low dtype: ``bf16_compress_hook`` /
                         ``fp16_compress_hook``)
bf16, fp16  no           ``g_r.to(dtype)``                          ``reduced`` cast to float32, ``/ N``
==========  ===========  =========================================  =====================================

``g_r`` is rank r's local gradient (float32); "no" describes a comm hook that allreduces
the plain sum and divides the decompressed result. Multiplying by the reciprocal differs
from dividing in the last bit when N is not a power of two. The reciprocal form assumes
every backward pass starts from ``.grad = None`` (``optimizer.zero_grad()``'s default):
with ``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=False)`` DDP divides
(``div_``) instead.

After the allreduce: optional ``torch.nn.utils.clip_grad_norm_(model.parameters(),
max_norm)`` (its defaults otherwise), the learning rate of
:func:`gradtap.workload.schedule.learning_rate`, then ``optimizer.step()``. Per-rank buffers
of every bucket are in the result (until the next step), so an iteration holds ``N`` copies
of the gradient in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from gradtap.core.errors import ConfigError, GradtapError, PlanError
from gradtap.core.vector_math import settle_vector_math
from gradtap.workload.data import Batch, batch_loss
from gradtap.workload.buckets import Bucket, ParamLike
from gradtap.workload.schedule import learning_rate

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# numpy has no bfloat16: bf16 buffers travel as their raw 16-bit patterns.
WIRE_NUMPY = {"fp32": np.dtype(np.float32), "bf16": np.dtype(np.uint16), "fp16": np.dtype(np.float16)}

Allreduce = Callable[[list[np.ndarray], Bucket], np.ndarray]
"""``allreduce(per_rank, bucket) -> reduced``: ``per_rank[r]`` is rank r's buffer of
``bucket`` (1-D, ``bucket.numel`` elements of the wire numpy dtype); the result has the
same shape and dtype. It must not modify its inputs."""


class BatchSource(Protocol):
    def batch(self, rank: int, iteration: int) -> Batch: ...


@dataclass(frozen=True)
class IterationResult:
    """One iteration. ``per_rank_buckets[b][r]`` is rank r's wire buffer of bucket b,
    ``reduced_buckets[b]`` the allreduce result (both in the wire numpy dtype, see
    ``WIRE_NUMPY``); ``losses[r]`` is rank r's loss before the step and ``lr`` the
    learning rate the step used. The per-rank buffers are the trainer's own, reused by
    its next step: copy them to keep them longer."""

    iteration: int
    per_rank_buckets: tuple[tuple[np.ndarray, ...], ...]
    reduced_buckets: tuple[np.ndarray, ...]
    losses: tuple[float, ...]
    lr: float


def make_optimizer(params: Sequence[torch.nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
    """The torch optimizer ``cfg`` describes (fields ``kind, lr, betas, eps, weight_decay,
    implementation``), at the learning rate of step 0."""
    classes = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    implementations = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True},
                       "fused": {"fused": True}}
    if cfg.kind not in classes:
        raise ConfigError(f"optimizer.kind: {cfg.kind!r} is not one of {sorted(classes)}")
    if cfg.implementation not in implementations:
        raise ConfigError(f"optimizer.implementation: {cfg.implementation!r} is not one of "
                          f"{sorted(implementations)}")
    settle_vector_math()        # the steps' torch.sqrt must not be the process's first, parallel, call
    return classes[cfg.kind](params, lr=learning_rate(cfg, 0), betas=tuple(cfg.betas),
                             eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **implementations[cfg.implementation])


def to_wire_array(buffer: torch.Tensor) -> np.ndarray:
    """A bucket buffer as numpy (bf16 as its uint16 bit patterns); shares memory."""
    if buffer.dtype == torch.bfloat16:
        return buffer.view(torch.int16).numpy().view(np.uint16)
    return buffer.numpy()


def from_wire_array(array: np.ndarray, wire_dtype: str) -> torch.Tensor:
    """The inverse of :func:`to_wire_array`, as a fresh tensor of the wire dtype."""
    array = np.array(array, dtype=WIRE_NUMPY[wire_dtype], copy=True)
    if wire_dtype == "bf16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class Trainer:
    """``world_size`` data-parallel ranks of ``model`` trained in one process.

    Parameters
    ----------
    model:
        The replica every rank holds; trained in place.
    params:
        DDP's parameter list (``gradtap.workload.models.param_specs(model)``); checked against
        the model by name, shape and dtype.
    buckets:
        The bucket layout on the wire (``gradtap.workload.buckets``), in launch order. A job
        whose layout changes after iteration 0 passes a new layout to :meth:`step`.
    world_size:
        Number of data-parallel ranks N.
    optimizer:
        Fields ``kind, lr, betas, eps, weight_decay, implementation, schedule,
        clip_grad_norm`` (``gradtap.workload.spec.OptimizerSpec``).
    wire_dtype, predivide:
        ``"fp32" | "bf16" | "fp16"`` and whether ranks divide by N before the allreduce
        (see the module docstring).
    data:
        ``data.batch(rank, iteration)`` gives rank's micro-batch
        (``gradtap.workload.data.ClassificationData`` / ``TokenData``).
    allreduce:
        The reduction of one bucket across ranks (see :data:`Allreduce`).
    start_iteration:
        The iteration the next :meth:`step` runs (its data shards and learning rate).
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[ParamLike],
                 buckets: Sequence[Bucket], *, world_size: int, optimizer: Any,
                 wire_dtype: str = "fp32", predivide: bool = True, data: BatchSource,
                 allreduce: Allreduce, start_iteration: int = 0):
        if world_size < 1:
            raise ConfigError(f"world_size: {world_size} must be at least 1")
        if wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"ddp.grad_dtype: {wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        self.model = model
        self.world_size = world_size
        self.wire_dtype = wire_dtype
        self.predivide = predivide
        self.data = data
        self.allreduce = allreduce
        self.iteration = start_iteration
        self.optimizer_cfg = optimizer
        self._params = _match_params(model, params)
        self.buckets = _check_buckets(buckets, self._params)
        self.optimizer = make_optimizer(list(model.parameters()), optimizer)
        # Buffers every step reuses, allocated at the first (their pages are faulted in once,
        # not once per iteration): each rank's wire buffers of all buckets, back to back in
        # launch order; the fp32 staging of one bucket for a low-precision wire dtype; the
        # reduced gradient that the parameters' .grad are views of.
        numel = sum(p.numel() for p in self._params)
        dtype = WIRE_DTYPES[wire_dtype]
        self._wire = [torch.empty(0, dtype=dtype) for _ in range(world_size)]
        self._wire_numel = numel
        self._staging = torch.empty(0, dtype=torch.float32)
        self._grad = torch.empty(0, dtype=torch.float32)

    def step(self, buckets: Sequence[Bucket] | None = None,
             before_update: Callable[[], None] | None = None) -> IterationResult:
        """Run one iteration on every rank, reduce, and step the optimizer.

        ``buckets``, if given, replaces the layout from this iteration on (DDP's
        rebuild after iteration 0). ``before_update``, if given, is called once every bucket
        is reduced, before clipping and the optimizer change the gradients and parameters
        (e.g. to wait for a writer that still reads the previous state).
        """
        if buckets is not None:
            self.buckets = _check_buckets(buckets, self._params)
        it = self.iteration
        per_rank, losses = [], []
        for rank in range(self.world_size):
            loss = self._backward(rank, it)
            losses.append(loss)
            per_rank.append(self._wire_buffers(rank))
        reduced = []
        if len(self._grad) == 0:
            self._grad = torch.empty(self._wire_numel, dtype=torch.float32)
        start = 0
        for b, bucket in enumerate(self.buckets):
            contributions = [per_rank[r][b] for r in range(self.world_size)]
            result = self.allreduce(contributions, bucket)
            _check_reduced(result, bucket, self.wire_dtype)
            reduced.append(result)
            self._scatter(bucket, result, self._grad[start:start + bucket.numel])
            start += bucket.numel
        if before_update is not None:
            before_update()
        clip = self.optimizer_cfg.clip_grad_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        lr = learning_rate(self.optimizer_cfg, it)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.iteration += 1
        return IterationResult(
            iteration=it,
            per_rank_buckets=tuple(tuple(per_rank[r][b] for r in range(self.world_size))
                                   for b in range(len(self.buckets))),
            reduced_buckets=tuple(reduced), losses=tuple(losses), lr=lr)

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "iteration"}``: what a checkpoint of rank 0 holds."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "iteration": self.iteration}

    def _backward(self, rank: int, iteration: int) -> float:
        for p in self.model.parameters():
            p.grad = None
        loss = batch_loss(self.model, self.data.batch(rank, iteration))
        loss.backward()
        return float(loss.detach())

    def _wire_buffers(self, rank: int) -> list[np.ndarray]:
        """This rank's buffer of every bucket as it goes on the wire (views of the rank's
        reused buffer, in launch order)."""
        n = self.world_size
        if len(self._wire[rank]) == 0:
            self._wire[rank] = torch.empty(self._wire_numel, dtype=WIRE_DTYPES[self.wire_dtype])
        out, start = [], 0
        for bucket in self.buckets:
            wire = self._wire[rank][start:start + bucket.numel]
            start += bucket.numel
            if self.wire_dtype == "fp32":
                buffer = wire
            else:
                if len(self._staging) < bucket.numel:
                    self._staging = torch.empty(bucket.numel, dtype=torch.float32)
                buffer = self._staging[:bucket.numel]
            for i, offset in zip(bucket.params, bucket.offsets):
                p = self._params[i]
                if p.grad is None:
                    raise PlanError(f"parameter {i} ({tuple(p.shape)}) got no gradient; DDP "
                                    "would need find_unused_parameters=True, which is not modelled")
                view = buffer[offset:offset + p.numel()].view(p.shape)
                if self.wire_dtype == "fp32" and self.predivide:
                    torch.mul(p.grad, 1.0 / n, out=view)
                else:
                    view.copy_(p.grad)
            if self.wire_dtype != "fp32":
                wire.copy_(buffer)           # the rounding of buffer.to(dtype)
                if self.predivide:
                    wire.div_(n)
            out.append(to_wire_array(wire))
        return out

    def _scatter(self, bucket: Bucket, reduced: np.ndarray, buffer: torch.Tensor) -> None:
        """Decompress the reduced buffer into ``buffer`` (float32, the bucket's numel) and
        hand each parameter its slice as ``.grad``."""
        # One copy (and conversion) straight from the reduced array, which stays the caller's.
        buffer.copy_(_wire_view(reduced, self.wire_dtype))
        if not self.predivide:
            buffer.div_(self.world_size)
        for i, offset in zip(bucket.params, bucket.offsets):
            p = self._params[i]
            p.grad = buffer[offset:offset + p.numel()].view(p.shape)


def _wire_view(array: np.ndarray, wire_dtype: str) -> torch.Tensor:
    """A tensor of the wire dtype sharing ``array``'s memory (read it, do not keep it)."""
    array = np.ascontiguousarray(array, dtype=WIRE_NUMPY[wire_dtype])
    if not array.flags.writeable:      # torch.from_numpy warns on read-only memory
        array = array.copy()
    if wire_dtype == "bf16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _match_params(model: torch.nn.Module, params: Sequence[ParamLike]) -> list[torch.nn.Parameter]:
    by_name = dict(model.named_parameters())
    matched = []
    for i, spec in enumerate(params):
        p = by_name.get(spec.name)
        if p is None:
            raise ConfigError(f"params[{i}]: {spec.name!r} is not a parameter of the model")
        if p.dtype != torch.float32:
            raise ConfigError(f"params[{i}]: {spec.name!r} is {p.dtype}; the simulated wire "
                              "dtypes assume float32 parameters and gradients")
        got = (tuple(p.shape), str(p.dtype).removeprefix("torch."))
        if got != (tuple(spec.shape), spec.dtype):
            raise ConfigError(f"params[{i}]: {spec.name!r} is {got[0]} {got[1]} in the model, "
                              f"but the spec says {tuple(spec.shape)} {spec.dtype}")
        matched.append(p)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if trainable != [spec.name for spec in params]:
        raise ConfigError("params: must list the model's trainable parameters in registration "
                          f"order, {len(trainable)} names starting {trainable[:3]}")
    return matched


def _check_buckets(buckets: Sequence[Bucket], params: Sequence[torch.nn.Parameter]) -> tuple[Bucket, ...]:
    covered = sorted(i for b in buckets for i in b.params)
    if covered != list(range(len(params))):
        raise ConfigError(f"buckets: must hold each of the {len(params)} parameters exactly once")
    for b in buckets:
        dense = np.cumsum([0] + [params[i].numel() for i in b.params]).tolist()
        if list(b.offsets) != dense[:-1] or b.numel != dense[-1]:
            raise ConfigError(f"buckets[{b.index}]: offsets {b.offsets[:4]}... and numel "
                              f"{b.numel} do not lay its parameters out densely")
    return tuple(buckets)


def _check_reduced(result: Any, bucket: Bucket, wire_dtype: str) -> None:
    want = WIRE_NUMPY[wire_dtype]
    if not isinstance(result, np.ndarray) or result.shape != (bucket.numel,) or result.dtype != want:
        got = (type(result).__name__, getattr(result, "shape", None), getattr(result, "dtype", None))
        raise GradtapError(f"allreduce of bucket {bucket.index} returned {got}; expected a "
                           f"numpy array of shape ({bucket.numel},) and dtype {want}")
