"""Protocol encoders against the slow twins of tests/naive.py: the LL line decoder and the
lane-by-lane simulation of NCCL's LL128 warp (prims_ll128.h, v2.19.3-1)."""

import numpy as np
import pytest

from gradtap.simulator import payload as P
from gradtap.wire.ll128 import LL128_DATA_TO_WIRE
from gradtap.wire.protocol import Protocol
from tests import naive
from gradtap.workload import nccl as N
from gradtap.workload.spec import parse_job

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 100, 1919, 1920, 1921, 2047, 2048, 3840, 3845, 12345, 65536]
DECODE = {Protocol.SIMPLE: naive.decode_simple, Protocol.LL: naive.decode_ll, Protocol.LL128: naive.decode_ll128}


def random_bytes(rng, n):
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def test_ll128_permutation_is_the_simulated_warp():
    """Tag every data word with its index, run the 32 simulated lanes, read where each went."""
    wire = naive.ll128_encode_slice(list(range(240)), flag=-1)
    assert [w for w in range(256) if wire[w] == -1] == list(range(15, 256, 16))
    where = {value: w for w, value in enumerate(wire) if value != -1}
    assert np.array_equal(LL128_DATA_TO_WIRE, [where[d] for d in range(240)])


def test_ll128_permutation_is_not_linear():
    linear = np.array([w for w in range(256) if w % 16 != 15])
    assert (LL128_DATA_TO_WIRE != linear).sum() > 100


@pytest.mark.parametrize("protocol", list(Protocol))
@pytest.mark.parametrize("size", SIZES)
def test_round_trip_through_the_naive_decoder(protocol, size):
    rng = np.random.default_rng(size)
    data = random_bytes(rng, size)
    flag = 0x1_2345_6789 + size
    wire = P.encode(protocol, data, flag)
    assert wire.dtype == np.uint8 and len(wire) == protocol.wire_bytes(size)
    got, flags = DECODE[protocol](wire.tobytes())
    assert got[:size] == data.tobytes()
    assert not any(got[size:])                      # the unused tail is zero-filled
    if protocol == Protocol.LL:
        assert flags == [flag & 0xFFFFFFFF] * (len(wire) // 16)
    elif protocol == Protocol.LL128:
        assert flags == [flag] * (len(wire) // 128)


@pytest.mark.parametrize("size", [1, 16, 1000, 1920, 1921, 5000, 9999])
def test_ll128_equals_the_lane_simulation_byte_for_byte(size):
    data = random_bytes(np.random.default_rng(size), size)
    assert P.encode(Protocol.LL128, data, 77).tobytes() == naive.encode_ll128(data.tobytes(), 77)


def test_ll_line_layout_literal():
    data = np.frombuffer(bytes(range(1, 13)), dtype=np.uint8)
    wire = P.encode(Protocol.LL, data, 3).tobytes()
    assert wire == (bytes([1, 2, 3, 4]) + b"\x03\0\0\0" + bytes([5, 6, 7, 8]) + b"\x03\0\0\0"
                    + bytes([9, 10, 11, 12]) + b"\x03\0\0\0" + bytes(4) + b"\x03\0\0\0")


@pytest.mark.parametrize("protocol", ["LL", "LL128"])
@pytest.mark.parametrize("elem,dtype", [(4, "fp32"), (2, "bf16")])
def test_encoded_size_is_the_plans(protocol, elem, dtype):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:00:0{i + 1}"} for i in range(2)]
    job = parse_job({"name": "t", "model": {"params": [{"name": "w", "shape": [8]}]},
                     "ddp": {"grad_dtype": dtype}, "nccl": {"protocol": protocol},
                     "ring": {"ranks": ranks}, "mirrors": [{"name": "m", "rank": 0, "direction": "egress"}]})
    geo = N.geometry(job.nccl, 2)
    for nelem in [0, 1, 2, 3, 479, 480, 481, 960, 4097, 100_000]:
        encoded = P.encode(Protocol.of(protocol), np.zeros(nelem * elem, np.uint8), 1)
        assert len(encoded) == geo.wire_bytes(nelem, elem)


@pytest.mark.parametrize("protocol", list(Protocol))
def test_batch_equals_one_by_one(protocol):
    rng = np.random.default_rng(5)
    sizes = np.concatenate([rng.integers(0, 5000, size=40), [0, 0, 1920, 8, 3]])
    rng.shuffle(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    data = random_bytes(rng, int(offsets[-1]))
    flags = rng.integers(1, 1 << 40, size=len(sizes)).astype(np.uint64)
    wire, wire_offsets = P.encode_batch(protocol, data, offsets, flags)
    assert wire_offsets[-1] == len(wire)
    for i in range(len(sizes)):
        one = P.encode(protocol, data[offsets[i]:offsets[i + 1]], int(flags[i]))
        assert np.array_equal(wire[wire_offsets[i]:wire_offsets[i + 1]], one), i


def test_batch_of_a_slice_of_a_larger_buffer():
    data = random_bytes(np.random.default_rng(9), 1000)
    wire, offs = P.encode_batch(Protocol.LL, data, np.array([100, 103, 500]), np.array([1, 2]))
    assert np.array_equal(wire[:offs[1]], P.encode(Protocol.LL, data[100:103], 1))
    assert np.array_equal(wire[offs[1]:], P.encode(Protocol.LL, data[103:500], 2))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="protocol"):
        P.encode("LL", np.zeros(8, dtype=np.uint8), 1)      # a Protocol, not its name
    with pytest.raises(ValueError, match="uint8"):
        P.encode(Protocol.LL, np.zeros(8, dtype=np.float32), 1)
    with pytest.raises(ValueError, match="non-decreasing"):
        P.encode_batch(Protocol.LL, np.zeros(8, dtype=np.uint8), np.array([0, 9]), np.array([1]))
    with pytest.raises(ValueError, match="flags"):
        P.encode_batch(Protocol.LL, np.zeros(8, dtype=np.uint8), np.array([0, 4, 8]), np.array([1]))
