"""Per-parameter gradient 2-norms, bit for bit those of this host's PyTorch, on every core.

``clip_grad_norm_`` takes each parameter's norm with ``torch._foreach_norm``. On the CPU that
is ``at::linalg_vector_norm`` of each tensor in turn, and ATen reduces a contiguous tensor to
its norm on one thread (``aten/src/ATen/native/cpu/ReduceOpsKernel.cpp``,
``norm_kernel_tensor_iterator_impl``, the ``p = 2`` path through
``binary_kernel_reduce_lastdim``), in this order:

- eight lanes: lane ``l`` accumulates ``x[8k + l]`` squared for ``k = 0, 1, ...``
  (``norm_two_reduce_step``: ``acc_vec += data_vec * data_vec``, a vector multiply, then a
  vector add);
- the lanes are folded left into lane 0 (``buffer[0] = buffer[0] + buffer[j]``);
- the last ``n mod 8`` elements are added one by one (``buffer[0] += x * x``). As compiled,
  the first four of them (when there are four or more) are squared and then added, and the
  rest with fused multiply-adds: GCC unrolls that loop by four and contracts only its
  remainder. This was found against torch 2.13 on an AVX-512 Xeon (every remainder, 300
  random tensors each);
- the IEEE square root. A tensor of one element is not reduced at all: its norm is ``|x|``
  (which differs from the root of its square where the square underflows or overflows).

Eight lanes, because the kernel is the AVX2 build's ``Vectorized<float>`` also on AVX-512
hosts: ATen registers no AVX-512 build of this stub (``REGISTER_DISPATCH`` without
``ALSO_REGISTER_AVX512_DISPATCH``). That this is what runs is a fact about the host, so it is
checked at start-up as the optimizer's kernels are (:func:`reproduces_torch`, on a probe of
awkward sizes and magnitudes); where it fails (an x86-64 build without FMA, another
architecture, another torch), :func:`param_norms` takes torch's own norms instead.

A norm is one chain of additions per lane, which no split keeps exact, so the speed comes
from taking different parameters on different cores, the largest first. In a GPT-2 small
replay of 2 iterations on a 2-vCPU Xeon, torch's norms took 0.103-0.115 s on one core while
the other waited, and these 0.078-0.089 s: the token embedding, a third of the model in one
tensor, still takes one core (``benchmarks.replay``'s job, 3 alternations of 5 replays).
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numba
import numpy as np
import torch
from numba import njit, prange

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT, JIT_PARALLEL
from gradtap.updater.intrinsics import fma32, sumsq8

log = logging.getLogger(__name__)

LANES = 8                           # Vectorized<float>::size() of ATen's AVX2 build
TAIL_UNROLL = 4                     # the tail loop's unrolled steps, which GCC leaves unfused
# Every remainder modulo 8, with and without a body, and a few long ones.
PROBE_SIZES = (*range(1, 17), 1023, 4099, 100_005)


@njit(**JIT)
def _norm(grad, lo, hi, lanes):
    """The 2-norm of ``grad[lo:hi]`` in ATen's order; ``lanes``: float32[8] scratch."""
    if hi - lo == 1:
        return abs(grad[lo])
    blocks = (hi - lo) // LANES
    sumsq8(grad, lo, blocks, lanes)
    total = lanes[0]
    for j in range(1, LANES):
        total = total + lanes[j]
    tail = lo + blocks * LANES
    fused = tail + (hi - tail) // TAIL_UNROLL * TAIL_UNROLL
    for i in range(tail, fused):
        total = total + grad[i] * grad[i]
    for i in range(fused, hi):
        total = fma32(grad[i], grad[i], total)
    return np.sqrt(total)


@njit(**JIT_PARALLEL)
def _norms(grad, spans, shares, bounds, out):
    """``out[k]``: the norm of ``grad[spans[k, 0]:spans[k, 1]]``; thread ``t`` takes the
    parameters ``shares[bounds[t]:bounds[t + 1]]``."""
    for t in prange(bounds.shape[0] - 1):
        lanes = np.empty(LANES, np.float32)
        for j in range(bounds[t], bounds[t + 1]):
            k = shares[j]
            out[k] = _norm(grad, spans[k, 0], spans[k, 1], lanes)


def _shares(sizes: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """The parameters dealt to ``threads`` threads, the largest first to the least loaded
    (a static split of a bucket's parameters in order leaves one thread most of the bytes):
    their indices, thread by thread, and where each thread's begin."""
    load, dealt = [0] * threads, [[] for _ in range(threads)]
    for k in np.argsort(-sizes, kind="stable").tolist():
        t = load.index(min(load))
        load[t] += int(sizes[k])
        dealt[t].append(k)
    return (np.array([k for d in dealt for k in d], np.int64),
            np.cumsum([0] + [len(d) for d in dealt]).astype(np.int64))


def _kernel_norms(grad: np.ndarray, spans: np.ndarray) -> np.ndarray:
    out = np.empty(len(spans), np.float32)
    shares, bounds = _shares(spans[:, 1] - spans[:, 0], max(1, min(numba.get_num_threads(), len(spans))))
    _norms(grad, spans, shares, bounds, out)
    return out


def _torch_norms(grad: np.ndarray, spans: np.ndarray) -> np.ndarray:
    tensors = [torch.from_numpy(grad[lo:hi]) for lo, hi in spans.tolist()]
    return np.array([n.item() for n in torch._foreach_norm(tensors, 2.0)], np.float32)


@lru_cache(maxsize=1)
def reproduces_torch() -> bool:
    """Whether the kernel's norms equal ``torch._foreach_norm``'s here, bit for bit, on a
    probe of sizes around the lane count and magnitudes from 1e-30 to 1e15 (warns when not)."""
    rng = np.random.default_rng(0)
    sizes = [n for n in PROBE_SIZES for _ in range(4)]
    bounds = np.cumsum([0, *sizes])
    grad = np.concatenate([(rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 15)).astype(np.float32)
                           for n in sizes])
    spans = np.stack([bounds[:-1], bounds[1:]], axis=1).astype(np.int64)
    ours, theirs = _kernel_norms(grad, spans), _torch_norms(grad, spans)
    same = bool(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)))
    if not same:
        log.warning("gradient norms come from torch, on one core: this host's torch norm is not ATen's AVX2 "
                    "reduction (%d of %d probe norms differ)", int((ours != theirs).sum()), len(sizes))
    return same


def param_norms(grad: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """float32[k]: the 2-norm of each parameter ``grad[spans[k, 0]:spans[k, 1]]``, as
    ``torch._foreach_norm`` gives it on this host.

    ``grad``: 1-D C-contiguous float32; ``spans``: int64[k, 2] of ``start <= stop`` within it.
    """
    spans = np.ascontiguousarray(spans, np.int64).reshape(-1, 2)
    if grad.ndim != 1 or grad.dtype != np.float32 or not grad.flags.c_contiguous:
        raise GradtapError(f"param_norms: grad is {grad.dtype}{grad.shape}; expected a C-contiguous 1-D float32 "
                           "array")
    if len(spans) and ((spans[:, 0] < 0) | (spans[:, 1] < spans[:, 0]) | (spans[:, 1] > len(grad))).any():
        raise GradtapError(f"param_norms: spans must lie within the {len(grad)} elements of grad")
    return _kernel_norms(grad, spans) if reproduces_torch() else _torch_norms(grad, spans)
