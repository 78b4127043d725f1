"""Each reproduced MKL root equals torch.sqrt bit for bit (brute force) where it is this host's
root, the product's probe says so exactly where torch.sqrt does, and torch's root is not the
correctly rounded one, which is why they exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater import mkl_sqrt
from tests.updater.roots import MKL_ROOTS, require, torch_sqrt, torch_uses


def assert_bits_equal(x, kernel):
    ours = mkl_sqrt.sqrt(x, kernel).view(np.uint32)
    theirs = torch_sqrt(x).view(np.uint32)
    differ = np.flatnonzero(ours != theirs)
    first = differ[:4]
    assert differ.size == 0, (f"{differ.size} of {x.size} differ; first x bits {x.view(np.uint32)[first]}: "
                              f"ours {ours[first]}, torch {theirs[first]}")


@pytest.mark.parametrize("kernel", MKL_ROOTS)
def test_the_probe_agrees_with_torch(kernel):
    """``reproduces_torch`` (the product's probe set) says yes exactly where torch.sqrt on a
    sample of its own does, and no where the kernel cannot run."""
    assert mkl_sqrt.reproduces_torch(kernel) == torch_uses(kernel)
    if not mkl_sqrt.available(kernel):
        assert not mkl_sqrt.reproduces_torch(kernel)


@pytest.mark.parametrize("kernel", MKL_ROOTS)
def test_every_float_in_two_binades_and_the_edges(kernel):
    # [1, 4): every mantissa at both exponent parities. Below 2**-70: subnormals and tiny
    # normals (AVX512 forms the residual at scale, SSE takes its scalar path), every 61st
    # bit pattern. The largest 4096 floats (SSE's scalar path again).
    require(kernel)
    assert_bits_equal(np.arange(0x3F800000, 0x40800000, dtype=np.uint32).view(np.float32), kernel)
    assert_bits_equal(np.arange(0, 0x1C800000, 61, dtype=np.uint32).view(np.float32), kernel)
    assert_bits_equal(np.arange(0x7F7FF000, 0x7F800000, dtype=np.uint32).view(np.float32), kernel)


@pytest.mark.parametrize("kernel", MKL_ROOTS)
def test_random_floats_over_the_whole_range(kernel):
    require(kernel)
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x7F800000, 20_000_000, dtype=np.uint32)
    assert_bits_equal(bits.view(np.float32), kernel)


@pytest.mark.parametrize("kernel", MKL_ROOTS)
def test_specials(kernel):
    require(kernel)
    x = np.array([0.0, -0.0, np.inf, np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                  np.float32(1e-45), 1.0, 4.0], np.float32)
    assert_bits_equal(x, kernel)
    assert np.isnan(mkl_sqrt.sqrt(np.array([-1.0, -1e-45, -np.inf, np.nan], np.float32), kernel)).all()


@pytest.mark.parametrize("kernel", MKL_ROOTS)
@pytest.mark.parametrize("n", [0, 1, 3, 5, 7, 15, 16, 17, 31, 32, 33, 1023])
def test_lengths_not_multiple_of_the_lanes(kernel, n):
    """Short tensors and tails: torch's (MKL's) and ours take their remainders differently."""
    require(kernel)
    rng = np.random.default_rng(n)
    x = rng.integers(0x3F800000, 0x40800000, n, dtype=np.uint32).view(np.float32)
    assert_bits_equal(x, kernel)


def test_a_kernel_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(mkl_sqrt, "has_feature", lambda feature: False)
    for kernel in MKL_ROOTS:
        assert not mkl_sqrt.available(kernel)
        with pytest.raises(GradtapError, match=f"{kernel} needs .* which this CPU does not have"):
            mkl_sqrt.sqrt(np.ones(4, np.float32), kernel)
    with pytest.raises(GradtapError, match="is not one of"):
        mkl_sqrt.sqrt(np.ones(4, np.float32), "mkl")


def test_the_avx2_kernel_needs_sse_as_well_as_fma(monkeypatch):
    """Its estimate is x86's ``rsqrtps``: a CPU that has FMA but not SSE (not an x86) cannot
    run it, and the refusal names what is missing."""
    monkeypatch.setattr(mkl_sqrt, "has_feature", lambda feature: feature == "fma")
    assert mkl_sqrt.missing(mkl_sqrt.AVX2) == ("mkl-avx2 needs rsqrtps and FMA (sse), which this CPU "
                                              "does not have")


def test_the_correctly_rounded_root_is_not_torchs():
    x = np.arange(0x3F800000, 0x3F800000 + (1 << 20), dtype=np.uint32).view(np.float32)
    ieee = np.sqrt(x).view(np.uint32).astype(np.int64)
    theirs = torch_sqrt(x).view(np.uint32).astype(np.int64)
    differ = np.flatnonzero(ieee != theirs)
    assert differ.size > 1000                                   # 0.6 % (AVX512) to 17 % (SSE)
    assert np.all(np.abs(theirs[differ] - ieee[differ]) == 1)   # always by one unit


@pytest.mark.slow
@pytest.mark.parametrize("kernel", MKL_ROOTS)
def test_every_non_negative_float32(kernel):
    """All 2**31 non-negative bit patterns (finite, inf and NaN), in blocks of 2**24. The
    blocks reuse their arrays: fresh ones made the test three times slower (page faults), and
    the NaNs are looked at only in a block whose bits differ."""
    require(kernel)
    block = 1 << 24
    steps = np.arange(block, dtype=np.uint32)
    bits, ours, theirs = np.empty(block, np.uint32), np.empty(block, np.float32), np.empty(block, np.float32)
    x = bits.view(np.float32)
    span = mkl_sqrt.KERNELS[kernel].span
    for start in range(0, 1 << 31, block):
        np.add(steps, np.uint32(start), out=bits)
        span(x, ours)
        torch.sqrt(torch.from_numpy(x), out=torch.from_numpy(theirs))
        if np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)):
            continue
        finite = ~np.isnan(theirs)
        assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32)), hex(start)
        assert np.isnan(ours[~finite]).all()
