"""The 256-bit CRC-32 fold: its constants are the Linux kernel's, its plain-Python twin and its
native kernel equal zlib, and ``crc32_update`` equals zlib with the fold and without it (a
process that plays a host without ``vpclmulqdq``)."""

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from numba import config, njit

from benchmarks._hosts import features_without
from gradtap.core.jit import has_feature
from gradtap.wire import crc_fold
from gradtap.wire.crc_fold import BARRETT, BLOCK, K_64, K_128, fold_constant, fold_crc32, fold_crc32_py

NATIVE = has_feature("vpclmulqdq") and has_feature("avx2")


def test_constants_are_the_linux_kernels():
    # arch/x86/crypto/crc32-pclmul_asm.S: R1, R2 (4 lanes on), R3, R4 (1 lane), R5, and P', u'.
    assert (fold_constant(4 * 128 + 32), fold_constant(4 * 128 - 32)) == (0x154442BD4, 0x1C6E41596)
    assert K_128 == (0x1751997D0, 0x0CCAA009E)
    assert K_64 == 0x163CD6124
    assert BARRETT == (0x1DB710641, 0x1F7011641)


@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
def test_twin_equals_zlib(blocks):
    rng = np.random.default_rng(blocks)
    for _ in range(3):
        data = rng.bytes(BLOCK * blocks)
        crc = int(rng.integers(0, 1 << 32))
        assert fold_crc32_py(crc, data, blocks) == zlib.crc32(data, crc)


@njit
def _fold(crc, buf, start, blocks):
    return fold_crc32(crc, buf, start, blocks)


@pytest.mark.skipif(not NATIVE, reason="this CPU has no 256-bit vpclmulqdq (the twin is tested instead)")
@pytest.mark.parametrize("blocks", [1, 2, 3, 32, 33, 1000])
def test_native_fold_equals_zlib_and_twin(blocks):
    rng = np.random.default_rng(100 + blocks)
    for start in (0, 1, 63):
        buf = np.frombuffer(rng.bytes(start + BLOCK * blocks), np.uint8)
        crc = int(rng.integers(0, 1 << 32))
        want = zlib.crc32(buf[start:].tobytes(), crc)
        assert int(_fold(np.uint32(crc), buf, start, blocks)) == want
        if blocks <= 33:
            assert fold_crc32_py(crc, buf[start:].tobytes(), blocks) == want


def test_the_fold_is_taken_wherever_the_host_has_256_bit_vpclmulqdq():
    assert crc_fold.FOLDS == (not config.DISABLE_JIT and NATIVE)


PLAYED = """
import zlib
import numpy as np
from gradtap.wire import crc_fold
from gradtap.wire.icrc import crc32_update
rng = np.random.default_rng(7)
buf = np.frombuffer(rng.bytes(20003), np.uint8)
for n in (0, 1, 255, 256, 257, 4096, 4096 + 58, 19999):
    for start in (0, 3):
        crc = int(rng.integers(0, 1 << 32))
        assert crc32_update(crc, buf, start, start + n) == zlib.crc32(buf[start:start + n].tobytes(), crc), n
print(crc_fold.FOLDS)
"""


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("vpclmulqdq", [True, False])
def test_crc32_update_equals_zlib_with_and_without_the_fold(vpclmulqdq, avx512, tmp_path):
    """Each in a process whose Numba compiles for this CPU with ``vpclmulqdq`` (where it has
    it: the fold) or without it (ISA-L alone), with AVX-512 (where it has it) or without."""
    played = features_without(lambda f: (f.startswith("avx512") and not avx512)
                              or (f == "vpclmulqdq" and not vpclmulqdq))
    if vpclmulqdq and not NATIVE:
        pytest.skip("this CPU has no 256-bit vpclmulqdq to play a host with it")
    if avx512 and not has_feature("avx512f"):
        pytest.skip("this CPU has no AVX-512 to play a host with it")
    env = dict(os.environ, NUMBA_CPU_FEATURES=played, NUMBA_CACHE_DIR=str(tmp_path))
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", PLAYED], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(vpclmulqdq and not config.DISABLE_JIT)]
