r"""Adam and AdamW steps over flat float32 state, bit-exact with PyTorch 2.13's CPU optimizers.

One step, for every element, with the gradient ``g`` as it arrives on the wire:

.. math::

    g &\leftarrow \mathrm{widen}(g_{wire}) \,[/\, N] \cdot c \qquad
        \text{(fp32/bf16/fp16; } N \text{ when summed; } c \text{ the clip coefficient)} \\
    g &\leftarrow g + \lambda\theta \qquad \text{(Adam with weight decay } \lambda) \\
    \theta &\leftarrow \theta\,(1 - \gamma\lambda) \qquad \text{(AdamW)} \\
    m &\leftarrow \mathrm{lerp}(m, g, 1 - \beta_1) \\
    v &\leftarrow \beta_2 v + (1 - \beta_2)\, g^2 \\
    \theta &\leftarrow \theta - \frac{\gamma}{1 - \beta_1^t}\,
        \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}

What makes it *PyTorch's* step is the rounding. Every float64 constant is rounded to
float32 where PyTorch rounds it (:func:`step_constants`), and each element sees the same
float32 operations in the same order, with fused multiply-adds exactly where PyTorch's C++
has them (GCC contracts ``a * b + c`` in the CPU kernels; ``updater/intrinsics.fma32``):

- Adam weight decay: ``fma(θ, f32(λ), g)`` (``add(alpha=)``);
- AdamW weight decay: ``θ · f32(1 − γλ)``;
- first moment (``lerp_``): ``fma(w, g − m, m)`` with ``w = f32(1 − β1)``, or
  ``fma(w − 1, g − m, g)`` when ``w ≥ 0.5``;
- second moment (``mul_`` then ``addcmul_``): ``fma(c·g, g, v·f32(β2))`` with
  ``c = f32(1 − β2)``; fused does the same in its 8-lane blocks but, in the last ``n mod 8``
  elements of each tensor, ``fma(v, f32(β2), (c·g)·g)``;
- root: MKL's ``vsSqrt`` for single-tensor (not correctly rounded, and rounded differently
  by each of MKL's kernels, which MKL picks by CPU: ``updater/mkl_sqrt.py``), IEEE ``sqrt``
  for fused;
- bias correction 2: ``(1 − β2^t) ** 0.5`` (Python ``pow``) for single-tensor,
  ``std::sqrt(1 − β2^t)`` for fused;
- update: ``θ + (f32(−γ/(1 − β1^t)) · m) / (√v / f32(√bc2) + f32(ε))``.

foreach is single-tensor on the CPU: ``torch._foreach_*`` falls back to the same per-tensor
ATen kernels, so one kernel serves both. The fused details were read from the AVX2 build of
``FusedAdamKernel.cpp`` in ``libtorch_cpu.so`` (PyTorch registers no AVX-512 build of it,
so AVX2 runs on AVX-512 hosts too); the tests hold all of it against PyTorch.

Kernels come in four layers: element helpers on scalars (``_moments``, ``_param``), serial
``_span`` functions over one span (slices), ``prange`` drivers over a work list of disjoint
spans (:func:`work_spans`; single-tensor over runs of consecutive spans, see
:func:`_single_tensor_spans`), and the public :func:`adam_step`, which validates. The work
list also carries each span's *form*, which for fused tells the body of a tensor from its
tail.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
import torch
from numba import njit, prange

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT, JIT_PARALLEL
from gradtap.core.vector_math import settle_vector_math
from gradtap.updater import mkl_sqrt
from gradtap.updater.intrinsics import div32, fma32, widen

IMPLEMENTATIONS = ("single_tensor", "foreach", "fused")
CHUNK = 4096        # elements per work span: a span's p, g, m, v (64 KiB) stay in L2
FUSED_LANES = 8     # Vectorized<float>::size() of the AVX2 build that runs torch._fused_adam_
BODY, TAIL = 0, 1   # work-span forms (TAIL only in fused: the last n % 8 of a tensor)
GROUPS_PER_THREAD = 4   # single-tensor: runs of spans per thread (each begins and ends unpaired)

# Where roots come from (``adam_step(sqrt=)``); ``updater.selfcheck`` picks one per host.
SQRT_MKL_AVX512 = mkl_sqrt.AVX512   # single-tensor: MKL's AVX-512 kernel reproduced (AVX-512F)
SQRT_MKL_AVX2 = mkl_sqrt.AVX2       # single-tensor: MKL's AVX2 kernel reproduced (FMA)
SQRT_MKL_SSE = mkl_sqrt.SSE         # single-tensor: MKL's SSE kernel reproduced (x86-64)
SQRT_TORCH = "torch"                # single-tensor: torch.sqrt itself (any CPU; one more pass)
SQRT_IEEE = "ieee"                  # fused: the correctly rounded root, inside the one-pass kernel


class StepConstants(NamedTuple):
    """The float32 scalars of one step, each rounded from float64 where PyTorch rounds it."""

    divide: bool               # the gradient is the sum over ranks: divide by ``world``
    world: np.float32
    clip: np.float32           # clip coefficient; exactly 1 when not clipping (g·1 = g)
    use_l2: bool               # Adam with weight decay: g += λθ
    l2: np.float32
    decay: np.float32          # AdamW: f32(1 − γλ); exactly 1 otherwise
    lerp_small: bool           # |1 − β1| < 0.5: lerp from m, else from g
    lerp_weight: np.float32    # f32(1 − β1), or f32(1 − β1) − 1 when not small
    beta2: np.float32
    one_minus_beta2: np.float32
    bias2_sqrt: np.float32
    eps: np.float32
    neg_step: np.float32       # f32(−γ / (1 − β1^t))


def step_constants(implementation: str, *, decoupled: bool, lr: float, betas: tuple[float, float],
                   eps: float, weight_decay: float, step: int, world: int | None = None,
                   clip: float = 1.0) -> StepConstants:
    """The constants of optimizer step ``step`` (1-based, after the increment), computed in
    Python floats in PyTorch's order for ``implementation``.

    ``world`` is the number of ranks when gradients arrive summed (``None``: pre-divided);
    ``clip`` the float32 clip coefficient (``gradtap.updater.clipping``); ``decoupled`` is AdamW.
    """
    if implementation not in IMPLEMENTATIONS:
        raise GradtapError(f"implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    beta1, beta2 = betas
    t = float(step)                     # torch keeps the step as a float32 tensor
    bias1 = 1 - beta1 ** t
    bias2 = 1 - beta2 ** t
    # _single_tensor_adam: bias_correction2 ** 0.5; _multi_tensor_adam: the same;
    # FusedAdamKernel.cpp: std::sqrt(bias_correction2). pow(x, 0.5) and sqrt(x) can differ.
    bias2_sqrt = math.sqrt(bias2) if implementation == "fused" else bias2 ** 0.5
    w = np.float32(1 - beta1)
    small = bool(abs(w) < np.float32(0.5))
    return StepConstants(
        divide=world is not None, world=np.float32(world or 1), clip=np.float32(clip),
        use_l2=weight_decay != 0 and not decoupled, l2=np.float32(weight_decay),
        decay=np.float32(1 - lr * weight_decay) if decoupled and weight_decay != 0 else np.float32(1),
        lerp_small=small, lerp_weight=w if small else w - np.float32(1),
        beta2=np.float32(beta2), one_minus_beta2=np.float32(1 - beta2),
        bias2_sqrt=np.float32(bias2_sqrt), eps=np.float32(eps), neg_step=np.float32(-(lr / bias1)))


def work_spans(sizes: list[int] | tuple[int, ...], implementation: str, chunk: int = CHUNK,
               start: int = 0) -> np.ndarray:
    """The work list of a bucket whose tensors have ``sizes`` elements, laid out densely in
    that order: rows ``(lo, hi, form)``, disjoint, covering ``[0, sum(sizes))``.

    Spans hold at most ``chunk`` elements and are cut where the flat state arrays cross a
    multiple of ``chunk``, the bucket's first element sitting at flat index ``start``. With
    the default chunk (a whole number of cache lines) and state arrays that start on a cache
    line, every span but a tensor's first then starts on one, so the vector loop over it
    reads and writes no line-splitting vector (parameters, moments; the wire gradient has
    its own alignment). For fused each tensor's last ``n % 8`` elements form their own
    ``TAIL`` span, and body spans never cross a tensor boundary. Where spans are cut does not
    change a result: every element of a body is stepped by the same operations.
    """
    def cut(lo: int, hi: int) -> np.ndarray:
        if lo >= hi:
            return np.empty((0, 3), np.int64)
        first = ((start + lo) // chunk + 1) * chunk - start     # the first flat boundary past lo
        bounds = np.concatenate(([lo], np.arange(first, hi, chunk), [hi])).astype(np.int64)
        return np.stack([bounds[:-1], bounds[1:], np.full(len(bounds) - 1, BODY, np.int64)], axis=1)

    # In NumPy, not a Python list: a 44 M-element bucket has 10,770 spans, whose rows took 3 ms
    # to build in Python, on the update path of the iteration that first stepped the bucket.
    if implementation != "fused":
        return cut(0, int(sum(sizes)))
    rows, offset = [np.empty((0, 3), np.int64)], 0
    for n in sizes:
        body = n - n % FUSED_LANES
        rows.append(cut(offset, offset + body))
        if body < n:
            rows.append(np.array([[offset + body, offset + n, TAIL]], np.int64))
        offset += n
    return np.concatenate(rows)


@njit(**JIT)
def _grad(g, i, c, half):
    x = widen(g[i], half)
    if c.divide:
        x = div32(x, c.world)
    return x * c.clip


@njit(**JIT)
def _moments(p, g, m, v, c, tail):
    """The stepped ``(m, v)`` of one element with parameter ``p`` (read only for Adam's
    weight decay) and float32 gradient ``g``."""
    if c.use_l2:
        g = fma32(p, c.l2, g)
    if c.lerp_small:
        m = fma32(c.lerp_weight, g - m, m)
    else:
        m = fma32(c.lerp_weight, g - m, g)
    if tail:
        return m, fma32(v, c.beta2, (c.one_minus_beta2 * g) * g)
    return m, fma32(c.one_minus_beta2 * g, g, v * c.beta2)


@njit(**JIT)
def _param(p, m, root, c):
    """The stepped parameter of one element with stepped first moment ``m`` and ``root`` the
    root of its stepped second moment."""
    denom = div32(root, c.bias2_sqrt) + c.eps
    return p * c.decay + div32(c.neg_step * m, denom)


@njit(**JIT)
def _given_root(x, root):
    """The ``finish`` of roots taken beforehand (``torch.sqrt``): ``root`` itself."""
    return root


# The element helpers above take and give scalars: with arrays among their arguments, a
# loop calling two of them no longer vectorises (0.44 Gparam/s against 2.25).

@njit(**JIT)
def _moments_span(p, g, m, v, c, half, tail):
    """``m``, ``v`` of one span.

    Spans arrive as slices and are indexed from 0: an index that LLVM can prove
    non-negative needs no wraparound select, which is what lets the loop vectorise.
    """
    for i in range(p.size):
        m[i], v[i] = _moments(p[i], _grad(g, i, c, half), m[i], v[i], c, tail)


@njit(**JIT)
def _params_span(p, m, v, estimate, c, finish):
    """``θ`` of one span whose moments are stepped, ``estimate`` holding its roots' estimates
    (finished by ``finish``, an MKL kernel's ``finish_*``, or roots: :func:`_given_root`)."""
    for i in range(p.size):
        p[i] = _param(p[i], m[i], finish(v[i], estimate[i]), c)


@njit(**JIT)
def _params_and_moments(pa, ma, va, estimate, pb, gb, mb, vb, c, half, finish):
    """``θ`` of span a (as :func:`_params_span`) and, in the same loop, ``m``, ``v`` of span b
    (as :func:`_moments_span`); both ``pa.size`` long."""
    for i in range(pa.size):
        pa[i] = _param(pa[i], ma[i], finish(va[i], estimate[i]), c)
        mb[i], vb[i] = _moments(pb[i], _grad(gb, i, c, half), mb[i], vb[i], c, False)


@njit(**JIT)
def _single_tensor_spans(p, g, m, v, work, first, last, c, half, estimates, finish):
    """The single-tensor step of spans ``work[first:last]``, in turn, with an MKL kernel's
    root: its ``estimates`` pass and its per-element ``finish``.

    A span's roots need its second moments, so a span takes three steps: moments, the
    estimates (an instruction on a whole vector, a pass of its own), then the roots finished
    and the parameters. Done span by span, the moments pass streams ``g``, ``m`` and ``v``
    from memory while the last step, the heavier compute, streams only ``θ``. Here the last
    step of each span shares its loop with the moments of the next, so that memory stays
    busy while the roots and parameters are computed. The elements see the same operations
    in the same order as span by span.
    """
    width = 0
    for w in range(first, last):
        width = max(width, work[w, 1] - work[w, 0])
    estimate, ahead = np.empty(width, np.float32), np.empty(width, np.float32)
    lo, hi = work[first, 0], work[first, 1]
    _moments_span(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], c, half, False)
    estimates(v[lo:hi], estimate[:hi - lo])
    for w in range(first + 1, last):
        a0, a1, b0, b1 = work[w - 1, 0], work[w - 1, 1], work[w, 0], work[w, 1]
        n = min(a1 - a0, b1 - b0)
        _params_and_moments(p[a0:a0 + n], m[a0:a0 + n], v[a0:a0 + n], estimate,
                            p[b0:b0 + n], g[b0:b0 + n], m[b0:b0 + n], v[b0:b0 + n], c, half, finish)
        _params_span(p[a0 + n:a1], m[a0 + n:a1], v[a0 + n:a1], estimate[n:], c, finish)
        _moments_span(p[b0 + n:b1], g[b0 + n:b1], m[b0 + n:b1], v[b0 + n:b1], c, half, False)
        estimates(v[b0:b1], ahead[:b1 - b0])
        estimate, ahead = ahead, estimate
    lo, hi = work[last - 1, 0], work[last - 1, 1]
    _params_span(p[lo:hi], m[lo:hi], v[lo:hi], estimate, c, finish)


@njit(**JIT)
def _groups(spans, threads):
    """Runs of consecutive spans, ``(first, last)`` rows, for a ``prange`` over ``spans``
    spans on ``threads`` threads: ``GROUPS_PER_THREAD`` per thread, or one per span when
    there are fewer."""
    count = min(spans, GROUPS_PER_THREAD * threads)
    bounds = np.empty((count, 2), np.int64)
    for q in range(count):
        bounds[q, 0], bounds[q, 1] = q * spans // count, (q + 1) * spans // count
    return bounds


@njit(**JIT)
def _fused_span(p, g, m, v, c, half, tail):
    """One pass of the fused step over one span: moments, IEEE root, parameters."""
    for i in range(p.size):
        mi, vi = _moments(p[i], _grad(g, i, c, half), m[i], v[i], c, tail)
        m[i] = mi
        v[i] = vi
        p[i] = _param(p[i], mi, np.sqrt(vi), c)


@njit(**JIT)
def _plain(c):
    """Whether a step needs none of the per-element choices of ``_fused_span``: the gradient
    as it arrives (pre-divided, not clipped: ``clip`` is exactly 1), no L2 term, and the
    lerp from ``m`` (``1 − β1 < 0.5``). Adam and AdamW with torch's default betas, and any
    step whose clip coefficient clamps to 1."""
    return not c.divide and c.clip == 1 and not c.use_l2 and c.lerp_small


@njit(**JIT)
def _fused_plain_span(p, g, m, v, c, half):
    """``_fused_span`` of a body span in a :func:`_plain` step: the same operations, without
    the multiply by a clip coefficient of 1 (``x · 1 = x``) and without the branches that
    LLVM keeps inside the loop there (about 3 % of the compute per element)."""
    for i in range(p.size):
        gi = widen(g[i], half)
        mi = fma32(c.lerp_weight, gi - m[i], m[i])
        vi = fma32(c.one_minus_beta2 * gi, gi, v[i] * c.beta2)
        m[i] = mi
        v[i] = vi
        p[i] = _param(p[i], mi, np.sqrt(vi), c)


@njit(**JIT)
def _widen_span(g, out, c, half):
    for i in range(out.size):
        out[i] = _grad(g, i, c, half)


@njit(**JIT_PARALLEL)
def _widen_all(g, out, work, c, half):
    for w in prange(work.shape[0]):
        lo, hi = work[w, 0], work[w, 1]
        _widen_span(g[lo:hi], out[lo:hi], c, half)


# One driver per MKL kernel: a kernel's estimate instruction may not exist on this CPU, so
# each is compiled only when called (after ``mkl_sqrt.reproduces_torch`` said it runs here).
# (The kernel's functions are globals here, not arguments, and the thread count is passed
# in: Numba caches no ``prange`` loop that takes a function or asks for the thread count.)

@njit(**JIT_PARALLEL)
def _single_tensor_mkl_avx512(p, g, m, v, work, c, half, threads):
    groups = _groups(work.shape[0], threads)
    for q in prange(groups.shape[0]):
        _single_tensor_spans(p, g, m, v, work, groups[q, 0], groups[q, 1], c, half,
                             mkl_sqrt.estimates_rsqrt14, mkl_sqrt.finish_avx512)


@njit(**JIT_PARALLEL)
def _single_tensor_mkl_avx2(p, g, m, v, work, c, half, threads):
    groups = _groups(work.shape[0], threads)
    for q in prange(groups.shape[0]):
        _single_tensor_spans(p, g, m, v, work, groups[q, 0], groups[q, 1], c, half,
                             mkl_sqrt.estimates_rsqrt12, mkl_sqrt.finish_avx2)


@njit(**JIT_PARALLEL)
def _single_tensor_mkl_sse(p, g, m, v, work, c, half, threads):
    groups = _groups(work.shape[0], threads)
    for q in prange(groups.shape[0]):
        _single_tensor_spans(p, g, m, v, work, groups[q, 0], groups[q, 1], c, half,
                             mkl_sqrt.estimates_rsqrt12, mkl_sqrt.finish_sse)


_SINGLE_TENSOR_MKL = {SQRT_MKL_AVX512: _single_tensor_mkl_avx512, SQRT_MKL_AVX2: _single_tensor_mkl_avx2,
                      SQRT_MKL_SSE: _single_tensor_mkl_sse}


@njit(**JIT_PARALLEL)
def _moments_all(p, g, m, v, work, c, half):
    for w in prange(work.shape[0]):
        lo, hi = work[w, 0], work[w, 1]
        _moments_span(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], c, half, False)


@njit(**JIT_PARALLEL)
def _params_all(p, m, v, root, work, c):
    for w in prange(work.shape[0]):
        lo, hi = work[w, 0], work[w, 1]
        _params_span(p[lo:hi], m[lo:hi], v[lo:hi], root[lo:hi], c, _given_root)


@njit(**JIT_PARALLEL)
def _fused(p, g, m, v, work, c, half):
    plain = _plain(c)
    for w in prange(work.shape[0]):
        lo, hi = work[w, 0], work[w, 1]
        if plain and work[w, 2] == BODY:
            _fused_plain_span(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], c, half)
        else:
            _fused_span(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], c, half, work[w, 2] == TAIL)


def _check(name: str, a: np.ndarray, n: int, dtype, writeable: bool = False) -> None:
    if a.ndim != 1 or a.shape[0] != n or a.dtype != dtype or not a.flags.c_contiguous:
        raise GradtapError(f"{name} is {a.dtype}{a.shape}; expected a C-contiguous 1-D "
                           f"{np.dtype(dtype)} array of {n} elements")
    if writeable and not a.flags.writeable:
        raise GradtapError(f"{name} is read-only")


def _wire_dtype(wire: str):
    if wire not in ("fp32", "bf16", "fp16"):
        raise GradtapError(f"wire dtype {wire!r} is not one of 'fp32', 'bf16', 'fp16'")
    return np.float32 if wire == "fp32" else np.uint16


def _check_work(work: np.ndarray, n: int) -> None:
    if work.ndim != 2 or work.shape[1] != 3 or (work.size and (work[0, 0] != 0 or work[-1, 1] != n)):
        raise GradtapError(f"the work list does not cover the bucket's {n} elements")


def widen_gradient(g: np.ndarray, out: np.ndarray, work: np.ndarray, c: StepConstants, *,
                   wire: str = "fp32") -> None:
    """``out = widen(g) [/ world] * clip``: a wire gradient as the float32 ``.grad`` the
    trainer sees (before clipping, pass ``c`` with ``clip=1``). Arrays as in
    :func:`adam_step`."""
    n = out.shape[0]
    _check("widen_gradient: g", g, n, _wire_dtype(wire))
    _check("widen_gradient: out", out, n, np.float32, writeable=True)
    _check_work(work, n)
    _widen_all(g, out, work, c, wire == "fp16")


def adam_step(implementation: str, p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray,
              work: np.ndarray, c: StepConstants, *, wire: str = "fp32", sqrt: str) -> None:
    """One Adam/AdamW step of a bucket, in place, with the rounding of ``implementation``.

    Parameters
    ----------
    p, m, v:
        The bucket's parameters, ``exp_avg`` and ``exp_avg_sq``: 1-D C-contiguous float32
        arrays of ``n`` elements (the bucket's tensors laid out densely).
    g:
        The bucket's gradient on the wire: ``n`` float32 (``wire="fp32"``) or the ``n``
        uint16 bit patterns of bf16/fp16 values.
    work:
        :func:`work_spans` of the bucket's tensor sizes for this implementation.
    c:
        :func:`step_constants` of this step.
    sqrt:
        Where single-tensor roots come from: ``SQRT_MKL_AVX512``, ``SQRT_MKL_AVX2`` or
        ``SQRT_MKL_SSE`` (one pass per span; refused unless ``mkl_sqrt.reproduces_torch``
        holds for it here) or ``SQRT_TORCH`` (``torch.sqrt`` on the whole bucket between two
        passes; any host). Fused takes only ``SQRT_IEEE``.
        ``gradtap.updater.selfcheck.root_source`` gives the fastest exact one for a job on
        this host.
    """
    n = p.shape[0]
    _check("adam_step: g", g, n, _wire_dtype(wire))
    for name, a in (("p", p), ("m", m), ("v", v)):
        _check(f"adam_step: {name}", a, n, np.float32, writeable=True)
    _check_work(work, n)
    half = wire == "fp16"
    if implementation == "fused":
        if sqrt != SQRT_IEEE:
            raise GradtapError(f"fused Adam takes the IEEE root (sqrt={SQRT_IEEE!r}), not {sqrt!r}")
        _fused(p, g, m, v, work, c, half)
    elif implementation not in IMPLEMENTATIONS:
        raise GradtapError(f"implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    elif sqrt in _SINGLE_TENSOR_MKL:
        if not mkl_sqrt.reproduces_torch(sqrt):
            why = mkl_sqrt.missing(sqrt) or f"{sqrt} runs here but torch.sqrt rounds otherwise"
            raise GradtapError(f"sqrt={sqrt!r} is not this host's torch.sqrt ({why}); "
                               f"pass sqrt={SQRT_TORCH!r}, or what selfcheck.root_source picks")
        _SINGLE_TENSOR_MKL[sqrt](p, g, m, v, work, c, half, numba.get_num_threads())
    elif sqrt == SQRT_TORCH:
        _moments_all(p, g, m, v, work, c, half)
        settle_vector_math()
        root = torch.sqrt(torch.from_numpy(v)).numpy()
        _params_all(p, m, v, root, work, c)
    else:
        raise GradtapError(f"sqrt {sqrt!r} is not one of {(*_SINGLE_TENSOR_MKL, SQRT_TORCH)}")
