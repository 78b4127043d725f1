"""PSN arithmetic: modulo 2**24 as IBTA §9.7.1 says, the same on ints, arrays and in kernels."""

import numpy as np
from numba import njit

from gradtap.wire.headers import bth
from gradtap.wire.psn import PSN_HALF, PSN_MASK, PSN_MODULUS, psn_add, psn_ahead, psn_delta


def test_the_modulus_is_the_bth_field_width():
    assert PSN_MODULUS == 1 << 24 == bth.BTH_PSN_MASK + 1 and PSN_MASK == 0xFFFFFF and PSN_HALF == 1 << 23
    assert bth.unpack(bth.pack(psn=psn_add(PSN_MASK, 1)))["psn"] == 0


def test_wrap_around():
    assert psn_add(PSN_MASK, 3) == 2 and psn_add(1, -3) == PSN_MODULUS - 2
    assert psn_ahead(PSN_MASK - 1, 2) == 4 and psn_ahead(5, 5) == 0 and psn_ahead(6, 5) == PSN_MASK
    assert psn_delta(PSN_MASK - 1, 2) == 4 and psn_delta(2, PSN_MASK - 1) == -4
    assert psn_delta(0, PSN_HALF - 1) == PSN_HALF - 1 and psn_delta(0, PSN_HALF) == -PSN_HALF


def test_arrays_and_unsigned_psns_as_stage_1_stores_them():
    psn = np.array([0, 1, PSN_MASK], np.uint32)
    assert psn_add(psn.astype(np.int64), 2).tolist() == [2, 3, 1]
    assert psn_ahead(np.int64(PSN_MASK), psn).tolist() == [1, 2, 0]
    assert psn_delta(np.int64(3), psn).tolist() == [-3, -2, -4]


@njit
def _in_a_kernel(base, psn, n):
    return psn_add(psn, n), psn_ahead(base, psn), psn_delta(base, psn)


def test_kernels_compute_the_same():
    for base, psn, n in [(PSN_MASK - 1, 2, 5), (2, PSN_MASK - 1, -7), (0, PSN_HALF, PSN_MODULUS)]:
        assert _in_a_kernel(base, psn, n) == (psn_add(psn, n), psn_ahead(base, psn), psn_delta(base, psn))
