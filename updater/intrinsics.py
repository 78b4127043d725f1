"""float32 operations that Numba does not expose, written as LLVM intrinsics.

PyTorch's CPU kernels are C++ compiled with FMA contraction, and MKL's square root is an
AVX-512 instruction sequence; to equal them bit for bit a kernel needs the same operations:

- :func:`fma32`: ``a * b + c`` with one rounding (``llvm.fma.f32``, ``vfmadd`` on x86).
  With ``fastmath`` off LLVM never contracts a multiply and an add by itself, so every
  fused multiply-add in a kernel is one of these, written where PyTorch has one.
- :func:`div32`: IEEE float32 division. Numba's default error model checks every divisor
  for zero to raise ``ZeroDivisionError``; that branch keeps a loop from vectorising and is
  not what PyTorch does (``x / 0`` is ``inf`` or ``nan``).
- :func:`half_to_f32`, :func:`bf16_to_f32`: widen a 16-bit gradient (its bit pattern as
  ``uint16``; Numba has no float16 on the CPU) to float32. Both are exact; :func:`widen`
  picks one (or none, for a float32 gradient) by type.
- :func:`sumsq8`: the sums of squares of eight interleaved lanes, each square rounded and then
  added (no fused multiply-add), in one ``<8 x float>`` register: the body of ATen's CPU
  2-norm (``updater/norms.py``). Numba compiles the same loop written over eight scalars
  without vectors (it does not run LLVM's SLP vectoriser), at half the speed.
- :func:`rsqrt14`, :func:`rsqrt14x16`: the AVX-512F approximate reciprocal square root
  (``vrsqrt14ss``/``vrsqrt14ps``, relative error below 2**-14), one lane or sixteen.
- :func:`rsqrt12`, :func:`rsqrt12x4`: the SSE one (``rsqrtss``/``rsqrtps``, relative error
  at most 1.5 * 2**-12), one lane or four.

MKL's float32 square roots start from these estimates (``updater/mkl_sqrt.py``). Their
exact output is not specified (each CPU vendor has its own table), so a root built on them
is reproducible only by executing the same instruction on the same CPU. LLVM cannot
vectorise a target intrinsic inside a loop, hence the many-lane forms.

The ``rsqrt14`` pair needs AVX-512F and the ``rsqrt12`` pair SSE (any x86-64); ask
:func:`gradtap.core.jit.has_feature` first, because calling one on a CPU without it fails when
the kernel is compiled. Under ``NUMBA_DISABLE_JIT=1`` the others are plain-Python twins (exact,
slow) and the estimates are unavailable.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from gradtap.core.errors import GradtapError
from gradtap.core.jit import JIT

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V4 = ir.VectorType(_F32, 4)


if config.DISABLE_JIT:
    # Plain-Python twins, so the kernels also run with NUMBA_DISABLE_JIT=1 (coverage). The
    # hardware estimates have no twin (their tables are the CPU's): without the JIT the MKL
    # roots are not reproduced and the updater takes its roots from torch.sqrt
    # (``gradtap.updater.mkl_sqrt.available``).

    def fma32(a, b, c):
        """``a * b + c`` rounded once (float32)."""
        a, b, c = np.float32(a), np.float32(b), np.float32(c)
        if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)):
            return np.float32(float(a) * float(b) + float(c))
        exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        if exact == 0:
            negative = (np.signbit(a) != np.signbit(b)) and np.signbit(c)
            return np.float32(-0.0 if negative else 0.0)
        return _round_f32(exact)

    def div32(a, b):
        """``a / b`` in IEEE float32."""
        with np.errstate(all="ignore"):
            return np.float32(a) / np.float32(b)

    def half_to_f32(bits):
        return np.array([bits], np.uint16).view(np.float16)[0].astype(np.float32)

    def bf16_to_f32(bits):
        return np.array([int(bits) << 16], np.uint32).view(np.float32)[0]

    def sumsq8(src, start, blocks, out):
        """``out[l]``: the sum over ``k < blocks``, in order, of ``src[start + 8k + l]`` squared
        (float32: each square rounded, then each sum)."""
        for lane in range(8):
            acc = np.float32(0)
            for k in range(blocks):
                x = src[start + 8 * k + lane]
                acc = np.float32(acc + np.float32(x * x))
            out[lane] = acc

    def rsqrt14(x):
        raise GradtapError("vrsqrt14 has no plain-Python twin (NUMBA_DISABLE_JIT=1)")

    def rsqrt14x16(src, src_start, dst, dst_start):
        raise GradtapError("vrsqrt14 has no plain-Python twin (NUMBA_DISABLE_JIT=1)")

    def rsqrt12(x):
        raise GradtapError("rsqrtps has no plain-Python twin (NUMBA_DISABLE_JIT=1)")

    def rsqrt12x4(src, src_start, dst, dst_start):
        raise GradtapError("rsqrtps has no plain-Python twin (NUMBA_DISABLE_JIT=1)")

    def widen(x, half):
        """A gradient element as float32: ``x`` itself (float32), or the 16-bit pattern ``x``
        (uint16) read as binary16 when ``half`` is true and as bfloat16 otherwise."""
        if isinstance(x, np.float32):
            return x
        return half_to_f32(x) if half else bf16_to_f32(x)

    def _round_f32(exact: Fraction) -> np.float32:
        """The float32 nearest to ``exact`` (ties to even)."""
        with np.errstate(over="ignore"):
            guess = np.float32(float(exact))
        if not np.isfinite(guess):
            return guess
        best = None
        below, above = np.nextafter(guess, np.float32(-np.inf)), np.nextafter(guess, np.float32(np.inf))
        for cand in (below, guess, above):
            if not np.isfinite(cand):
                continue
            key = (abs(Fraction(float(cand)) - exact), int(np.array([cand]).view(np.uint32)[0]) & 1)
            if best is None or key < best[0]:
                best = (key, cand)
        return best[1]
else:
    @intrinsic
    def fma32(typingctx, a, b, c):
        """``a * b + c`` rounded once (float32)."""
        sig = types.float32(types.float32, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic("llvm.fma", [_F32], ir.FunctionType(_F32, [_F32] * 3))
            return builder.call(fn, args)

        return sig, codegen


    @intrinsic
    def div32(typingctx, a, b):
        """``a / b`` in IEEE float32, without Numba's zero-divisor check."""
        sig = types.float32(types.float32, types.float32)

        def codegen(context, builder, signature, args):
            return builder.fdiv(args[0], args[1])

        return sig, codegen


    @intrinsic
    def half_to_f32(typingctx, bits):
        """The IEEE binary16 number whose bit pattern is ``bits`` (uint16), as float32."""
        sig = types.float32(types.uint16)

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)

        return sig, codegen


    @intrinsic
    def bf16_to_f32(typingctx, bits):
        """The bfloat16 number whose bit pattern is ``bits`` (uint16), as float32."""
        sig = types.float32(types.uint16)

        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
            return builder.bitcast(wide, _F32)

        return sig, codegen


    _V8 = ir.VectorType(_F32, 8)

    @intrinsic
    def sumsq8(typingctx, src, start, blocks, out):
        """``out[0:8]``: lane ``l`` sums ``src[start + 8k + l]`` squared over ``k < blocks``,
        in order, each square rounded and then added (``fmul``, ``fadd``: LLVM contracts
        neither without fast-math flags). ``src`` and ``out`` are 1-D C-contiguous float32;
        the caller guarantees ``src[start:start + 8 * blocks]`` and ``out[0:8]`` exist
        (nothing is checked here)."""
        if not all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 and a.layout == "C"
                   for a in (src, out)):
            return None
        sig = types.void(src, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            dest = context.make_array(signature.args[3])(context, builder, args[3]).data
            acc = cgutils.alloca_once_value(builder, ir.Constant(_V8, [0.0] * 8))
            first = builder.gep(data, [args[1]])
            with cgutils.for_range(builder, args[2]) as loop:
                at = builder.gep(first, [builder.mul(loop.index, ir.Constant(loop.index.type, 8))])
                x = builder.load(builder.bitcast(at, _V8.as_pointer()), align=4)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(x, x)), acc)
            builder.store(builder.load(acc), builder.bitcast(dest, _V8.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen


    # The estimates: one LLVM target intrinsic each, on <n x float> operands. The AVX-512
    # forms also take a pass-through vector and a lane mask (all lanes here).

    def _one_lane(name: str, masked: bool, doc: str):
        """An intrinsic ``f(x)``: the estimate ``name`` of the float32 ``x`` (in lane 0)."""
        def estimate(typingctx, x):
            sig = types.float32(types.float32)

            def codegen(context, builder, signature, args):
                operands = [_V4, _V4, _V4, ir.IntType(8)] if masked else [_V4]
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V4, operands), name)
                lane = builder.insert_element(ir.Constant(_V4, None), args[0], ir.Constant(_I32, 0))
                call = [lane, lane, lane, ir.Constant(ir.IntType(8), -1)] if masked else [lane]
                return builder.extract_element(builder.call(fn, call), ir.Constant(_I32, 0))

            return sig, codegen

        estimate.__doc__ = doc
        estimate.__name__ = estimate.__qualname__ = name.replace(".", "_")
        return intrinsic(estimate)


    def _all_lanes(name: str, lanes: int, masked: bool, doc: str):
        """An intrinsic ``f(src, src_start, dst, dst_start)``: the estimate ``name`` of
        ``src[src_start:src_start + lanes]`` into ``dst[dst_start:...]``.

        Both arrays are 1-D C-contiguous float32; the caller guarantees both ranges are
        inside them (nothing is checked here).
        """
        vector = ir.VectorType(_F32, lanes)
        mask = ir.IntType(lanes)

        def estimate(typingctx, src, src_start, dst, dst_start):
            if not (isinstance(src, types.Array) and isinstance(dst, types.Array)
                    and src.dtype == types.float32 and dst.dtype == types.float32):
                return None
            sig = types.void(src, types.intp, dst, types.intp)

            def codegen(context, builder, signature, args):
                src_arr = context.make_array(signature.args[0])(context, builder, args[0])
                dst_arr = context.make_array(signature.args[2])(context, builder, args[2])
                load_ptr = builder.bitcast(builder.gep(src_arr.data, [args[1]]), vector.as_pointer())
                store_ptr = builder.bitcast(builder.gep(dst_arr.data, [args[3]]), vector.as_pointer())
                operands = [vector, vector, mask] if masked else [vector]
                fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, operands), name)
                value = builder.load(load_ptr, align=4)
                call = [value, value, ir.Constant(mask, -1)] if masked else [value]
                builder.store(builder.call(fn, call), store_ptr, align=4)
                return context.get_dummy_value()

            return sig, codegen

        estimate.__doc__ = doc
        estimate.__name__ = estimate.__qualname__ = name.replace(".", "_")
        return intrinsic(estimate)


    rsqrt14 = _one_lane("llvm.x86.avx512.rsqrt14.ss", True,
                        "``vrsqrt14ss``: approximately ``1 / sqrt(x)`` (float32, AVX-512F).")
    rsqrt14x16 = _all_lanes("llvm.x86.avx512.rsqrt14.ps.512", 16, True,
                            "``vrsqrt14ps`` of 16 floats of ``src`` into ``dst`` (AVX-512F).")
    rsqrt12 = _one_lane("llvm.x86.sse.rsqrt.ss", False,
                        "``rsqrtss``: approximately ``1 / sqrt(x)`` (float32, SSE).")
    rsqrt12x4 = _all_lanes("llvm.x86.sse.rsqrt.ps", 4, False,
                           "``rsqrtps`` of 4 floats of ``src`` into ``dst`` (SSE).")


    def widen(x, half):
        """A gradient element as float32: ``x`` itself (float32), or the 16-bit pattern ``x``
        (uint16) read as binary16 when ``half`` is true and as bfloat16 otherwise."""
        raise NotImplementedError("widen is only callable from Numba-compiled code")


    @overload(widen, jit_options=JIT)
    def _widen(x, half):
        if x == types.float32:
            return lambda x, half: x
        if x == types.uint16:
            return lambda x, half: half_to_f32(x) if half else bf16_to_f32(x)
        return None
