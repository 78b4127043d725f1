"""Which square roots this host runs, asked the way the product asks, and which one its torch.sqrt
is, checked against torch.sqrt itself.

A reproduced MKL kernel can run where the CPU has its estimate instruction
(``mkl_sqrt.missing``, the question the product asks LLVM); it is this host's root when it
equals ``torch.sqrt`` on a sample of its own (random bit patterns over the whole range, not
the product's probe set). Tests of a kernel skip, saying why, where either fails.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch

from gradtap.updater import kernels, mkl_sqrt

MKL_ROOTS = list(mkl_sqrt.KERNELS)                       # kernels.SQRT_MKL_*
SINGLE_TENSOR_ROOTS = MKL_ROOTS + [kernels.SQRT_TORCH]   # every root adam_step takes for single-tensor


def torch_sqrt(x: np.ndarray) -> np.ndarray:
    return torch.sqrt(torch.from_numpy(x)).numpy()


@lru_cache(maxsize=None)
def torch_uses(kernel: str) -> bool:
    """Whether ``kernel`` runs here and equals ``torch.sqrt`` on 4 M random non-negative floats."""
    if not mkl_sqrt.available(kernel):
        return False
    x = np.random.default_rng(12345).integers(0, 0x7F800000, 4 << 20, dtype=np.uint32).view(np.float32)
    return np.array_equal(mkl_sqrt.sqrt(x, kernel).view(np.uint32), torch_sqrt(x).view(np.uint32))


def require(root: str) -> None:
    """Skip the calling test unless ``root`` is a root this host's torch takes (``torch`` and
    ``ieee`` always are)."""
    if root not in mkl_sqrt.KERNELS:
        return
    reason = mkl_sqrt.missing(root)
    if reason:
        pytest.skip(reason)
    if not torch_uses(root):
        pytest.skip(f"torch.sqrt on this host is not MKL's {mkl_sqrt.KERNELS[root].symbol} "
                    f"(MKL runs another kernel on this CPU)")
