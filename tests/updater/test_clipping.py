"""The clip coefficient equals what torch.nn.utils.clip_grad_norm_ multiplies gradients by."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater.clipping import GradNorms

SIZES = [1, 7, 40000, 1023, 70001, 16]


def grads(seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 1)).astype(np.float32) for n in SIZES]


def flat(gs, offset=0):
    """``gs`` laid out one after the other from element ``offset`` of one buffer (a bucket),
    and where each lies in it: what ``GradNorms.add`` takes."""
    bounds = offset + np.cumsum([0] + [len(g) for g in gs])
    buffer = np.zeros(bounds[-1] + 16, np.float32)
    for g, a, b in zip(gs, bounds, bounds[1:]):
        buffer[a:b] = g
    return buffer, np.stack([bounds[:-1], bounds[1:]], axis=1)


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e6])
@pytest.mark.parametrize("seed", [0, 1])
def test_coefficient_is_clip_grad_norms(max_norm, seed):
    gs = grads(seed)
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in gs]
    for p, g in zip(params, gs):
        p.grad = torch.from_numpy(g.copy())
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = GradNorms(len(gs))
    order = np.random.default_rng(seed).permutation(len(gs))     # buckets arrive in any order
    for chunk in np.array_split(order, 3):
        norms.add(chunk.tolist(), *flat([gs[i] for i in chunk]))
    coef = norms.coefficient(max_norm)
    assert coef.dtype == np.float32 and (coef == 1) == (max_norm == 1e6)
    for p, g in zip(params, gs):
        assert np.array_equal(p.grad.numpy().view(np.uint32), (g * coef).view(np.uint32))


def test_every_parameter_is_needed_once():
    gs = grads(2)
    norms = GradNorms(len(gs))
    norms.add([0, 1], *flat(gs[:2]))
    assert norms.missing == [2, 3, 4, 5]
    with pytest.raises(GradtapError, match="4 are missing"):
        norms.coefficient(1.0)
    with pytest.raises(GradtapError, match="already has a norm"):
        norms.add([1], *flat(gs[1:2]))
    with pytest.raises(GradtapError, match="2 indices for 1"):
        norms.add([2, 3], *flat(gs[2:3]))
    with pytest.raises(GradtapError, match="parameter 6 is not one of the 6"):
        norms.add([6], *flat(gs[2:3]))
    with pytest.raises(GradtapError, match="parameter 4 already has a norm"):
        norms.add([4, 4], *flat(gs[4:5] * 2))             # twice in one bucket


@pytest.mark.parametrize("threads", [1, 2])
def test_norms_depend_neither_on_threads_nor_on_alignment(threads):
    """GradNorms on the replica's thread count (torch's and Numba's), over views at odd
    offsets into one bucket buffer, gives the total and the clipped gradients
    clip_grad_norm_ gives the trainer (its own aligned tensors, torch's default thread
    count). 40000 and 70001 elements: parallel reductions."""
    gs = grads(3)
    max_norm = 1e-2
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in gs]
    for p, g in zip(params, gs):
        p.grad = torch.from_numpy(g.copy())
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    clipped = np.concatenate([p.grad.numpy() for p in params]).view(np.uint32)
    before = torch.get_num_threads(), numba.get_num_threads()
    try:
        torch.set_num_threads(threads)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        for offset in (0, 1, 3):
            norms = GradNorms(len(gs))
            norms.add(list(range(len(gs))), *flat(gs, offset))
            assert norms.total().numpy().view(np.uint32) == total.numpy().view(np.uint32), offset
            coef = norms.coefficient(max_norm)
            assert coef < 1
            assert np.array_equal(np.concatenate([g * coef for g in gs]).view(np.uint32), clipped), offset
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])
