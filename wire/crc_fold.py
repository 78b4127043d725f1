"""zlib's CRC-32 of whole 128-byte blocks by carry-less multiplication on 256-bit vectors.

ISA-L's ``crc32_gzip_refl`` (``wire/icrc.py``) folds 128-bit lanes with ``pclmulqdq``; it has
a 512-bit kernel for AVX-512 hosts but none for 256 bits, so a host with ``vpclmulqdq`` and
AVX2 alone (AMD Zen 3, Intel Alder Lake) runs its 128-bit one. On AMD EPYC Zen 3 (2.45 GHz)
that made 9.5-11 GB/s per core, and it was the largest single part of a replay's parse time
(``perf``: ``_fold_128_B_loop``, a quarter of the samples). ``vpclmulqdq`` on ``ymm`` does two of those products in
one instruction at the same rate, so :func:`fold_crc32` folds four ``ymm`` registers (eight
lanes, 128 bytes) per step: 22.4 GB/s against ISA-L's 11.9 on one Zen 3 core, 4 KiB payloads
in cache. From memory both run at what one core can read (9-10 GB/s); there the fold asks
for the lines 4 KiB ahead (``llvm.prefetch``), without which it ran 5% behind ISA-L. 4 KiB is
a frame of a 4096-byte path MTU: the parser checks a frame's ICRC and then places it, and
while it places one frame the next is already on its way, past the page boundary where the
hardware's prefetchers stop (a prefetch past the end of the data is a hint, and never
faults). Against 1 KiB ahead (AMD EPYC Zen 3, KVM; alternated): the 3 streams of
``benchmarks.replay`` parsed on one thread from memory (5.3 GB) in 0.74-1.10 s against
1.15-1.22, best of 5; ``benchmarks.replay`` 1.10-1.44 s (median 1.26) against 1.23-1.55
(median 1.33) over 11 replays each, its parse 0.53-0.63 thread-s per iteration against
0.61-0.66.

AVX-512 hosts with ``vpclmulqdq`` fold here too. ISA-L's 512-bit kernel is the faster on data
in cache (a Xeon, family 6 model 167, KVM, 4174-byte frames, one thread: 45-46 GB/s against
the fold's 35 on 256 KiB), but a parser checks frames as they come from memory, where the
fold's prefetch wins: 12.5-13.3 against 10.8-11.2 GB/s on 1 GiB, 18-25 against 12.2 on 64 MiB
(``benchmarks.icrc``); ``benchmarks.parse``, alternated twice, the whole parser with the ICRC
(``r0-egress``, 1.74 GB of payload) 7.1-7.4 GB/s on one thread against 6.6, 11.8-13.1 on two
against 11.3-11.6, and stage 1 alone 11.4-11.9 on one thread against 10.1; ``benchmarks.replay``'s
replays (3 streams on 2 cores, the ICRC checked in stage 2; alternated twice, 4 replays each
after one that compiles) a median 0.71-0.82 s per 2 iterations against 0.90-0.97, parse
0.68-0.78 thread-s against 0.81-0.91.

The method is the folding of Intel's white paper "Fast CRC Computation for Generic Polynomials
Using PCLMULQDQ Instruction" (Gopal et al., 2009) for a bit-reflected CRC, as the Linux kernel
runs it for the same polynomial (``arch/x86/crypto/crc32-pclmul_asm.S``):

- the CRC state (``~crc``, zlib's inversion undone) is xored into the first four bytes;
- a 128-bit lane ``a`` (low qword ``lo``, high ``hi``) that lies ``d`` bits before lane ``b``
  is replaced by ``clmul(lo, k(d + 32)) ^ clmul(hi, k(d - 32)) ^ b``, congruent to it modulo
  the polynomial, where ``k(e)`` is x^e mod P bit-reflected and shifted left by one
  (:func:`fold_constant`; the tests hold these against the Linux kernel's table);
- the lanes left are folded into the last (256, then 128 bits apart), the 128 bits reduced to
  64 and 32 bits, and those to the CRC by Barrett reduction with ``u = x^64 / P``.

Only whole 128-byte blocks are folded, at least two (shorter runs stay with ISA-L);
:func:`gradtap.wire.icrc.crc32_update` gives what is left to ISA-L. :data:`FOLDS` says whether
this host takes this path. Under ``NUMBA_DISABLE_JIT=1`` it does not (ISA-L is called through
ctypes), and :func:`fold_crc32` is a plain-Python twin of the same steps on Python integers,
which the tests hold against ``zlib.crc32`` on any host; the native one is held to it where the
host has ``vpclmulqdq``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic

from gradtap.core.jit import has_feature
from gradtap.core.memory import CACHE_LINE

BLOCK = 128                 # bytes folded per step: four 256-bit registers
MIN_BLOCKS = 2              # the fewest crc32_update folds (one block is correct too)
PREFETCH = 4096             # bytes ahead of the block being folded that each step asks for
POLY = 0x104C11DB7          # zlib's CRC-32 polynomial, x^32 included (not reflected)


def _divide(a: int) -> tuple[int, int]:
    """Quotient and remainder of the polynomial ``a`` (over GF(2)) divided by P."""
    q = 0
    while a.bit_length() > 32:
        shift = a.bit_length() - 33
        q |= 1 << shift
        a ^= POLY << shift
    return q, a


def _reflect(v: int, bits: int) -> int:
    return int(f"{v:0{bits}b}"[::-1], 2)


def fold_constant(e: int) -> int:
    """x^e mod P, bit-reflected in 32 bits and shifted left by one (33 bits)."""
    return _reflect(_divide(1 << e)[1], 32) << 1


K_1024 = (fold_constant(1024 + 32), fold_constant(1024 - 32))   # one step: 1024 bits on
K_256 = (fold_constant(256 + 32), fold_constant(256 - 32))      # register into register
K_128 = (fold_constant(128 + 32), fold_constant(128 - 32))      # lane into lane
K_64 = fold_constant(64)
BARRETT = (_reflect(POLY, 33), _reflect(_divide(1 << 64)[0], 33))  # (P', u')
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1

# Whether crc32_update folds here: the host's kernels may use 256-bit vpclmulqdq (with or
# without AVX-512: see above).
FOLDS = not config.DISABLE_JIT and has_feature("vpclmulqdq") and has_feature("avx2")


def _clmul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        b >>= 1
    return r


def fold_crc32_py(crc: int, data: bytes, blocks: int) -> int:
    """:func:`fold_crc32`'s steps on Python integers: ``zlib.crc32(data[:128 * blocks], crc)``."""
    lanes = [int.from_bytes(data[16 * j:16 * j + 16], "little") for j in range(8)]
    lanes[0] ^= ~crc & _M32

    def fold(a: int, k: tuple[int, int]) -> int:
        return _clmul(a & _M64, k[0]) ^ _clmul(a >> 64, k[1])

    for b in range(1, blocks):
        lanes = [fold(lanes[j], K_1024) ^ int.from_bytes(data[BLOCK * b + 16 * j:BLOCK * b + 16 * j + 16], "little")
                 for j in range(8)]
    low, high = lanes[0], lanes[1]              # the first register's two lanes
    for j in range(2, 8, 2):
        low, high = fold(low, K_256) ^ lanes[j], fold(high, K_256) ^ lanes[j + 1]
    r = fold(low, K_128) ^ high
    t = _clmul(r & _M64, K_128[1]) ^ (r >> 64)
    t = _clmul(t & _M32, K_64) ^ (t >> 32)
    q = _clmul(t & _M32, BARRETT[1]) & _M32
    return ~((_clmul(q, BARRETT[0]) ^ t) >> 32) & _M32


if config.DISABLE_JIT:
    def fold_crc32(crc, buf, start, blocks):
        """``zlib.crc32(buf[start:start + 128 * blocks], crc)``; ``blocks >= 1``."""
        return np.uint32(fold_crc32_py(int(crc), bytes(buf[start:start + BLOCK * blocks]), int(blocks)))
else:
    _I8, _I32, _I64, _I128 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.IntType(128)
    _Y = ir.VectorType(_I64, 4)
    _X = ir.VectorType(_I64, 2)

    @intrinsic
    def fold_crc32(typingctx, crc, buf, start, blocks):
        """``zlib.crc32(buf[start:start + 128 * blocks], crc)`` as a uint32: ``buf`` a 1-D
        C-contiguous uint8 array, ``blocks >= 1``, the range inside ``buf`` (the caller
        checks; nothing is checked here). Needs ``vpclmulqdq`` and AVX2 (:data:`FOLDS`)."""
        if not (isinstance(buf, types.Array) and buf.dtype == types.uint8 and buf.ndim == 1 and buf.layout == "C"):
            return None
        sig = types.uint32(types.uint32, buf, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            crc, array, start, blocks = args
            module = builder.module
            wide = module.declare_intrinsic("llvm.x86.pclmulqdq.256", (),
                                            ir.FunctionType(_Y, [_Y, _Y, _I8]))
            narrow = module.declare_intrinsic("llvm.x86.pclmulqdq", (), ir.FunctionType(_X, [_X, _X, _I8]))
            prefetch = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [
                ir.IntType(8).as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
            first = builder.gep(context.make_array(signature.args[1])(context, builder, array).data, [start])

            def load(offset):
                return builder.load(builder.bitcast(builder.gep(first, [offset]), _Y.as_pointer()), align=1)

            def fold(x, k, clmul, vector):
                const = ir.Constant(vector, list(k) * (vector.count // 2))
                return builder.xor(builder.call(clmul, [x, const, ir.Constant(_I8, 0x00)]),
                                   builder.call(clmul, [x, const, ir.Constant(_I8, 0x11)]))

            state = builder.zext(builder.xor(crc, ir.Constant(_I32, _M32)), _I64)
            regs = [cgutils.alloca_once_value(builder, load(ir.Constant(start.type, 32 * j))) for j in range(4)]
            builder.store(builder.xor(builder.load(regs[0]), builder.insert_element(
                ir.Constant(_Y, [0] * 4), state, ir.Constant(_I32, 0))), regs[0])
            steps = builder.sub(blocks, ir.Constant(blocks.type, 1))
            with cgutils.for_range(builder, steps) as loop:
                at = builder.mul(builder.add(loop.index, ir.Constant(loop.index.type, 1)),
                                 ir.Constant(loop.index.type, BLOCK))
                for line in range(0, BLOCK, CACHE_LINE):
                    ahead = builder.gep(first, [builder.add(at, ir.Constant(at.type, PREFETCH + line))])
                    builder.call(prefetch, [ahead, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
                for j in range(4):
                    nxt = load(builder.add(at, ir.Constant(at.type, 32 * j)))
                    builder.store(builder.xor(fold(builder.load(regs[j]), K_1024, wide, _Y), nxt), regs[j])
            y = builder.load(regs[0])
            for j in range(1, 4):
                y = builder.xor(fold(y, K_256, wide, _Y), builder.load(regs[j]))
            low = builder.shuffle_vector(y, y, ir.Constant(ir.VectorType(_I32, 2), [0, 1]))
            high = builder.shuffle_vector(y, y, ir.Constant(ir.VectorType(_I32, 2), [2, 3]))
            r = builder.bitcast(builder.xor(fold(low, K_128, narrow, _X), high), _I128)

            def clmul_low(a, k):
                """The 128-bit carry-less product of ``a``'s low 64 bits (i128) by ``k``."""
                operand = builder.bitcast(a, _X)
                const = ir.Constant(_X, [k, 0])
                return builder.bitcast(builder.call(narrow, [operand, const, ir.Constant(_I8, 0x00)]), _I128)

            def bits(v, mask):
                return builder.and_(v, ir.Constant(_I128, mask))

            def shr(v, n):
                return builder.lshr(v, ir.Constant(_I128, n))

            t = builder.xor(clmul_low(bits(r, _M64), K_128[1]), shr(r, 64))
            t = builder.xor(clmul_low(bits(t, _M32), K_64), shr(t, 32))
            q = bits(clmul_low(bits(t, _M32), BARRETT[1]), _M32)
            s = builder.trunc(shr(builder.xor(clmul_low(q, BARRETT[0]), t), 32), _I32)
            return builder.xor(s, ir.Constant(_I32, _M32))

        return sig, codegen
