"""Start-up proof, on this host, that the kernels equal this host's PyTorch for one job.

Bit-exactness rests on facts about the machine: which MKL square-root kernel runs (it
depends on the CPU), and which build of ``torch._fused_adam_`` runs (AVX2 on x86 hosts with
AVX2; a plain build otherwise). So instead of assuming them, a replica runs the job's
optimizer (kind, betas, eps, weight decay, implementation) for a few steps on a small
probe, once through ``torch.optim`` and once through :func:`gradtap.updater.kernels.adam_step`,
and compares every bit. Single-tensor and foreach try each of MKL's kernels reproduced in
``updater/mkl_sqrt.py`` that this CPU can run and whose root equals ``torch.sqrt`` here
(AVX-512 on AVX-512 Xeons, AVX2 on Intel CPUs without AVX-512, SSE on the AMD EPYC), then
``torch.sqrt`` itself; when nothing matches the replica refuses to start rather than drift
silently.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater import kernels, mkl_sqrt
from gradtap.workload.spec import OptimizerSpec

log = logging.getLogger(__name__)

PROBE_SIZES = (1, 7, 15, 17, 1023, 4099)    # not multiples of any vector width
PROBE_STEPS = 3


def probe_matches(cfg: OptimizerSpec, sqrt: str, seed: int = 0) -> bool:
    """Whether ``adam_step`` with root source ``sqrt`` equals ``torch.optim`` for ``cfg``
    on the probe (fp32 gradients, pre-divided, no clipping)."""
    from gradtap.updater.state import TORCH_CLASSES, TORCH_KWARGS

    rng = np.random.default_rng(seed)
    sizes = list(PROBE_SIZES)
    n = sum(sizes)
    start = rng.standard_normal(n).astype(np.float32)
    bounds = np.cumsum([0] + sizes)
    tensors = [torch.nn.Parameter(torch.from_numpy(start[a:b].copy())) for a, b in zip(bounds, bounds[1:])]
    optimizer = TORCH_CLASSES[cfg.kind](tensors, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                        weight_decay=cfg.weight_decay, **TORCH_KWARGS[cfg.implementation])
    p, m, v = start.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    work = kernels.work_spans(sizes, cfg.implementation)
    for step in range(1, PROBE_STEPS + 1):
        g = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 1, n)).astype(np.float32)
        for t, a, b in zip(tensors, bounds, bounds[1:]):
            t.grad = torch.from_numpy(g[a:b].copy())
        optimizer.step()
        c = kernels.step_constants(cfg.implementation, decoupled=cfg.kind == "adamw", lr=cfg.lr,
                                   betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                                   step=step)
        kernels.adam_step(cfg.implementation, p, g, m, v, work, c, sqrt=sqrt)
    ours = np.concatenate([p, m, v]).view(np.uint32)
    theirs = np.concatenate([np.concatenate([t.detach().numpy() for t in tensors]),
                             np.concatenate([optimizer.state[t]["exp_avg"].numpy() for t in tensors]),
                             np.concatenate([optimizer.state[t]["exp_avg_sq"].numpy() for t in tensors])])
    return bool(np.array_equal(ours, theirs.view(np.uint32)))


def mkl_roots() -> list[str]:
    """The reproduced MKL kernels (``kernels.SQRT_MKL_*``) whose root is this host's
    ``torch.sqrt``, in the order :func:`root_source` tries them."""
    return [kernel for kernel in mkl_sqrt.KERNELS if mkl_sqrt.reproduces_torch(kernel)]


@lru_cache(maxsize=32)
def root_source(cfg: OptimizerSpec) -> str:
    """The fastest root source that makes the kernels exact for ``cfg`` on this host: for
    fused ``kernels.SQRT_IEEE``; otherwise the first of :func:`mkl_roots` (one pass) that
    passes the probe, else ``kernels.SQRT_TORCH`` (one more pass over the state).

    Raises ``GradtapError`` when none equals ``torch.optim`` bit for bit.
    """
    fused = cfg.implementation == "fused"
    roots = [] if fused else mkl_roots()
    candidates = [kernels.SQRT_IEEE] if fused else roots + [kernels.SQRT_TORCH]
    for sqrt in candidates:
        if probe_matches(cfg, sqrt):
            if sqrt == kernels.SQRT_TORCH:
                why = "; ".join(mkl_sqrt.missing(k) or (f"{k} failed the probe" if k in roots else
                                                        f"{k} runs, but torch.sqrt rounds otherwise")
                                for k in mkl_sqrt.KERNELS)
                log.warning("the %s updater takes its roots from torch.sqrt (exact, one more pass over "
                            "the state): no reproduced MKL kernel is this host's (%s)",
                            cfg.implementation, why)
            return sqrt
    detail = ("its fused kernel is reproduced for PyTorch's AVX2 build of FusedAdamKernel.cpp; "
              "this host runs another" if fused
              else f"none of {candidates} gives torch's result")
    raise GradtapError(f"optimizer.implementation {cfg.implementation!r} ({cfg.kind}) cannot be "
                       f"replicated bit for bit on this host: {detail}. Refusing to run an inexact "
                       "replica; run the updater on an x86-64 host with AVX2")
