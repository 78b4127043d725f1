"""The one protocol encoding: names as NCCL spells them, units, and use inside kernels."""

import pytest
from numba import njit

from gradtap.wire.protocol import Protocol


def test_names_map_both_ways():
    for name in ("Simple", "LL", "LL128"):
        assert Protocol.of(name).nccl_name == name
    with pytest.raises(ValueError, match="'LL256' is not one of Simple, LL, LL128"):
        Protocol.of("LL256")


def test_wire_bytes_are_whole_units():
    assert [Protocol.SIMPLE.wire_bytes(n) for n in (0, 1, 17)] == [0, 1, 17]
    assert [Protocol.LL.wire_bytes(n) for n in (0, 1, 8, 9)] == [0, 16, 16, 32]
    assert [Protocol.LL128.wire_bytes(n) for n in (0, 1, 1920, 1921)] == [0, 2048, 2048, 4096]


@njit
def _is_ll128(protocol):
    return protocol == Protocol.LL128


def test_kernels_compare_members_and_ints():
    assert _is_ll128(Protocol.LL128) and not _is_ll128(Protocol.LL)
    assert _is_ll128(2) and not _is_ll128(0)
