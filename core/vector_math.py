"""PyTorch's first call into MKL's vector math, made on one thread.

On the CPU, ``torch.sqrt`` of float32 (and so single-tensor and foreach Adam) runs MKL's
vector math library, which sets itself up on its first call in the process. When that first
call is a parallel one (a tensor of more than one of ATen's grains, on two or more intra-op
threads), one thread's share may come back from a low-accuracy kernel. On a Xeon (family 6,
model 207, AVX-512 with FP16; PyTorch 2.13.0 CPU, 2 threads) the first ``torch.sqrt`` of
``updater.mkl_sqrt.probe_inputs`` (24 M floats) in a fresh process gave, in about 1 process
in 10, roots with a relative error up to 3.3e-4 (about 12 bits) for the second thread's half,
12 M of them. Every later call in the same process, and every first call made after a
one-thread call (90 processes, 40 of them through this function), gave MKL's usual roots.
So a process that will compare with or compute through ``torch.sqrt`` first calls
:func:`settle_vector_math`.

Without the settling, the updater's self-check found, in that one process in 10, that no
MKL root reproduces ``torch.sqrt``, and took the 10x slower ``torch.sqrt`` path; and a
simulator whose first optimizer step made the first call would hold the low-accuracy roots
in its ground truth.
"""

from __future__ import annotations

from functools import lru_cache

SETTLING_ELEMENTS = 64      # far below one of ATen's grains (32768): the calling thread alone


@lru_cache(maxsize=None)
def settle_vector_math() -> None:
    """Make this process's first call into MKL's vector math a one-thread ``torch.sqrt``
    (once per process; see the module docstring)."""
    import torch

    torch.sqrt(torch.ones(SETTLING_ELEMENTS, dtype=torch.float32))
