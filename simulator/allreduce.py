"""NCCL's ring allreduce arithmetic: the exact values each ring step puts on the wire.

``runRing`` (``src/device/all_reduce.h``, NCCL v2.19.3-1, and the same step order in every
era up to v2.30.7-1; only the elements of each chunk change, and those come from the wire
plan, see :func:`chunk_index`) has the rank at ring position
``p`` send, at ring step ``s``, chunk ``c = (p - 1 - s) mod n``. For an element of chunk
``c`` the value sent at reduce-scatter step ``s`` (``s < n-1``) is a running sum that
starts with the own value of position ``c+1`` (``prims.send``) and adds the own values of
positions ``c+2, ..., c+1+s`` one hop at a time (``recvReduceSend``:
``applyReduce(redOp, peerData, data)``, i.e. received + own). At step ``n-1`` position ``c``
adds its own value last and sends the fully reduced sum (``directRecvReduceCopySend``); the
allgather steps forward that value unchanged (``directRecvCopySend``), so every send of
steps ``n-1 .. 2n-3`` carries row ``n-1`` of :func:`ring_partials`, and row ``n-1`` is the
reduced gradient every rank ends up with.

Each hop is one addition in the wire dtype (``FuncSum`` in ``src/device/reduce_kernel.h``):

* fp32: an IEEE binary32 addition, rounded to nearest even. NCCL is built without
  ``-ftz``/``--use_fast_math`` (``makefiles/common.mk``), so subnormals are kept.
* bf16 / fp16: ``__hadd`` on sm_80+ (fp16 already on sm_53+), a correctly rounded 16-bit
  addition; on older GPUs ``__float2bfloat16(__bfloat162float(x) + __bfloat162float(y))``
  (resp. ``__float2half``), i.e. a binary32 addition rounded once more to 16 bits. Both
  give the same bits: binary32 has 24 significand bits, at least ``2p + 2`` for fp16
  (p = 11) and bf16 (p = 8), so the double rounding is innocuous (Figueroa, "When is double
  rounding innocuous?", 1995). This module computes the binary32 sum and rounds it to
  nearest even; ``tests/naive.py`` checks it against exact rational arithmetic rounded once.

NaN payload bits are not modelled (any NaN stays a NaN). Arrays follow the simulator's
wire representation: fp32 as ``float32``, fp16 as ``float16`` and bf16 as the ``uint16``
bit patterns (NumPy has no bfloat16), so the dtype of an array names its wire dtype.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from gradtap.core.errors import PlanError
from gradtap.workload.wire_plan import DATA, PHASE_RS, WirePlan

WIRE_DTYPE_OF = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16", np.dtype(np.uint16): "bf16"}


def wire_dtype_of(array: np.ndarray) -> str:
    """The wire dtype (``fp32``/``fp16``/``bf16``) that ``array``'s NumPy dtype represents."""
    try:
        return WIRE_DTYPE_OF[array.dtype]
    except KeyError:
        raise TypeError(f"wire arrays are float32 (fp32), float16 (fp16) or uint16 bf16 bit "
                        f"patterns; got {array.dtype}") from None


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round binary32 values to the nearest bf16, ties to even (NaNs stay NaN)."""
    bits = values.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        # Rounding could carry a NaN's payload into the exponent (an infinity); keep it quiet.
        rounded[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x0040
    return rounded


@np.errstate(over="ignore", invalid="ignore")  # overflow to infinity is IEEE behaviour, as on the GPU
def _add(acc: np.ndarray, own: np.ndarray, out: np.ndarray) -> None:
    """One ring hop, ``out = acc + own``, rounded to the wire dtype of the operands."""
    if acc.dtype == np.float32:
        np.add(acc, own, out=out)
    elif acc.dtype == np.float16:
        # NumPy's float16 -> float32 is exact and the cast back rounds to nearest even.
        out[...] = acc.astype(np.float32) + own.astype(np.float32)
    else:
        out[...] = _f32_to_bf16(_bf16_to_f32(acc) + _bf16_to_f32(own))


# Elements per block of the reduction: all n rows of a block (n inputs read, n rows
# written) stay in the L2 cache, so each byte crosses the memory bus once instead of once
# per hop (a whole-run hop streams two rows of the bucket through memory and writes a third).
BLOCK_ELEMENTS = 16384


def ring_partials(inputs, chunk_of: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The values the ring puts on the wire during the reduce-scatter, for every element.

    Parameters
        inputs: ``[n, count]`` array, or a sequence of ``n`` 1-D arrays of ``count`` elements
            (no stacked copy is made); row ``p`` is the bucket buffer of ring position ``p`` in
            the wire representation (float32, float16, or uint16 bf16 bit patterns).
        chunk_of: ``[count]`` integer ring chunk (``0..n-1``) of each element, e.g. from
            :func:`chunk_index`.
        out: optional ``[n, count]`` array of the inputs' dtype to write into (a buffer reused
            across buckets: its pages are not faulted in again for every bucket).

    Returns ``[n, count]`` of the same dtype (``out`` if given): row ``s < n-1`` is the
    partial sum sent at reduce-scatter step ``s``; row ``n-1`` is the fully reduced value
    (sent at step ``n-1`` and forwarded by every allgather step). Vectorised: ``n-1`` slice
    additions per block of :data:`BLOCK_ELEMENTS` consecutive elements of one chunk.
    """
    rows = _input_rows(inputs)
    n, count = len(rows), len(rows[0])
    chunk_of = _check_chunks(chunk_of, n, count)
    if out is None:
        out = np.empty((n, count), rows[0].dtype)
    elif out.shape != (n, count) or out.dtype != rows[0].dtype:
        raise ValueError(f"out must be {rows[0].dtype} of shape ({n}, {count}), got {out.dtype} {out.shape}")
    # A plan's chunks are runs of thousands of elements: one slice addition per hop and block.
    for lo_run, hi_run in _runs(chunk_of):
        first = (int(chunk_of[lo_run]) + 1) % n       # the position that sends the run at step 0
        order = [rows[(first + s) % n] for s in range(n)]
        for lo in range(lo_run, hi_run, BLOCK_ELEMENTS):
            hi = min(lo + BLOCK_ELEMENTS, hi_run)
            out[0, lo:hi] = order[0][lo:hi]
            for s in range(1, n):
                _add(out[s - 1, lo:hi], order[s][lo:hi], out[s, lo:hi])
    return out


def ring_sum(inputs, chunk_of: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Row ``n-1`` of :func:`ring_partials` alone: the fully reduced ``[count]`` values, with
    the same additions in the same order, accumulated in place (one row written instead of
    ``n``: what a reduction nobody captures needs). ``inputs`` and ``chunk_of`` as there;
    ``out`` an optional ``[count]`` array of the inputs' dtype."""
    rows = _input_rows(inputs)
    n, count = len(rows), len(rows[0])
    chunk_of = _check_chunks(chunk_of, n, count)
    if out is None:
        out = np.empty(count, rows[0].dtype)
    elif out.shape != (count,) or out.dtype != rows[0].dtype:
        raise ValueError(f"out must be {rows[0].dtype} of shape ({count},), got {out.dtype} {out.shape}")
    for lo_run, hi_run in _runs(chunk_of):
        first = (int(chunk_of[lo_run]) + 1) % n
        order = [rows[(first + s) % n] for s in range(n)]
        for lo in range(lo_run, hi_run, BLOCK_ELEMENTS):
            acc = out[lo:min(lo + BLOCK_ELEMENTS, hi_run)]
            acc[:] = order[0][lo:lo + len(acc)]
            for s in range(1, n):
                _add(acc, order[s][lo:lo + len(acc)], acc)
    return out


def _runs(chunk_of: np.ndarray) -> list[tuple[int, int]]:
    """``(lo, hi)`` of every run of consecutive elements of one chunk."""
    edges = (np.flatnonzero(np.diff(chunk_of)) + 1).tolist()
    return list(zip([0, *edges], [*edges, len(chunk_of)]))


def _check_chunks(chunk_of, n: int, count: int) -> np.ndarray:
    chunk_of = np.asarray(chunk_of)
    if chunk_of.shape != (count,) or not np.issubdtype(chunk_of.dtype, np.integer):
        raise ValueError(f"chunk_of must be an integer array of shape ({count},), got "
                         f"{chunk_of.dtype} {chunk_of.shape}")
    if count and (chunk_of.min() < 0 or chunk_of.max() >= n):
        raise ValueError(f"chunk_of holds chunks outside 0..{n - 1}")
    return chunk_of


def _input_rows(inputs) -> list[np.ndarray]:
    """The ``n`` rows of ``inputs`` (a 2-D array or a sequence of 1-D arrays), checked."""
    if isinstance(inputs, np.ndarray):
        if inputs.ndim != 2 or inputs.shape[0] < 2:
            raise ValueError(f"inputs must be [n >= 2, count], got shape {inputs.shape}")
        wire_dtype_of(inputs)
        return list(inputs)
    rows = [np.asarray(r) for r in inputs]
    if len(rows) < 2 or any(r.ndim != 1 for r in rows):
        raise ValueError(f"inputs must be n >= 2 rows of 1-D arrays, got {len(rows)} rows of "
                         f"shapes {[r.shape for r in rows[:3]]}")
    if any(r.shape != rows[0].shape or r.dtype != rows[0].dtype for r in rows):
        raise ValueError("inputs: every row must have the same length and dtype, got "
                         f"{sorted({(r.shape, str(r.dtype)) for r in rows})}")
    wire_dtype_of(rows[0])
    return rows


def chunk_index(plan: WirePlan, bucket: int) -> np.ndarray:
    """``[count]`` int16 ring chunk of every element of ``bucket``, read from the plan.

    At ring step 0 each position sends one chunk per channel and loop, so the plan's step-0
    reduce-scatter sends tile the bucket; a plan whose step-0 sends do not tile it exactly
    is refused with :class:`PlanError`.
    """
    if not 0 <= bucket < len(plan.bucket_numels):
        raise ValueError(f"bucket {bucket} is not in the plan (0..{len(plan.bucket_numels) - 1})")
    m = plan.messages
    sends = m[(m["kind"] == DATA) & (m["bucket"] == bucket) & (m["phase"] == PHASE_RS)
              & (m["ring_step"] == 0) & (m["part"] == 0) & (m["nelem"] > 0)]
    # Adaptive routing plans two writes per send; both name the same element range.
    _, first = np.unique(sends["elem_offset"], return_index=True)
    sends = sends[first]
    count = plan.bucket_numels[bucket]
    ends = np.cumsum(sends["nelem"])
    if (sends["elem_offset"] != ends - sends["nelem"]).any() or (ends[-1] if len(ends) else 0) != count:
        raise PlanError(f"the step-0 sends of bucket {bucket} do not tile its {count} elements")
    return np.repeat(sends["chunk"].astype(np.int16), sends["nelem"])


def plan_allreduce(plan: WirePlan) -> Callable[[Sequence[np.ndarray], object], np.ndarray]:
    """An ``allreduce(contributions, bucket)`` for :class:`gradtap.simulator.training.Trainer`.

    ``contributions[p]`` is ring position ``p``'s buffer of the bucket whose ``index`` is
    given; the result is the fully reduced buffer (row ``n-1`` of :func:`ring_partials`).
    """
    cache: dict[int, np.ndarray] = {}

    def allreduce(contributions: Sequence[np.ndarray], bucket) -> np.ndarray:
        index = bucket.index
        if index not in cache:
            cache[index] = chunk_index(plan, index)
        return ring_sum(contributions, cache[index])

    return allreduce
