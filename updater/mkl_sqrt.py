"""PyTorch's CPU float32 square root, reproduced bit for bit.

``torch.sqrt`` on a float32 CPU tensor calls MKL's ``vmsSqrt`` in high-accuracy mode
(``aten/src/ATen/cpu/vml.h``, ``VML_HA``). That result is *not* the correctly rounded
root: over all 2**31 non-negative float32 inputs, 12,619,747 (0.59 %) come out one unit in
the last place low (torch 2.13.0 with MKL 2024.2 on an AVX-512 Xeon; measured by
``tests/updater/test_mkl_sqrt.py``'s exhaustive twin). Adam's ``exp_avg_sq.sqrt()`` goes
through it, so an exact replica of ``torch.optim.Adam(foreach=False)`` needs the same
root.

On a CPU with AVX-512F, MKL dispatches ``mkl_vml_kernel_sSqrt_Z0HAynn``, whose inner loop
is one Newton-Raphson correction of the hardware estimate (read from the instruction
stream of ``libtorch_cpu.so``; only the arithmetic is reproduced here):

.. code-block:: text

    y = rsqrt14(x)              # vrsqrt14ps, |relative error| < 2**-14
    h = y * 0.5                 # exact
    s = x * y                   # ≈ sqrt(x), rounded
    r = fma(-s, s, x)           # x - s², rounded once
    sqrt(x) = fma(h, r, s)      # s + r / (2 sqrt(x)), rounded once

For ``y > 2**39`` (``x`` below about 2**-78, where ``s * s`` would underflow) the
residual is formed at scale: ``r = fma(-(s·2**39), s·2**39, x·2**78)`` and the result is
``fma(h·2**-78, r, s)``. Zeros and ``+inf`` come back unchanged; negative inputs give a
NaN (Adam never takes the root of a negative number; its NaN's bits are not claimed).

:func:`reproduces_torch` compares this with ``torch.sqrt`` on the host, because the
sequence belongs to one MKL kernel: another CPU (no AVX-512, so MKL picks another kernel)
or another MKL could round differently, and then the updater must use ``torch.sqrt``
itself (``updater/kernels.py``) rather than be silently inexact.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np
from numba import config, njit

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT
from gradtap.updater.intrinsics import fma32, has_avx512f, rsqrt14, rsqrt14x16

log = logging.getLogger(__name__)

LANES = 16                                 # float32 lanes of vrsqrt14ps
_SCALE_AT = np.float32(2.0 ** 39)          # y above this: x < ~2**-78, residual at scale
_X_UP = np.float32(2.0 ** 78)
_H_DOWN = np.float32(2.0 ** -78)
_HALF = np.float32(0.5)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)


@njit(**JIT)
def finish(x, y):
    """MKL's root of ``x`` (float32) given ``y = rsqrt14(x)``."""
    h = y * _HALF
    s = x * y
    if y > _SCALE_AT:
        s_up = s * _SCALE_AT
        root = fma32(h * _H_DOWN, fma32(-s_up, s_up, x * _X_UP), s)
    else:
        root = fma32(h, fma32(-s, s, x), s)
    if x == 0 or x == _INF:
        return x
    if x < 0:
        return _NAN
    return root


@njit(**JIT)
def mkl_sqrt(x):
    """MKL's float32 root of one float32 ``x`` (AVX-512F only)."""
    return finish(x, rsqrt14(x))


@njit(**JIT)
def sqrt_span(src, out):
    """``out[k] = mkl_sqrt(src[k])`` for every ``k`` of the 1-D float32 ``src`` (AVX-512F only).

    The estimates go 16 lanes at a time into ``out`` and are then finished in place in a
    loop LLVM vectorises; the last ``src.size % 16`` elements take the one-lane estimate,
    the same instruction on one lane. ``out`` needs ``src.size`` elements.
    """
    n = src.size
    full = n - n % LANES
    for k in range(0, full, LANES):
        rsqrt14x16(src, k, out, k)
    for k in range(full, n):
        out[k] = rsqrt14(src[k])
    for k in range(n):
        out[k] = finish(src[k], out[k])


@njit(**JIT)
def _sqrt_all(x, out):
    sqrt_span(x, out)


def available() -> bool:
    """Whether :func:`sqrt` can run here: AVX-512F, and compiled (not ``NUMBA_DISABLE_JIT``)."""
    return has_avx512f() and not config.DISABLE_JIT


def sqrt(x: np.ndarray) -> np.ndarray:
    """MKL's float32 root of every element of the 1-D float32 array ``x``, as a new array.

    Raises ``GradtapError`` where it cannot run (:func:`available`).
    """
    if not available():
        raise GradtapError("gradtap.updater.mkl_sqrt needs AVX-512F (vrsqrt14ps) and the JIT; without them "
                           "the updater takes its roots from torch.sqrt instead")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(x)
    _sqrt_all(x, out)
    return out


def probe_inputs() -> np.ndarray:
    """float32 inputs on which :func:`reproduces_torch` compares the two roots.

    Every float32 in [1, 4) (both exponent parities, all 2**24 mantissas, so every way
    the estimate's table can be indexed for normal numbers), the subnormals and tiny
    normals of the scaled path (every 64th bit pattern below 2**-70), powers of two over
    the whole range, and 0, +inf.
    """
    normal = np.arange(0x3F800000, 0x40800000, dtype=np.uint32)
    tiny = np.arange(1, 0x1C800000, 64, dtype=np.uint32)
    powers = (np.arange(1, 255, dtype=np.uint32) << 23)
    special = np.array([0, 0x7F800000], dtype=np.uint32)
    return np.concatenate([normal, tiny, powers, special]).view(np.float32)


@lru_cache(maxsize=1)
def reproduces_torch() -> bool:
    """Whether :func:`sqrt` equals ``torch.sqrt`` bit for bit on this host's probe set.

    False where it cannot run (:func:`available`). Takes about a tenth of a second; the
    answer is cached for the process.
    """
    import torch

    if not available():
        return False
    x = probe_inputs()
    ours = sqrt(x).view(np.uint32)
    theirs = torch.sqrt(torch.from_numpy(x)).numpy().view(np.uint32)
    differ = np.flatnonzero(ours != theirs)
    if differ.size:
        i = differ[0]
        log.warning("the reproduced MKL root differs from torch.sqrt on %d of %d probe inputs, first "
                    "at x = %r (bits %08x): ours %08x, torch %08x", differ.size, x.size, float(x[i]),
                    x.view(np.uint32)[i], ours[i], theirs[i])
    return not differ.size
