"""Which square roots this host runs, asked the way the product asks, and which one its torch.sqrt
is, checked against torch.sqrt itself.

A reproduced MKL kernel can run where the CPU has its estimate instruction
(``mkl_sqrt.missing``, the question the product asks LLVM); it is this host's root when it
equals ``torch.sqrt`` on a sample of its own (random bit patterns over the whole range, not
the product's probe set). Tests of a kernel skip, saying why, where either fails.

That alone could not catch a reproduction gone wrong: its tests would skip and the updater
would fall back to torch.sqrt, exact but slow. So :func:`mkl_runs_here` also says, from the
CPU itself, which kernel MKL runs (as observed with breakpoints, ``updater/mkl_sqrt.py``),
and ``test_selfcheck`` holds the product to it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks._hosts import host_features
from gradtap.updater import mkl_sqrt

MKL_ROOTS = list(mkl_sqrt.KERNELS)                       # kernels.SQRT_MKL_*


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
                    f"(MKL runs another kernel on this CPU; tests/updater/test_other_hosts.py plays the host "
                    f"that runs it)")


def _cpu_vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def mkl_runs_here(cap: str | None = None) -> tuple[str | None, str]:
    """The reproduced kernel MKL's ``vmsSqrt`` runs on this CPU (``None`` when no reproduced
    one is known to), and why, from the CPU's vendor and features (CPUID, not the features
    Numba is told to compile for) and ``MKL_ENABLE_INSTRUCTIONS``, which MKL honours on
    Intel CPUs: ``AVX512`` (no cap), ``AVX2``, ``AVX`` or ``SSE4_2`` (MKL 2024 runs its SSE
    kernels for AVX-only CPUs). ``cap`` stands for that variable when given."""
    vendor = _cpu_vendor()
    features = set(host_features())
    cap = (cap or os.environ.get("MKL_ENABLE_INSTRUCTIONS") or "AVX512").upper()
    if vendor == "GenuineIntel":
        if cap not in ("AVX512", "AVX2", "AVX", "SSE4_2"):
            return None, f"MKL_ENABLE_INSTRUCTIONS={cap} is not a level this test knows"
        if "+avx512f" in features and cap == "AVX512":
            return mkl_sqrt.AVX512, "an Intel CPU with AVX-512F"
        if {"+avx2", "+fma"} <= features and cap in ("AVX512", "AVX2"):
            return mkl_sqrt.AVX2, f"an Intel CPU with AVX2 and FMA, MKL capped at {cap}"
        return mkl_sqrt.SSE, f"an Intel CPU, MKL capped at {cap}"
    if "+avx512f" not in features:
        return mkl_sqrt.SSE, f"a {vendor} CPU without AVX-512 (observed on AMD EPYC)"
    return None, f"MKL's square root on a {vendor} CPU with AVX-512 has not been observed"
