"""PyTorch's CPU float32 square root, reproduced bit for bit for the MKL kernels it runs.

``torch.sqrt`` on a float32 CPU tensor calls MKL's ``vmsSqrt`` in high-accuracy mode
(``aten/src/ATen/cpu/vml.h``, ``VML_HA``), and Adam's ``exp_avg_sq.sqrt()`` goes through it,
so an exact replica of ``torch.optim.Adam(foreach=False)`` needs the same root. MKL picks
the kernel behind ``vmsSqrt`` from the CPU at run time, and no kernel is correctly rounded;
each rounds differently. Three are reproduced here (torch 2.13.0, MKL 2024.2; the sequences
were read from the instruction stream of ``libtorch_cpu.so``, the dispatch observed with
breakpoints on every ``mkl_vml_kernel_sSqrt_*``; only the arithmetic is reproduced).

``mkl_vml_kernel_sSqrt_Z0HAynn`` (:data:`AVX512`), which MKL runs on AVX-512 Xeons: one
Newton-Raphson correction of the AVX-512 estimate, with fused multiply-adds.

.. code-block:: text

    y = rsqrt14(x)              # vrsqrt14ps, |relative error| < 2**-14
    h = y * 0.5                 # exact
    s = x * y                   # ≈ sqrt(x), rounded
    r = fma(-s, s, x)           # x - s², rounded once
    sqrt(x) = fma(h, r, s)      # s + r / (2 sqrt(x)), rounded once

For ``y > 2**39`` (``x`` below about 2**-78, where ``s * s`` would underflow) the residual
is formed at scale: ``r = fma(-(s·2**39), s·2**39, x·2**78)`` and the result is
``fma(h·2**-78, r, s)``. Zeros and ``+inf`` come back unchanged. Over all 2**31
non-negative inputs, 12,619,747 (0.59 %) come out one unit in the last place *below* the
correctly rounded root, at every exponent, none above.

``mkl_vml_kernel_sSqrt_L9HAynn`` (:data:`AVX2`), which MKL runs on Intel CPUs with AVX2 and
FMA but no AVX-512 (and on AVX-512 ones under ``MKL_ENABLE_INSTRUCTIONS=AVX2``, which is how
it was observed here): eight lanes of the SSE kernel's refinement below, every step after
the two products a fused multiply-add.

.. code-block:: text

    y = rsqrt12(x)              # vrsqrtps, |relative error| <= 1.5 * 2**-12
    s = x * y
    h = y * 0.5
    e = fma(-s, h, 0.5)
    s = fma(e, s, s)
    h = fma(e, h, h)
    sqrt(x) = fma(h, fma(-s, s, x), s)

for every positive normal ``x`` (its range test, ``bits + 0x7F800000 > 0xFEFFFFFF`` in
signed 32-bit arithmetic, sends exactly the others aside); every other input goes to the
scalar routine the SSE kernel uses for its own, below. Over all 2**31 non-negative inputs,
1,887,413 (0.088 %) differ from the correctly rounded root by one unit in the last place:
1,064,199 below and 823,214 above, none by more.

``mkl_vml_kernel_sSqrt_EXHAynn`` (:data:`SSE`), which MKL runs on this repository's AMD
EPYC (AVX2, no AVX-512; MKL keeps its AVX2 kernel for Intel's CPUs) and on Intel ones under
``MKL_ENABLE_INSTRUCTIONS=SSE4_2``: 128-bit SSE, no FMA, every operation rounded on its own.

.. code-block:: text

    y = rsqrt12(x)              # rsqrtps, |relative error| <= 1.5 * 2**-12
    s = x * y                   # ≈ sqrt(x)
    h = y * 0.5                 # ≈ 1 / (2 sqrt(x)), exact
    e = 0.5 - s * h             # the estimate's relative error, halved
    s = s * e + s               # refined root
    h = h * e + h               # refined half reciprocal
    sqrt(x) = (x - s * s) * h + s

for normal ``x`` up to the float whose bits are ``0x7F7FF000`` (above it ``s * s`` could
overflow). Every other input (zeros, subnormals, the largest 4095 floats, ``inf``, NaN,
negatives) goes to a scalar double-precision routine (``vssqrt_cout_rare``) whose result is
the correctly rounded root (zeros keep their sign; negatives give a NaN). Over all 2**31
non-negative inputs, 365,368,316 (17.0 %) differ from the correctly rounded root by one
unit in the last place: 157,450,409 below and 207,917,907 above, none by more, none at a
subnormal. ``rsqrtps``'s table is the CPU vendor's (AMD's and Intel's differ), so the
estimate is taken with the instruction itself; then this sequence equals ``torch.sqrt`` on
every one of the 2**31 inputs (``tests/updater/test_mkl_sqrt.py``, slow).

Which kernel a host runs is a fact about the host, so nothing is assumed:
:func:`reproduces_torch` compares a kernel with ``torch.sqrt`` here, and the updater's
start-up check (``updater/selfcheck.py``) takes the first one that matches, or
``torch.sqrt`` itself, rather than be silently inexact. Negative inputs give a NaN in
every kernel (Adam never takes the root of a negative number; the NaN's bits are not
claimed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numba import config, njit

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT, has_feature
from gradtap.core.vector_math import settle_vector_math
from gradtap.updater.intrinsics import fma32, rsqrt12, rsqrt12x4, rsqrt14, rsqrt14x16

log = logging.getLogger(__name__)

AVX512 = "mkl-avx512"   # mkl_vml_kernel_sSqrt_Z0HAynn
AVX2 = "mkl-avx2"       # mkl_vml_kernel_sSqrt_L9HAynn
SSE = "mkl-sse"         # mkl_vml_kernel_sSqrt_EXHAynn

_HALF = np.float32(0.5)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
# AVX512
_SCALE_AT = np.float32(2.0 ** 39)          # y above this: x < ~2**-78, residual at scale
_X_UP = np.float32(2.0 ** 78)
_H_DOWN = np.float32(2.0 ** -78)
# AVX2 and SSE: the inputs their vector paths take (bits 0x00800000 ..= 0x7F7FFFFF; SSE
# only ..= 0x7F7FF000)
_NORMAL_LOW = np.float32(np.finfo(np.float32).tiny)
_NORMAL_HIGH = np.float32(np.finfo(np.float32).max)
_SSE_HIGH = np.array([0x7F7FF000], np.uint32).view(np.float32)[0]


@njit(**JIT)
def finish_avx512(x, y):
    """MKL's AVX-512 root of ``x`` (float32) given ``y = rsqrt14(x)``."""
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
def estimates_rsqrt14(src, out):
    """``out[k] = rsqrt14(src[k])`` for every ``k`` (AVX-512F only): 16 lanes at a time
    (``vrsqrt14ps``), the last ``src.size % 16`` one lane at a time (``vrsqrt14ss``, the
    same instruction on one lane)."""
    n = src.size
    full = n - n % 16
    for k in range(0, full, 16):
        rsqrt14x16(src, k, out, k)
    for k in range(full, n):
        out[k] = rsqrt14(src[k])


@njit(**JIT)
def sqrt_span_avx512(src, out):
    """``out[k]`` = MKL's AVX-512 root of ``src[k]`` for every ``k`` of the 1-D float32
    ``src`` (AVX-512F only; ``out`` needs ``src.size`` elements): the estimates into ``out``,
    then finished in place in a loop LLVM vectorises."""
    estimates_rsqrt14(src, out)
    for k in range(src.size):
        out[k] = finish_avx512(src[k], out[k])


@njit(**JIT)
def finish_avx2(x, y):
    """MKL's AVX2 root of ``x`` (float32) given ``y = rsqrt12(x)``."""
    s = x * y
    h = y * _HALF
    e = fma32(-s, h, _HALF)
    s = fma32(e, s, s)
    h = fma32(e, h, h)
    root = fma32(h, fma32(-s, s, x), s)
    if _NORMAL_LOW <= x <= _NORMAL_HIGH:
        return root
    return np.sqrt(x)


@njit(**JIT)
def estimates_rsqrt12(src, out):
    """``out[k] = rsqrt12(src[k])`` for every ``k``: 4 lanes at a time (``rsqrtps``), the
    last ``src.size % 4`` one lane at a time (``rsqrtss``, the same table)."""
    n = src.size
    full = n - n % 4
    for k in range(0, full, 4):
        rsqrt12x4(src, k, out, k)
    for k in range(full, n):
        out[k] = rsqrt12(src[k])


@njit(**JIT)
def sqrt_span_avx2(src, out):
    """``out[k]`` = MKL's AVX2 root of ``src[k]`` for every ``k`` of the 1-D float32 ``src``
    (``out`` needs ``src.size`` elements): the estimates into ``out``, then finished in place
    in a vectorised loop (as :func:`sqrt_span_avx512`)."""
    estimates_rsqrt12(src, out)
    for k in range(src.size):
        out[k] = finish_avx2(src[k], out[k])


@njit(**JIT)
def finish_sse(x, y):
    """MKL's SSE root of ``x`` (float32) given ``y = rsqrt12(x)``."""
    s = x * y
    h = y * _HALF
    e = _HALF - s * h
    s = s * e + s
    h = h * e + h
    root = (x - s * s) * h + s
    if _NORMAL_LOW <= x <= _SSE_HIGH:
        return root
    return np.sqrt(x)


@njit(**JIT)
def sqrt_span_sse(src, out):
    """``out[k]`` = MKL's SSE root of ``src[k]`` for every ``k`` of the 1-D float32 ``src``
    (``out`` needs ``src.size`` elements), as :func:`sqrt_span_avx2` (MKL too takes these
    estimates 4 lanes at a time)."""
    estimates_rsqrt12(src, out)
    for k in range(src.size):
        out[k] = finish_sse(src[k], out[k])


class Kernel(NamedTuple):
    """One of MKL's float32 square-root kernels, as reproduced here."""

    symbol: str                 # MKL's name for it (in libtorch_cpu.so)
    features: tuple[str, ...]   # the LLVM target features it needs
    instruction: str            # the instructions that need them
    span: Callable              # sqrt_span_*(src, out): its root of every element


# In the order the updater tries them.
KERNELS = {
    AVX512: Kernel("mkl_vml_kernel_sSqrt_Z0HAynn", ("avx512f",), "vrsqrt14ps", sqrt_span_avx512),
    AVX2: Kernel("mkl_vml_kernel_sSqrt_L9HAynn", ("sse", "fma"), "rsqrtps and FMA", sqrt_span_avx2),
    SSE: Kernel("mkl_vml_kernel_sSqrt_EXHAynn", ("sse",), "rsqrtps", sqrt_span_sse),
}


def _kernel(kernel: str) -> Kernel:
    if kernel not in KERNELS:
        raise GradtapError(f"MKL square-root kernel {kernel!r} is not one of {tuple(KERNELS)}")
    return KERNELS[kernel]


def missing(kernel: str) -> str | None:
    """Why ``kernel`` cannot run on this host (``None`` when it can): the CPU lacks an
    instruction it needs, or ``NUMBA_DISABLE_JIT`` is set (the estimates have no twin)."""
    k = _kernel(kernel)
    lacking = [f for f in k.features if not has_feature(f)]
    if lacking:
        return f"{kernel} needs {k.instruction} ({', '.join(lacking)}), which this CPU does not have"
    if config.DISABLE_JIT:
        return f"{kernel} needs the JIT for {k.instruction} (NUMBA_DISABLE_JIT is set)"
    return None


def available(kernel: str) -> bool:
    """Whether :func:`sqrt` can run ``kernel`` here (see :func:`missing`)."""
    return missing(kernel) is None


def sqrt(x: np.ndarray, kernel: str) -> np.ndarray:
    """``kernel``'s float32 root of every element of the float32 array ``x``, as a new 1-D
    array. Raises ``GradtapError`` where it cannot run (:func:`missing`)."""
    reason = missing(kernel)
    if reason:
        raise GradtapError(f"gradtap.updater.mkl_sqrt: {reason}; the updater takes its roots from "
                           "torch.sqrt instead")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(x)
    KERNELS[kernel].span(x, out)
    return out


def probe_inputs() -> np.ndarray:
    """float32 inputs on which :func:`reproduces_torch` compares a kernel with ``torch.sqrt``.

    Every float32 in [1, 4) (both exponent parities, all 2**24 mantissas, so every way an
    estimate's table can be indexed for normal numbers), the subnormals and tiny normals
    (every 64th bit pattern below 2**-70: AVX512's scaled path, SSE's scalar one), the
    largest 4096 floats (SSE's scalar path), powers of two over the whole range, and ±0,
    +inf.
    """
    normal = np.arange(0x3F800000, 0x40800000, dtype=np.uint32)
    tiny = np.arange(1, 0x1C800000, 64, dtype=np.uint32)
    top = np.arange(0x7F7FF000, 0x7F800000, dtype=np.uint32)
    powers = (np.arange(1, 255, dtype=np.uint32) << 23)
    special = np.array([0, 0x80000000, 0x7F800000], dtype=np.uint32)
    return np.concatenate([normal, tiny, top, powers, special]).view(np.float32)


@lru_cache(maxsize=None)
def reproduces_torch(kernel: str) -> bool:
    """Whether ``kernel`` equals ``torch.sqrt`` bit for bit on this host's probe set.

    False where it cannot run (:func:`missing`). Takes about a tenth of a second; the
    answer is cached for the process.
    """
    import torch

    if not available(kernel):
        return False
    x = probe_inputs()
    ours = sqrt(x, kernel).view(np.uint32)
    settle_vector_math()
    theirs = torch.sqrt(torch.from_numpy(x)).numpy().view(np.uint32)
    differ = np.flatnonzero(ours != theirs)
    if differ.size:
        i = differ[0]
        log.info("%s differs from torch.sqrt on %d of %d probe inputs, first at x = %r (bits %08x): "
                 "ours %08x, torch %08x", kernel, differ.size, x.size, float(x[i]),
                 x.view(np.uint32)[i], ours[i], theirs[i])
    return not differ.size
