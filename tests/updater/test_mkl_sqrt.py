"""The reproduced MKL root equals torch.sqrt bit for bit (brute force), and differs from the
correctly rounded root, which is why it exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradtap.updater import mkl_sqrt
from gradtap.updater.intrinsics import has_avx512f

pytestmark = pytest.mark.skipif(not has_avx512f(), reason="the reproduced root needs AVX-512F")


def torch_sqrt(x):
    return torch.sqrt(torch.from_numpy(x)).numpy()


def assert_bits_equal(x):
    ours = mkl_sqrt.sqrt(x).view(np.uint32)
    theirs = torch_sqrt(x).view(np.uint32)
    differ = np.flatnonzero(ours != theirs)
    first = differ[:4]
    assert differ.size == 0, (f"{differ.size} of {x.size} differ; first x bits {x.view(np.uint32)[first]}: "
                              f"ours {ours[first]}, torch {theirs[first]}")


def test_reproduces_torch_on_this_host():
    assert mkl_sqrt.reproduces_torch()


def test_every_float_in_two_binades_and_the_scaled_range():
    # [1, 4): every mantissa at both exponent parities. Below 2**-70: subnormals and tiny
    # normals, where MKL forms the residual at scale (every 61st bit pattern).
    assert_bits_equal(np.arange(0x3F800000, 0x40800000, dtype=np.uint32).view(np.float32))
    assert_bits_equal(np.arange(0, 0x1C800000, 61, dtype=np.uint32).view(np.float32))


def test_random_floats_over_the_whole_range():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800000, 20_000_000, dtype=np.uint32)
    assert_bits_equal(bits.view(np.float32))


def test_specials():
    x = np.array([0.0, np.inf, np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                  np.float32(1e-45), 1.0, 4.0], np.float32)
    assert_bits_equal(x)
    assert np.isnan(mkl_sqrt.sqrt(np.array([-1.0, np.nan], np.float32))).all()


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 31, 32, 33, 1023])
def test_lengths_not_multiple_of_16(n):
    rng = np.random.default_rng(n)
    x = rng.integers(0x3F800000, 0x40800000, n, dtype=np.uint32).view(np.float32)
    assert_bits_equal(x)


def test_the_correctly_rounded_root_is_not_torchs():
    x = np.arange(0x3F800000, 0x3F800000 + (1 << 20), dtype=np.uint32).view(np.float32)
    ieee = np.sqrt(x).view(np.uint32)
    theirs = torch_sqrt(x).view(np.uint32)
    low = np.flatnonzero(ieee != theirs)
    assert low.size > 1000                              # ~0.6 % of inputs
    assert np.all(theirs[low] == ieee[low] - 1)          # always one unit low


@pytest.mark.slow
def test_every_non_negative_float32():
    """All 2**31 non-negative bit patterns (finite, inf and NaN), in blocks of 2**24."""
    block = 1 << 24
    for start in range(0, 1 << 31, block):
        x = np.arange(start, start + block, dtype=np.uint32).view(np.float32)
        ours = mkl_sqrt.sqrt(x)
        theirs = torch_sqrt(x)
        finite = ~np.isnan(theirs)
        assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32)), hex(start)
        assert np.isnan(ours[~finite]).all()
