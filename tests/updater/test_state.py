"""The replica's flat state: arrays that start on a cache line, and work spans cut on the
cache lines of those arrays."""

from __future__ import annotations

import numpy as np

from gradtap.core.memory import CACHE_LINE
from gradtap.updater.kernels import CHUNK, work_spans
from gradtap.updater.state import FlatLayout, FlatState, aligned_empty
from gradtap.workload.buckets import Bucket
from gradtap.workload.spec import ParamSpec


def test_aligned_empty_starts_on_a_cache_line():
    assert aligned_empty(0).shape == (0,)
    for n in (1, 7, 1000, 3_000_001):
        a = aligned_empty(n)
        assert a.shape == (n,) and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % CACHE_LINE == 0
        a[:] = 1.5
        assert np.all(a == 1.5)


def test_a_copied_state_starts_on_cache_lines_and_equals_the_original():
    state = FlatState(*(aligned_empty(101) for _ in range(3)), step=2, iteration=3, lr=0.1)
    for i, a in enumerate((state.param, state.exp_avg, state.exp_avg_sq)):
        a[:] = np.arange(101, dtype=np.float32) * (i + 1)
    copy = state.copy()
    for a, b in ((state.param, copy.param), (state.exp_avg, copy.exp_avg), (state.exp_avg_sq, copy.exp_avg_sq)):
        assert b.ctypes.data % CACHE_LINE == 0 and np.array_equal(a, b) and not np.shares_memory(a, b)
    assert (copy.step, copy.iteration, copy.lr) == (2, 3, 0.1)


def test_layout_work_is_cut_on_the_flat_arrays_cache_lines():
    """A bucket that starts mid-line gets the work list of its flat offset: every span but
    each tensor's first (and fused tails) starts on a multiple of the chunk in the flat arrays."""
    params = [ParamSpec(name=f"w{i}", shape=(n,), dtype="float32") for i, n in enumerate((5003, 9, 8200))]
    buckets = [Bucket(index=0, params=(0,), offsets=(0,), numel=5003, dtype="float32"),
               Bucket(index=1, params=(1, 2), offsets=(0, 9), numel=8209, dtype="float32")]
    layout = FlatLayout(params, buckets)
    for impl in ("single_tensor", "fused"):
        for b, bucket in enumerate(buckets):
            start = layout.bucket_start[b]
            work = layout.work(b, impl)
            sizes = [params[i].numel for i in bucket.params]
            assert np.array_equal(work, work_spans(sizes, impl, start=start))
            firsts = np.cumsum([0] + sizes[:-1])
            for lo, _, form in work:
                assert form == 1 or lo in firsts or (start + lo) % CHUNK == 0
