"""The reference for bucket layouts and in-process training: real DDP over gloo on CPU.

:func:`run_job` trains one job under ``torch.nn.parallel.DistributedDataParallel`` in an
already initialised process group and records what DDP actually did: for every bucket
it allreduced (through a comm hook), the bucket index, its parameters, its buffer and
each parameter's slot in it; after every backward pass the reduced gradients; at the end
the model and optimizer state. :func:`run_in_process` runs jobs as rank 0 of a one-rank
group inside the test process; :func:`run_spawned` runs them on N processes (forked from
the tests' fork server, ``tests/forked.py``), bounded in time and always reaped.

Also holds test-only models whose shapes exercise the bucketing rules.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


from gradtap.workload import models
from gradtap.workload.data import ClassificationData, batch_loss
from gradtap.simulator.training import learning_rate, make_optimizer
from tests.forked import start_ranks
from tests.gloo import end_spawned_rank, gloo_group


@dataclass(frozen=True)
class Job:
    """One DDP run. ``hook``: ``None`` (DDP's built-in reduction), ``"sum_divide"`` (allreduce
    the plain sum, divide the result), ``"bf16"``/``"fp16"`` (torch's compress hooks) or
    ``"bf16_sum_divide"`` (bf16 sum, decompressed then divided) or ``"record"`` (record,
    reduce nothing). ``record`` wraps the hook with a recorder (it
    cannot be combined with ``None``, since any hook disables the reducer's division).
    ``optimizer`` ``None`` skips the optimizer. ``same_data`` gives every rank rank 0's batch."""

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    batch_size: int = 4
    seq_len: int | None = None
    iterations: int = 3
    ddp: dict[str, Any] = field(default_factory=dict)
    hook: str | None = "record"
    record: bool = True
    optimizer: Any = None
    same_data: bool = False


@dataclass
class BucketRecord:
    index: int
    names: list[str]
    numel: int
    offsets: list[int]          # element offset of each parameter's view in the buffer
    buffer: torch.Tensor        # the bucket buffer as the hook received it
    grads: dict[str, torch.Tensor]  # each parameter's local .grad at hook time


@dataclass
class JobResult:
    buckets: list[list[BucketRecord]]       # [iteration][call order]
    reduced_grads: list[dict[str, torch.Tensor]]  # [iteration] .grad before optimizer.step
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


def run_job(job: Job, rank: int, world_size: int) -> JobResult:
    model = models.build(job.factory, job.kwargs, seed=job.seed)
    names = {p: n for n, p in model.named_parameters()}
    ddp = DDP(model, **job.ddp)
    calls: list[BucketRecord] = []
    inner = {None: None, "record": _no_reduction, "sum_divide": _sum_then_divide,
             "bf16": _bf16_compress_on_gloo, "fp16": default_hooks.fp16_compress_hook,
             "bf16_sum_divide": _bf16_sum_then_divide}[job.hook]
    if job.record:
        def hook(state, bucket):
            buf = bucket.buffer()
            calls.append(BucketRecord(
                index=bucket.index(), names=[names[p] for p in bucket.parameters()],
                numel=buf.numel(),
                offsets=[(g.data_ptr() - buf.data_ptr()) // buf.element_size() for g in bucket.gradients()],
                buffer=buf.clone(),
                grads={names[p]: p.grad.clone() for p in bucket.parameters()}))
            return inner(state, bucket)
        ddp.register_comm_hook(None, hook)
    elif inner is not None:
        ddp.register_comm_hook(None, inner)
    optimizer = make_optimizer(list(model.parameters()), job.optimizer) if job.optimizer else None
    data = model.synthetic_data(batch_size=job.batch_size, seed=job.seed, seq_len=job.seq_len)
    result = JobResult([], [], {}, None)
    for it in range(job.iterations):
        calls.clear()
        for p in model.parameters():
            p.grad = None
        batch_loss(ddp, data.batch(0 if job.same_data else rank, it)).backward()
        result.buckets.append(list(calls))
        if optimizer is not None:
            if job.optimizer.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), job.optimizer.clip_grad_norm)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(job.optimizer, it)
            optimizer.step()
        result.reduced_grads.append({names[p]: p.grad.clone() for p in model.parameters()
                                     if p.grad is not None})
    result.model = {k: v.clone() for k, v in model.state_dict().items()}
    result.optimizer = optimizer.state_dict() if optimizer is not None else None
    return result


def _no_reduction(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _bf16_compress_on_gloo(state, bucket):
    # torch's own bf16_compress_hook; DDP refuses to register it by that name without
    # CUDA and NCCL, though it runs on gloo.
    return default_hooks.bf16_compress_hook(state, bucket)


def _sum_then_divide(state, bucket):
    world_size = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world_size))


def _bf16_sum_then_divide(state, bucket):
    world_size = dist.get_world_size()
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer.to(torch.bfloat16), async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer.div_(world_size)
    return fut.then(decompress)


def run_in_process(jobs: list[Job], store_dir: Path) -> list[JobResult]:
    """Run ``jobs`` as the only rank of a gloo group created (and destroyed) here."""
    store = dist.FileStore(str(store_dir / "store"), 1)
    with gloo_group(store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)):
        return [run_job(job, 0, 1) for job in jobs]


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, jobs: list[Job]) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    with gloo_group(store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)):
        results = [run_job(job, rank, world_size) for job in jobs]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_spawned_rank()


def run_spawned(jobs: list[Job], world_size: int, work_dir: Path,
                timeout_s: float = 240.0) -> list[list[JobResult]]:
    """Run ``jobs`` on ``world_size`` rank processes (one intra-op thread each);
    returns ``results[rank][job]``. Kills every process it started on timeout or error."""
    ctx = start_ranks(_worker, (world_size, str(work_dir / "store"), str(work_dir), jobs), world_size)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP reference run did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return [torch.load(work_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


class SmallParams(nn.Module):
    """``depth`` × (Linear(width, width) → LayerNorm(width)): many tiny parameters, and
    LayerNorms whose weight gradient is ready before their bias gradient."""

    def __init__(self, width: int = 8, depth: int = 40, num_classes: int = 5):
        super().__init__()
        self.width, self.num_classes = width, num_classes
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def synthetic_data(self, *, batch_size, seed, seq_len=None):
        return ClassificationData(self.width, self.num_classes, batch_size, seed)


class Shuffled(nn.Module):
    """Layers registered ``a, b, c, frozen`` but applied ``c, a, b``, plus a frozen layer
    (``requires_grad=False``) that DDP must leave out."""

    def __init__(self, width: int = 64, num_classes: int = 7):
        super().__init__()
        self.width, self.num_classes = width, num_classes
        self.a = nn.Linear(2 * width, 3 * width)
        self.frozen = nn.Linear(width, 2 * width)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(3 * width, num_classes)
        self.c = nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.frozen(torch.relu(self.c(x)))))))

    def synthetic_data(self, *, batch_size, seed, seq_len=None):
        return ClassificationData(self.width, self.num_classes, batch_size, seed)


def small_params(**kwargs) -> SmallParams:
    return SmallParams(**kwargs)


def shuffled(**kwargs) -> Shuffled:
    return Shuffled(**kwargs)
