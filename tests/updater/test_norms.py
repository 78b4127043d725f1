"""Per-parameter norms (``updater/norms.py``) equal ``torch._foreach_norm``'s, bit for bit.

The kernel reproduces the order of ATen's reduction, which is a fact about the host's torch
build, so the product checks it at start-up (``reproduces_torch``) and otherwise takes
torch's norms. These tests hold whatever the host: ``param_norms`` must equal torch either
way, the fallback is exercised on every host, and the kernel itself wherever the check
passes (an x86-64 host with AVX2 and FMA; the test says so when it is skipped).
"""

from __future__ import annotations

import json
import logging

import numba
import numpy as np
import pytest
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater import norms
from gradtap.updater.norms import param_norms, reproduces_torch
from tests.core.no_jit import run_without_jit

# Every remainder modulo 8 with and without a body of whole lanes, and long ones.
SIZES = [*range(0, 34), 1023, 4096, 4099, 100_003]


def torch_norms(grad, spans):
    return np.array([t.item() for t in torch._foreach_norm([torch.from_numpy(grad[a:b]) for a, b in spans], 2.0)],
                    np.float32)


def bucket(rng, sizes, scale=None, offset=0):
    """Gradients of ``sizes`` one after another from element ``offset`` of one buffer, each at
    a magnitude from 1e-30 (squares below float32's range) to 1e19 (squares past it)."""
    bounds = offset + np.cumsum([0, *sizes])
    grad = np.zeros(bounds[-1] + 7, np.float32)
    for a, b in zip(bounds, bounds[1:]):
        s = 10.0 ** (rng.uniform(-30, 19) if scale is None else scale)
        grad[a:b] = rng.standard_normal(b - a) * s
    return grad, np.stack([bounds[:-1], bounds[1:]], axis=1)


def same_bits(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("seed", range(3))
def test_param_norms_are_torchs(seed):
    rng = np.random.default_rng(seed)
    for offset in (0, 1, 5):
        grad, spans = bucket(rng, rng.permutation(SIZES), offset=offset)
        assert same_bits(param_norms(grad, spans), torch_norms(grad, spans))
    grad, spans = bucket(rng, SIZES, scale=-2)      # gradients of an ordinary size
    assert same_bits(param_norms(grad, spans), torch_norms(grad, spans))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_torchs_on_any_thread_count(threads):
    if not reproduces_torch():
        pytest.skip("this host's torch norm is not ATen's AVX2 reduction: the replica takes torch's norms here")
    rng = np.random.default_rng(threads)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        grad, spans = bucket(rng, [*SIZES, *SIZES])
        assert same_bits(norms._kernel_norms(grad, spans), torch_norms(grad, spans))
        big = (rng.standard_normal(3_000_005) * 1e-3).astype(np.float32)
        whole = np.array([[0, len(big)], [1, len(big) - 2]], np.int64)
        assert same_bits(norms._kernel_norms(big, whole), torch_norms(big, whole))
    finally:
        numba.set_num_threads(before)


def test_special_values_come_out_as_torchs():
    grad = np.array([0, 0, 0, np.inf, 1, 2, -np.inf, 3, 1e-45, -1e-45, 3e38, 3e38, 0, -0.0, 5, 7, 9], np.float32)
    spans = np.array([[0, 3], [3, 6], [6, 8], [8, 10], [10, 12], [12, 14], [14, 15], [0, 17], [5, 5]], np.int64)
    assert same_bits(param_norms(grad, spans), torch_norms(grad, spans))
    with_nan = np.array([1, np.nan, 2, 3, 4, 5, 6, 7, 8], np.float32)
    assert np.isnan(param_norms(with_nan, np.array([[0, 9], [1, 2]]))).all()


def test_where_the_kernel_is_not_torchs_the_replica_takes_torchs_norms(monkeypatch, caplog):
    """A planted difference (torch's norms one ulp away) fails the start-up check, with a
    warning, and the norms then come from torch."""
    real = norms._torch_norms
    monkeypatch.setattr(norms, "_torch_norms", lambda g, s: np.nextafter(real(g, s), np.float32(np.inf)))
    norms.reproduces_torch.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="gradtap.updater.norms"):
            assert not reproduces_torch()
        assert "gradient norms come from torch" in caplog.text
        grad, spans = bucket(np.random.default_rng(9), [5, 17, 4099], scale=0)
        assert same_bits(param_norms(grad, spans), norms._torch_norms(grad, spans))
    finally:
        norms.reproduces_torch.cache_clear()


def test_parameters_are_dealt_largest_first_to_the_least_loaded_thread():
    sizes = np.array([5, 100, 7, 60, 50, 1, 0])
    shares, bounds = norms._shares(sizes, 2)
    assert sorted(shares.tolist()) == list(range(len(sizes)))
    loads = [int(sizes[shares[bounds[t]:bounds[t + 1]]].sum()) for t in range(2)]
    assert sorted(loads) == [111, 112]            # 60+50+1+0 | 100+7+5
    shares, bounds = norms._shares(sizes[:1], 1)
    assert shares.tolist() == [0] and bounds.tolist() == [0, 1]


def test_bad_input_is_refused_with_what_was_given():
    grad = np.zeros(10, np.float32)
    with pytest.raises(GradtapError, match="float64"):
        param_norms(np.zeros(10), np.array([[0, 10]]))
    with pytest.raises(GradtapError, match="within the 10 elements"):
        param_norms(grad, np.array([[0, 11]]))
    with pytest.raises(GradtapError, match="within the 10 elements"):
        param_norms(grad, np.array([[4, 3]]))
    with pytest.raises(GradtapError, match="C-contiguous"):
        param_norms(np.zeros(20, np.float32)[::2], np.array([[0, 10]]))
    assert param_norms(grad, np.zeros((0, 2), np.int64)).shape == (0,)


NO_JIT = """
import numpy as np
from gradtap.updater import norms
from tests.updater.test_norms import SMALL, bucket
grad, spans = bucket(np.random.default_rng(4), SMALL)
print(norms._kernel_norms(grad, spans).view(np.uint32).tolist())
"""
SMALL = [*range(0, 21), 100]


def test_the_kernel_run_as_plain_python_is_torchs_too():
    """Under ``NUMBA_DISABLE_JIT=1`` (coverage) the kernel runs its plain-Python twins
    (``updater/intrinsics.py``'s ``sumsq8``); they follow the same order."""
    grad, spans = bucket(np.random.default_rng(4), SMALL)
    plain = np.array(json.loads(run_without_jit(NO_JIT)), np.uint32).view(np.float32)
    assert same_bits(plain, torch_norms(grad, spans))
