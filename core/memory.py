"""Native memory operations of the kernels: acquire loads, release stores, an atomic OR,
memcpy, memcmp, a copy with non-temporal stores, and a prefetch.

Every ring gradtap touches is single-producer/single-consumer with free-running indices,
the protocol of the kernel's own rings (``Documentation/core-api/circular-buffers.rst``,
``net/xdp/xsk_queue.h``, the TPACKET block status word). Its ordering rule:

- the producer writes the entries, then **store-releases** the producer index;
- the consumer **load-acquires** the producer index, reads the entries, then
  **store-releases** the consumer index;
- the producer **load-acquires** the consumer index before it reuses an entry.

``load_acquire`` and ``store_release`` emit LLVM ``load atomic … acquire`` /
``store atomic … release`` on one aligned element of an array. On x86-64 (TSO) both
compile to a plain ``mov`` plus a compiler barrier, which is exactly what is needed there:
the hardware never reorders load→load, store→store or load→store, and the barrier stops
LLVM from caching the index in a register, hoisting it out of a polling loop, or sinking
the entry writes past the index store. On arm64 they become ``ldar``/``stlr``. Relaxed
counters (frames, drops) are plain stores: each has one writer and is read only as a
statistic, or after an acquire of a flag the writer released.

Several parser threads write one iteration's gradient (``parser/shared_gradient.py``). A
unit of it is claimed with :func:`fetch_or` (LLVM ``atomicrmw or … acq_rel``; ``lock or`` /
``lock cmpxchg`` on x86-64, ``ldaxr``/``stlxr`` or ``ldsetal`` on arm64) on a word of claim
bits: the one thread that finds its bit clear writes the unit, then publishes it with another
``fetch_or`` on a word of written bits; a thread that finds the claim taken load-acquires the
written word before it compares its own copy with the unit's bytes.

Buffers that live as long as the process (a stream's gradient slots, the merger's scratch,
the widened gradient) start on a cache line (:func:`aligned_bytes`) and are written whole
when they are made (:func:`prefaulted`): the first touch of fresh anonymous memory is a page
fault per page (4 KiB, or 2 MiB where the kernel gives transparent huge pages, which NumPy
asks for on large arrays), and under a hypervisor each can cost tens of microseconds. Taken
once at start-up, those faults never land on the per-iteration path.

``copy_bytes`` and ``compare_bytes`` call libc's ``memcpy`` and ``memcmp`` (Numba's slice
assignment and comparison are byte loops). They are declared by symbol name, which keeps the
kernels that call them cacheable.

``stream_bytes`` copies into memory that will not be read soon (an iteration's gradient, far
larger than the caches) with non-temporal stores: LLVM ``store … !nontemporal`` of whole
64-byte lines, which the host's widest vector store of that kind carries out (``vmovntdq``
of 64 or 32 bytes, ``movntdq`` of 16 on x86-64; ``stnp`` on arm64). An ordinary store
first reads its line into the cache (read for ownership), so a copy of n bytes moves 3n
bytes through memory; a non-temporal one moves 2n. libc's ``memcpy`` does the same only for
copies larger than a share of the last-level cache, never for a packet. Non-temporal stores
are weakly ordered: the thread that made them runs :func:`store_fence` before another
thread may read the bytes (LLVM ``fence seq_cst``, an ``mfence`` on x86-64, which drains
them; a lock-prefixed instruction is not documented to on every x86-64 vendor).

Under ``NUMBA_DISABLE_JIT=1`` the same names are plain element reads and writes and NumPy
slice copies and comparisons. Each is a separate NumPy call from the interpreter, so nothing
is cached or reordered by a compiler; that path is for coverage runs on x86 only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from gradtap.core.jit import JIT

CACHE_LINE = 64     # bytes, on x86-64 and the arm64 server cores
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def cache_bytes(level: int | None = None,
                cpu_caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the first CPU's data cache at ``level`` (1, 2, ...), or of its highest level
    (the last level, shared by the cores of a die) when None, as the kernel reports it in
    sysfs (``index*/level``, ``type`` and ``size``, e.g. ``32768K``); None where it reports
    none. Instruction caches do not count."""
    best: tuple[int, int] | None = None
    for entry in cpu_caches.glob("index*"):
        try:
            at = int((entry / "level").read_text())
            kind = (entry / "type").read_text().strip() if (entry / "type").exists() else "Unified"
            size = (entry / "size").read_text().strip()
            nbytes = int(size[:-1]) * _SIZE_UNITS[size[-1]] if size[-1:] in _SIZE_UNITS else int(size)
        except (OSError, ValueError):
            continue
        if nbytes <= 0 or kind == "Instruction" or (level is not None and at != level):
            continue
        if best is None or at > best[0]:
            best = (at, nbytes)
    return None if best is None else best[1]


def aligned_bytes(nbytes: int) -> np.ndarray:
    """An uninitialised ``uint8[nbytes]`` whose data starts on a cache line. NumPy aligns
    large arrays to 16 bytes only (glibc's ``mmap`` chunks start 16 bytes into a page), so
    every other 32-byte vector of a kernel would straddle two cache lines."""
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    skip = -raw.ctypes.data % CACHE_LINE
    return raw[skip:skip + nbytes]


def prefaulted(nbytes: int) -> np.ndarray:
    """A zeroed ``uint8[nbytes]`` on a cache line whose every page is mapped now: for a buffer
    made once and reused, so that its page faults are taken at start-up and not where it is
    first written (see the module docstring)."""
    out = aligned_bytes(nbytes)
    out.fill(0)
    return out

if config.DISABLE_JIT:
    def load_acquire(arr, index):
        """``arr[index]`` with acquire ordering (plain read without the JIT)."""
        return arr[index]

    def store_release(arr, index, value):
        """``arr[index] = value`` with release ordering (plain write without the JIT). The
        value is cast to the element type as the compiled store does (an out-of-range
        integer wraps instead of raising)."""
        arr[index] = np.asarray(value).astype(arr.dtype)

    def fetch_or(arr, index, value):
        """``arr[index] |= value``, returning the old value (the interpreter runs one thread
        of the kernel at a time without the JIT)."""
        old = arr[index]
        arr[index] = old | np.asarray(value).astype(arr.dtype)
        return old

    def copy_bytes(dst, dst_pos, src, src_pos, n):
        """``dst[dst_pos:dst_pos+n] = src[src_pos:src_pos+n]``."""
        dst[dst_pos:dst_pos + n] = src[src_pos:src_pos + n]

    def compare_bytes(a, a_pos, b, b_pos, n):
        """0 when ``a[a_pos:a_pos+n]`` equals ``b[b_pos:b_pos+n]``, else nonzero."""
        return 0 if (a[a_pos:a_pos + n] == b[b_pos:b_pos + n]).all() else 1

    stream_bytes = copy_bytes

    def store_fence():
        """Nothing to order without the JIT."""

    def prefetch_bytes(arr, start, stop):
        """Nothing to fetch ahead without the JIT."""
else:
    def _element_pointer(context, builder, arrty, array, index, indexty):
        ary = context.make_array(arrty)(context, builder, array)
        index = context.cast(builder, index, indexty, types.intp)
        return cgutils.get_item_pointer(context, builder, arrty, ary, [index], wraparound=False)

    def _integer_element(arr) -> bool:
        """The intrinsics below take an element of an integer array."""
        return isinstance(arr, types.Array) and isinstance(arr.dtype, types.Integer)

    def _pointer_and_value(context, builder, sig, args):
        """``(&arr[index], value cast to the element type)`` of an ``(arr, index, value)`` call."""
        ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return ptr, context.cast(builder, args[2], sig.args[2], sig.args[0].dtype)

    @intrinsic
    def _load_acquire(typingctx, arr, index):
        if not _integer_element(arr):
            return None

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            return builder.load_atomic(ptr, "acquire", align=arr.dtype.bitwidth // 8)
        return arr.dtype(arr, index), codegen

    @intrinsic
    def _store_release(typingctx, arr, index, value):
        if not _integer_element(arr):
            return None

        def codegen(context, builder, sig, args):
            ptr, val = _pointer_and_value(context, builder, sig, args)
            builder.store_atomic(val, ptr, "release", align=arr.dtype.bitwidth // 8)
            return context.get_dummy_value()
        return types.none(arr, index, value), codegen

    @intrinsic
    def _fetch_or(typingctx, arr, index, value):
        if not _integer_element(arr):
            return None

        def codegen(context, builder, sig, args):
            ptr, val = _pointer_and_value(context, builder, sig, args)
            return builder.atomic_rmw("or", ptr, val, "acq_rel")
        return arr.dtype(arr, index, value), codegen

    @njit(**JIT, inline="always")
    def fetch_or(arr, index, value):
        """Atomically ``arr[index] |= value`` (an aligned integer element), returning the value
        before; acquire and release ordering. The caller checks the bounds."""
        return _fetch_or(arr, index, value)

    @njit(**JIT, inline="always")
    def load_acquire(arr, index):
        """``arr[index]`` (an aligned integer element) loaded with acquire ordering. The
        caller checks the bounds."""
        return _load_acquire(arr, index)

    @njit(**JIT, inline="always")
    def store_release(arr, index, value):
        """``arr[index] = value`` stored with release ordering. The caller checks the bounds."""
        _store_release(arr, index, value)

    _libc_memcpy = types.ExternalFunction(
        "memcpy", types.voidptr(types.uintp, types.uintp, types.uintp))

    _libc_memcmp = types.ExternalFunction(
        "memcmp", types.intc(types.uintp, types.uintp, types.uintp))

    @njit(**JIT, inline="always")
    def copy_bytes(dst, dst_pos, src, src_pos, n):
        """``dst[dst_pos:dst_pos+n] = src[src_pos:src_pos+n]`` (uint8 arrays, ``n >= 0`` bytes)
        by libc memcpy. The caller checks the bounds."""
        _libc_memcpy(dst.ctypes.data + dst_pos, src.ctypes.data + src_pos, n)

    @njit(**JIT, inline="always")
    def compare_bytes(a, a_pos, b, b_pos, n):
        """libc memcmp of ``a[a_pos:a_pos+n]`` and ``b[b_pos:b_pos+n]`` (uint8 arrays, ``n >= 0``
        bytes): 0 when equal. The caller checks the bounds."""
        return _libc_memcmp(a.ctypes.data + a_pos, b.ctypes.data + b_pos, n)

    _LINE = ir.VectorType(ir.IntType(64), CACHE_LINE // 8)

    @intrinsic
    def _stream_line(typingctx, dst, src):
        """Copy the 64 bytes at address ``src`` (any alignment) to address ``dst`` (on a cache
        line) with a non-temporal store."""
        def codegen(context, builder, sig, args):
            line = builder.load(builder.inttoptr(args[1], _LINE.as_pointer()), align=1)
            store = builder.store(line, builder.inttoptr(args[0], _LINE.as_pointer()), align=CACHE_LINE)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return types.none(types.uintp, types.uintp), codegen

    @intrinsic
    def _prefetch(typingctx, address):
        """``llvm.prefetch`` of the cache line at ``address`` for reading, into every cache
        level (``prefetcht0`` on x86-64, ``prfm pldl1keep`` on arm64): a hint, never a fault."""
        def codegen(context, builder, sig, args):
            i8p = ir.IntType(8).as_pointer()
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
                i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)]), "llvm.prefetch.p0i8")
            builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(ir.IntType(32), 0),
                              ir.Constant(ir.IntType(32), 3), ir.Constant(ir.IntType(32), 1)])
            return context.get_dummy_value()
        return types.none(types.uintp), codegen

    @njit(**JIT, inline="always")
    def prefetch_bytes(arr, start, stop):
        """Ask for the cache lines of ``arr[start:stop]`` (a C-contiguous ``uint8`` array),
        clipped to ``arr``, to be read in ahead of their use."""
        base = np.int64(arr.ctypes.data)
        a = (base + max(start, 0)) & ~np.int64(CACHE_LINE - 1)
        end = base + min(stop, arr.shape[0])
        while a < end:
            _prefetch(a)
            a += CACHE_LINE

    @intrinsic
    def _fence(typingctx):
        def codegen(context, builder, sig, args):
            builder.fence("seq_cst")
            return context.get_dummy_value()
        return types.none(), codegen

    @njit(**JIT, inline="always")
    def stream_bytes(dst, dst_pos, src, src_pos, n):
        """``dst[dst_pos:dst_pos+n] = src[src_pos:src_pos+n]`` (uint8 arrays, ``n >= 0`` bytes)
        with non-temporal stores for the whole cache lines of ``dst`` it fills, libc memcpy
        for the rest; :func:`store_fence` before another thread reads them. The caller checks
        the bounds."""
        d, s = np.int64(dst.ctypes.data) + dst_pos, np.int64(src.ctypes.data) + src_pos
        k = min(n, -d % CACHE_LINE)
        _libc_memcpy(d, s, k)
        while k + CACHE_LINE <= n:
            _stream_line(d + k, s + k)
            k += CACHE_LINE
        _libc_memcpy(d + k, s + k, n - k)

    @njit(**JIT, inline="always")
    def store_fence():
        """Order this thread's earlier stores, non-temporal ones included, before its later
        loads and stores."""
        _fence()


@njit(**JIT, inline="always")
def wait_bits(arr, index, bits, polls):
    """Whether every bit of ``bits`` is set in ``arr[index]`` (an aligned integer element),
    load-acquired up to ``polls`` times: for bits another thread is about to set, as a
    stream that claimed a unit of the shared gradient sets its written bit once it has
    copied the unit. The caller checks the bounds."""
    for _ in range(polls):
        if load_acquire(arr, index) & bits == bits:
            return True
    return False


@njit(**JIT)
def acquire(arr, index):
    """:func:`load_acquire` callable from Python (the consumer side of a ring)."""
    return load_acquire(arr, index)


@njit(**JIT)
def release(arr, index, value):
    """:func:`store_release` callable from Python."""
    store_release(arr, index, value)

