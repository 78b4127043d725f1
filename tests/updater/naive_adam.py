"""The updater's reference: PyTorch's own Adam/AdamW, driven exactly the way the trainer drives it.

:class:`TorchStep` holds a real ``torch.nn.Module`` and a real ``torch.optim`` optimizer
and applies one iteration's reduced bucket buffers the way ``simulator/training.py`` does:
decompress each buffer to float32, divide by the world size when the ranks sent sums,
hand each parameter its slice as ``.grad``, ``clip_grad_norm_`` if the job clips, set the
learning rate of the iteration, ``optimizer.step()``. Nothing from ``updater/`` is used.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gradtap.workload.models import build
from gradtap.simulator.training import from_wire_array, learning_rate, make_optimizer
from gradtap.workload.buckets import Bucket
from gradtap.workload.layout import job_buckets
from gradtap.workload.spec import JobSpec

WIRE_NP = {"fp32": np.float32, "bf16": np.uint16, "fp16": np.float16}


class TorchStep:
    """The model of ``job`` built under ``seed`` plus its optimizer, stepped like the trainer."""

    def __init__(self, job: JobSpec, seed: int = 0, buckets: Sequence[Bucket] | None = None):
        self.job = job
        self.model = build(job.model.factory, job.model.kwargs, seed=seed)
        self.params = list(self.model.parameters())
        self.optimizer = make_optimizer(self.params, job.optimizer)
        self.buckets = tuple(job_buckets(job) if buckets is None else buckets)

    def step(self, iteration: int, reduced: Sequence[np.ndarray]) -> None:
        """``reduced[b]``: bucket b's reduced buffer in the wire numpy dtype (bf16 as uint16)."""
        job = self.job
        for bucket, buffer in zip(self.buckets, reduced):
            grad = torch.empty(bucket.numel, dtype=torch.float32)
            grad.copy_(from_wire_array(buffer, job.ddp.grad_dtype))
            if not job.ddp.predivide:
                grad.div_(job.world_size)
            for i, offset in zip(bucket.params, bucket.offsets):
                p = self.params[i]
                p.grad = grad[offset:offset + p.numel()].view(p.shape)
        if job.optimizer.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), job.optimizer.clip_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(job.optimizer, iteration)
        self.optimizer.step()

    def arrays(self) -> dict[str, np.ndarray]:
        """``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>`` (float32 copies)."""
        out = {}
        for name, p in self.model.named_parameters():
            out[f"param/{name}"] = p.detach().numpy().copy()
            state = self.optimizer.state.get(p, {})
            if state:
                out[f"exp_avg/{name}"] = state["exp_avg"].numpy().copy()
                out[f"exp_avg_sq/{name}"] = state["exp_avg_sq"].numpy().copy()
        return out


def random_reduced(job: JobSpec, rng: np.random.Generator, buckets: Sequence[Bucket] | None = None,
                   scale_exp: tuple[int, int] = (-12, 1)) -> list[np.ndarray]:
    """Reduced bucket buffers in the wire dtype with magnitudes spread over
    ``10**scale_exp[0] .. 10**scale_exp[1]`` and some exact zeros (dead units)."""
    out = []
    for b in job_buckets(job) if buckets is None else buckets:
        x = rng.standard_normal(b.numel) * 10.0 ** rng.uniform(*scale_exp, b.numel)
        x[rng.random(b.numel) < 0.05] = 0.0
        t = torch.from_numpy(x.astype(np.float32))
        if job.ddp.grad_dtype == "bf16":
            out.append(t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy())
        elif job.ddp.grad_dtype == "fp16":
            out.append(t.to(torch.float16).numpy().copy())
        else:
            out.append(t.numpy().copy())
    return out
