"""The float32 intrinsics: fma rounds once, division is IEEE, 16-bit widening is exact for every
bit pattern, and each many-lane estimate is its one-lane estimate, within its error bound."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from numba import njit

from gradtap.core.jit import JIT, has_feature
from gradtap.updater.intrinsics import div32, fma32, rsqrt12, rsqrt12x4, rsqrt14, rsqrt14x16, widen


@njit(**JIT)
def _fma_all(a, b, c, out):
    for i in range(out.size):
        out[i] = fma32(a[i], b[i], c[i])


@njit(**JIT)
def _div_all(a, b, out):
    for i in range(out.size):
        out[i] = div32(a[i], b[i])


@njit(**JIT)
def _widen_all(x, half, out):
    for i in range(out.size):
        out[i] = widen(x[i], half)


# One function per estimate: each may only be compiled on a CPU that has its instruction.

@njit(**JIT)
def _rsqrt14_both(x, one, lanes):
    for i in range(x.size):
        one[i] = rsqrt14(x[i])
    for k in range(0, x.size - x.size % 16, 16):
        rsqrt14x16(x, k, lanes, k)


@njit(**JIT)
def _rsqrt12_both(x, one, lanes):
    for i in range(x.size):
        one[i] = rsqrt12(x[i])
    for k in range(0, x.size - x.size % 4, 4):
        rsqrt12x4(x, k, lanes, k)


# estimate: (the CPU feature it needs, its instruction, the one- and many-lane forms, the
# bound on its relative error from the vendor's manual)
ESTIMATES = {
    "rsqrt14": ("avx512f", "vrsqrt14ps", _rsqrt14_both, 2.0 ** -14),
    "rsqrt12": ("sse", "rsqrtps", _rsqrt12_both, 1.5 * 2.0 ** -12),
}


def nearest_f32(r: Fraction) -> np.float32:
    """Round a rational to the nearest float32, ties to even (slow, obviously right)."""
    guess = np.float32(float(r))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - r), int(np.array([f]).view(np.uint32)[0]) & 1))


def test_fma_rounds_once():
    rng = np.random.default_rng(0)
    n = 3000
    a = (rng.standard_normal(n) * 10.0 ** rng.integers(-5, 5, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 10.0 ** rng.integers(-5, 5, n)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 1e-6)).astype(np.float32)  # cancellation
    out = np.empty(n, np.float32)
    _fma_all(a, b, c, out)
    want = [nearest_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(a, b, c)]
    assert np.array_equal(out, np.array(want, np.float32))
    assert not np.array_equal(out, a * b + c)      # a separate multiply and add differ here


def test_div_is_ieee_without_zero_check():
    a = np.array([1, -1, 0, 3, np.inf], np.float32)
    b = np.array([0, 0, 0, 7, np.inf], np.float32)
    out = np.empty(5, np.float32)
    _div_all(a, b, out)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2]) and np.isnan(out[4])
    assert out[3] == np.float32(3) / np.float32(7)


def test_widen_every_16_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, np.float32)
    for half, want in ((True, bits.view(np.float16).astype(np.float32)),
                       (False, torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy())):
        _widen_all(bits, half, out)
        nan = np.isnan(want)                # NaN payloads are not claimed (quieting differs)
        assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
        assert np.isnan(out[nan]).all()
    x = np.array([1.5, -0.0], np.float32)
    out = np.empty(2, np.float32)
    _widen_all(x, False, out)
    assert np.array_equal(out.view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("estimate", list(ESTIMATES))
def test_the_lanes_are_single_lanes_within_the_bound(estimate):
    feature, instruction, both, bound = ESTIMATES[estimate]
    if not has_feature(feature):
        pytest.skip(f"{instruction} needs {feature}, which this CPU does not have")
    rng = np.random.default_rng(1)
    x = rng.integers(1, 0x7F800000, 16 * 4096, dtype=np.uint32).view(np.float32)
    one, lanes = np.empty_like(x), np.empty_like(x)
    both(x, one, lanes)
    assert np.array_equal(one.view(np.uint32), lanes.view(np.uint32))
    normal = x >= np.finfo(np.float32).tiny      # the SSE estimate takes subnormals as zero
    rel = np.abs(one[normal].astype(np.float64) * np.sqrt(x[normal].astype(np.float64)) - 1)
    assert rel.max() <= bound
