"""The ring-index primitives: acquire loads and release stores read and write the element
they name, and really are atomic acquire/release operations in the compiled code (a plain
load would let LLVM cache a producer index across a polling loop). ``fetch_or``, the claim
of a shared gradient's units, hands each bit to exactly one of several threads racing for it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from numba import config, njit

from gradtap.core.memory import acquire, cache_bytes, compare_bytes, copy_bytes, fetch_or, load_acquire, \
    prefetch_bytes, release, store_fence, store_release, stream_bytes, wait_bits
from tests.core.no_jit import run_without_jit


@njit
def _handover(words, slot, value):
    """The producer's publish then the consumer's read of the same index."""
    store_release(words, slot, value)
    return load_acquire(words, slot)


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.uint64])
def test_they_read_and_write_the_named_element(dtype):
    words = np.zeros(8, dtype)
    release(words, 5, 3)
    assert words.tolist() == [0, 0, 0, 0, 0, 3, 0, 0]
    assert acquire(words, 5) == 3
    top = np.iinfo(dtype).max
    assert _handover(words, 2, dtype(top)) == top and words[2] == top


@pytest.mark.skipif(config.DISABLE_JIT, reason="inspects compiled code")
def test_the_compiled_code_holds_acquire_and_release_atomics():
    _handover(np.zeros(4, np.uint32), 1, np.uint32(1))
    ir = "".join(_handover.inspect_llvm().values())
    assert "load atomic i32" in ir and "acquire" in ir
    assert "store atomic i32" in ir and "release" in ir


@njit(nogil=True)
def _claim_all(words, bits, rounds):
    """Claim every bit of every word, ``rounds`` times over; how many claims found their bit
    clear (were won)."""
    won = 0
    for _ in range(rounds):
        for i in range(words.shape[0]):
            for b in range(bits):
                if not fetch_or(words, i, np.int32(1) << b) & (np.int32(1) << b):
                    won += 1
    return won


def test_fetch_or_returns_the_old_value_and_sets_the_bits():
    words = np.zeros(4, np.int32)
    assert _claim_all(words, 5, 1) == 4 * 5 and words.tolist() == [31] * 4
    assert _claim_all(words, 5, 3) == 0


@pytest.mark.skipif(config.DISABLE_JIT, reason="threads race only in compiled code (nogil)")
def test_fetch_or_hands_each_bit_to_exactly_one_racing_thread():
    for trial in range(20):
        words = np.zeros(1 << 14, np.int32)
        with ThreadPoolExecutor(4) as pool:
            won = list(pool.map(lambda _: _claim_all(words, 31, 1), range(4)))
        assert sum(won) == words.size * 31, (trial, won)
        assert (words == np.int32(0x7FFFFFFF)).all()


@pytest.mark.skipif(config.DISABLE_JIT, reason="inspects compiled code")
def test_the_compiled_code_holds_an_atomic_or():
    _claim_all(np.zeros(2, np.int32), 2, 1)
    ir = "".join(_claim_all.inspect_llvm().values())
    # LLVM lowers an ``atomicrmw or`` whose old value is used to a compare-exchange loop.
    assert ("atomicrmw or" in ir or "cmpxchg" in ir) and "acq_rel" in ir


def test_copy_bytes_copies_the_range():
    @njit
    def copy(dst, dp, src, sp, n):
        copy_bytes(dst, dp, src, sp, n)
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(50, np.uint8)
    copy(dst, 10, src, 30, 20)
    assert dst[10:30].tolist() == list(range(30, 50)) and not dst[:10].any() and not dst[30:].any()


@njit
def _stream(dst, dp, src, sp, n):
    stream_bytes(dst, dp, src, sp, n)
    store_fence()


def test_stream_bytes_copies_every_range_as_slice_assignment_does():
    """Every offset into a cache line on both sides, lengths around whole lines, and a
    packet's length: the bytes copied, and none beside them."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 9000, dtype=np.uint8)
    for n in (0, 1, 63, 64, 65, 127, 128, 129, 200, 4096):
        for dp in range(0, 130, 7):
            for sp in (0, 1, 33, 64):
                dst = np.zeros(4500, np.uint8)
                expect = dst.copy()
                expect[dp:dp + n] = src[sp:sp + n]
                _stream(dst, dp, src, sp, n)
                assert np.array_equal(dst, expect), (n, dp, sp)


@pytest.mark.skipif(config.DISABLE_JIT, reason="inspects compiled code")
def test_the_compiled_stream_copy_holds_non_temporal_stores_and_a_fence():
    _stream(np.zeros(256, np.uint8), 0, np.zeros(256, np.uint8), 0, 256)
    ir = "".join(_stream.inspect_llvm().values())
    assert "!nontemporal" in ir and "fence seq_cst" in ir


@njit
def _prefetch(arr, start, stop):
    prefetch_bytes(arr, start, stop)


@pytest.mark.skipif(config.DISABLE_JIT, reason="inspects compiled code")
def test_the_compiled_prefetch_holds_llvm_prefetch_and_changes_nothing():
    data = np.arange(4096, dtype=np.uint8)
    # Every range, the absurd ones of a hostile record included, is clipped to the array.
    for start, stop in ((0, 4096), (100, 200), (-(1 << 40), 1 << 40), (5000, 9000), (300, 100)):
        _prefetch(data, start, stop)
    assert np.array_equal(data, np.arange(4096, dtype=np.uint8))
    ir = "".join(_prefetch.inspect_llvm().values())
    assert "llvm.prefetch" in ir


@njit
def _compare(a, ap, b, bp, n):
    return compare_bytes(a, ap, b, bp, n)


def test_compare_bytes_is_zero_exactly_when_equal():
    a = np.arange(64, dtype=np.uint8)
    b = a.copy()
    b[40] ^= 1
    assert _compare(a, 0, b, 0, 40) == 0 and _compare(a, 0, b, 0, 41) != 0
    assert _compare(a, 41, b, 41, 23) == 0 and _compare(a, 1, b, 0, 10) != 0 and _compare(a, 5, b, 9, 0) == 0


def results() -> dict:
    """The operations' effects, JSON-ready: stores that wrap as the compiled cast does, copies
    and comparisons."""
    words = np.zeros(4, np.uint32)
    _handover(words, 1, 2 ** 32 + 5)
    release(words, 2, -1)
    src, dst = np.arange(32, dtype=np.uint8), np.zeros(32, np.uint8)
    _copy(dst, 3, src, 7, 11)
    streamed = np.zeros(300, np.uint8)
    _stream(streamed, 5, np.arange(300, dtype=np.uint8), 2, 250)
    claims = np.zeros(3, np.int32)
    won = _claim_all(claims, 4, 2)
    _prefetch(streamed, -7, 1 << 20)            # a hint: nothing to see, and nothing raised
    return {"words": words.tolist(), "loaded": int(acquire(words, 2)), "copied": dst.tolist(),
            "streamed": streamed.tolist(),
            "claimed": [int(won), claims.tolist()],
            "compared": [int(_compare(src, 0, dst, 0, 3) == 0), int(_compare(src, 7, dst, 3, 11) == 0),
                         int(_compare(src, 7, dst, 3, 12) == 0)]}


@njit(nogil=True)
def _wait(words, index, bits, polls):
    return wait_bits(words, index, bits, polls)


def test_wait_bits_sees_bits_set_and_gives_up_on_bits_never_set():
    words = np.array([0b0110, 0], np.int32)
    assert _wait(words, 0, 0b0100, 1) and _wait(words, 0, 0b0110, 1)
    assert not _wait(words, 0, 0b0111, 1000), "every bit asked for must be set"
    assert not _wait(words, 1, 1, 0) and not _wait(words, 1, 1, 1 << 12)


@pytest.mark.skipif(config.DISABLE_JIT, reason="threads race only in compiled code (nogil)")
def test_wait_bits_returns_once_another_thread_sets_them():
    """The waiter polls for seconds at most; the bits set from another thread end it at once."""
    words = np.zeros(1, np.int32)
    _wait(words, 0, 1, 1)                   # compiled before the clock starts
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_wait, words, 0, 0b11, 1 << 36)
        fetch_or(words, 0, np.int32(0b01))
        release(words, 0, np.int32(0b11))
        assert waiting.result(timeout=60)


@njit
def _copy(dst, dp, src, sp, n):
    copy_bytes(dst, dp, src, sp, n)


def test_without_jit_the_operations_do_the_same():
    plain = run_without_jit("import json\nfrom tests.core.test_memory import results\nprint(json.dumps(results()))")
    expected = results()
    assert expected["words"] == [0, 5, 2 ** 32 - 1, 0] and expected["compared"] == [0, 1, 0]
    assert json.loads(plain) == expected


def test_a_cache_is_the_data_cache_sysfs_reports_at_its_level_the_last_level_the_highest(tmp_path):
    caches = [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]
    for k, (level, kind, size) in enumerate(caches):
        (tmp_path / f"index{k}").mkdir()
        (tmp_path / f"index{k}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{k}" / "type").write_text(f"{kind}\n")
        (tmp_path / f"index{k}" / "size").write_text(f"{size}\n")
    assert cache_bytes(cpu_caches=tmp_path) == 32 << 20
    assert cache_bytes(1, tmp_path) == 48 << 10 and cache_bytes(2, tmp_path) == 1 << 20
    assert cache_bytes(4, tmp_path) is None
    (tmp_path / "index3" / "size").write_text("2M\n")
    assert cache_bytes(cpu_caches=tmp_path) == 2 << 20
    (tmp_path / "index3" / "size").write_text("garbage\n")          # unreadable: the next level down
    assert cache_bytes(cpu_caches=tmp_path) == 1 << 20 and cache_bytes(3, tmp_path) is None
    (tmp_path / "index0" / "type").unlink()                          # no type: a unified cache
    assert cache_bytes(1, tmp_path) == 48 << 10
    assert cache_bytes(cpu_caches=tmp_path / "absent") is None
    # This host's, as the parser asks: a positive size or None, never an error.
    for level in (None, 1, 2):
        here = cache_bytes(level)
        assert here is None or here > 0
