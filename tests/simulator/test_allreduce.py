"""The vectorised ring arithmetic against a literal walk of NCCL's runRing over N rank
buffers with exactly rounded additions (tests/naive.py), bit for bit."""

import numpy as np
import pytest

from gradtap.core.errors import PlanError
from gradtap.simulator import allreduce as A
from tests import naive
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import DATA, build_plan

NUMPY = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}
BITS = {"fp32": np.uint32, "fp16": np.uint16, "bf16": np.uint16}


def job(n, protocol, dtype, buffsize=None, channels=2):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:00:{i + 1:02x}"} for i in range(n)]
    nccl = {"protocol": protocol, "channels": channels}
    if buffsize:
        nccl["buffsize"] = {protocol: buffsize}
    return parse_job({"name": "t", "model": {"params": [{"name": "w", "shape": [8]}]},
                      "ddp": {"grad_dtype": dtype}, "nccl": nccl, "ring": {"ranks": ranks},
                      "mirrors": [{"name": "m0", "rank": 0, "direction": "egress"}]})


def random_wire(rng, shape, fmt, max_exp_field=None):
    """Finite values of every kind: mostly magnitudes within a few significand widths of
    each other (so that sums depend on their order), some over the whole range, subnormals,
    signed zeros, and pairs that cancel exactly."""
    eb, fb = naive.FORMATS[fmt]
    bias = (1 << (eb - 1)) - 1
    top = (1 << eb) - 5 if max_exp_field is None else max_exp_field   # margin below overflow
    exp = np.clip(bias + rng.integers(-fb - 2, fb + 3, size=shape), 1, top)
    kind = rng.random(shape)
    wide = kind > 0.9
    exp[wide] = rng.integers(1, top + 1, size=int(wide.sum()))
    exp[kind < 0.05] = 0                                  # subnormals and zeros
    frac = rng.integers(0, 1 << fb, size=shape)
    frac[kind < 0.01] = 0
    sign = rng.integers(0, 2, size=shape)
    bits = (sign << (eb + fb)) | (exp << fb) | frac
    if shape[0] > 1:
        cancel = rng.random(shape[1]) < 0.05
        bits[1, cancel] = bits[0, cancel] ^ (1 << (eb + fb))
    return bits.astype(BITS[fmt]).view(NUMPY[fmt])


def as_bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16).astype(np.int64)


def send_ranges(plan, bucket):
    m = plan.messages
    sends = m[(m["kind"] == DATA) & (m["bucket"] == bucket) & (m["part"] == 0) & (m["nelem"] > 0)]
    ranges: dict = {}
    seen = set()
    for msg in sends:
        src = int(plan.flows["src"][msg["flow"]])
        key = (src, int(msg["ring_step"]), int(msg["elem_offset"]))
        if key not in seen:   # adaptive routing plans two writes for one send
            seen.add(key)
            ranges.setdefault(key[:2], []).append((key[2], int(msg["nelem"])))
    return ranges


CASES = [(n, fmt, proto) for n in (2, 3, 8) for fmt in ("fp32", "bf16", "fp16")
         for proto in ("LL", "Simple", "LL128")]


@pytest.mark.parametrize("n,fmt,proto", CASES)
def test_ring_partials_equal_a_literal_ring_walk(n, fmt, proto):
    # Small FIFO buffers make many loops and ragged last chunks out of few elements.
    buffsize = {"LL": 8 * 1024, "Simple": 64 * 1024, "LL128": 8 * 8 * 2048}[proto]
    counts = [1500, 333]
    plan = build_plan(job(n, proto, fmt, buffsize), counts)
    rng = np.random.default_rng(n * 100 + len(fmt) + len(proto))
    for bucket, count in enumerate(counts):
        inputs = random_wire(rng, (n, count), fmt)
        fast = A.ring_partials(inputs, A.chunk_index(plan, bucket))
        sent, final = naive.ring_allreduce(as_bits(inputs).tolist(), send_ranges(plan, bucket), fmt)
        want = np.array(sent[:n], dtype=np.int64)
        assert np.array_equal(as_bits(fast), want), f"bucket {bucket}: first difference at " \
            f"{np.argwhere(as_bits(fast) != want)[:3].tolist()}"
        # The reduced row alone, accumulated in place from the ranks' buffers as given, and
        # the partials written into a wider reused buffer, are the same values.
        assert np.array_equal(as_bits(A.ring_sum(list(inputs), A.chunk_index(plan, bucket))), want[n - 1])
        wide = np.full((n, count + 7), 3, inputs.dtype)
        into = A.ring_partials(list(inputs), A.chunk_index(plan, bucket), out=wide[:, :count])
        assert np.array_equal(as_bits(into), want) and np.shares_memory(into, wide)
        # The allgather forwards the final value unchanged and every rank ends with it.
        for s in range(n, 2 * n - 2):
            assert sent[s] == sent[n - 1]
        for p in range(n):
            assert final[p] == sent[n - 1]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_the_order_of_the_additions_is_visible_in_the_data(fmt):
    """The data of the ring test is order-sensitive: starting the chain one position later
    changes some sums, so a wrong order could not pass the test above."""
    n, count = 8, 1500
    plan = build_plan(job(n, "LL", fmt, 8 * 1024), [count])
    inputs = random_wire(np.random.default_rng(7), (n, count), fmt)
    chunks = A.chunk_index(plan, 0)
    right = A.ring_partials(inputs, chunks)[-1]
    shifted = A.ring_partials(inputs, (chunks + 1) % n)[-1]
    assert (as_bits(right) != as_bits(shifted)).sum() > count // 20


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_one_hop_is_the_correctly_rounded_sum(fmt):
    """Binary32-then-round equals exact rational addition rounded once, over random pairs
    including subnormals, signed zeros, exact cancellations and overflow to infinity."""
    eb, _ = naive.FORMATS[fmt]
    pairs = random_wire(np.random.default_rng(1), (2, 20000), fmt, max_exp_field=(1 << eb) - 2)
    bits = pairs.view(BITS[fmt])
    fb = naive.FORMATS[fmt][1]
    exp_mask = BITS[fmt](((1 << eb) - 1) << fb)
    bits[:, :200] = (bits[:, :200] & ~exp_mask) | BITS[fmt](((1 << eb) - 2) << fb)  # the top binade
    got = as_bits(A.ring_partials(pairs, np.ones(20000, dtype=np.int64))[1])
    a, b = as_bits(pairs).tolist()
    want = np.array([naive.add(x, y, fmt) for x, y in zip(a, b)])
    infinity, sign = naive.from_fraction(naive.Fraction(10) ** 60, fmt), 1 << sum(naive.FORMATS[fmt])
    assert ((want & ~sign) == infinity).any()                      # some sums overflowed
    assert np.array_equal(got, want), np.argwhere(got != want)[:3].tolist()


def test_known_roundings():
    one, tiny = np.uint16(0x3F80), np.uint16(0x3B80)              # bf16 1.0 and 2^-8
    tie = A.ring_partials(np.array([[one], [tiny]]), np.array([1]))[1, 0]
    assert tie == 0x3F80                                          # 1 + 2^-8 ties to even: 1.0
    odd = A.ring_partials(np.array([[np.uint16(0x3F81)], [tiny]]), np.array([1]))[1, 0]
    assert odd == 0x3F82                                          # ... and up from an odd one
    big = np.array([[np.float16(60000)], [np.float16(10000)]])
    assert np.isinf(A.ring_partials(big, np.array([1]))[1, 0])    # fp16 overflows to inf


def test_chunk_index_names_the_chunk_every_send_carries():
    for n, proto in [(3, "Simple"), (8, "LL"), (2, "LL128")]:
        plan = build_plan(job(n, proto, "bf16"), [70_001, 5000])
        for bucket in range(2):
            chunks = A.chunk_index(plan, bucket)
            assert chunks.shape == (plan.bucket_numels[bucket],)
            m = plan.messages
            sends = m[(m["kind"] == DATA) & (m["bucket"] == bucket) & (m["nelem"] > 0)]
            for msg in sends:
                src = int(plan.flows["src"][msg["flow"]])
                rng = slice(msg["elem_offset"], msg["elem_offset"] + msg["nelem"])
                assert (chunks[rng] == (src - 1 - msg["ring_step"]) % n).all()


def test_chunk_index_refuses_a_plan_that_does_not_tile_the_bucket():
    plan = build_plan(job(3, "LL", "fp32"), [5000])
    m = plan.messages
    first = np.flatnonzero((m["kind"] == DATA) & (m["ring_step"] == 0) & (m["nelem"] > 0))[0]
    m["nelem"][first] -= 1
    with pytest.raises(PlanError, match="do not tile"):
        A.chunk_index(plan, 0)
    with pytest.raises(ValueError, match="not in the plan"):
        A.chunk_index(plan, 1)


def test_plan_allreduce_returns_the_reduced_row():
    from types import SimpleNamespace
    plan = build_plan(job(3, "LL", "fp16"), [777, 4000])
    rng = np.random.default_rng(3)
    allreduce = A.plan_allreduce(plan)
    for b, count in enumerate(plan.bucket_numels):
        parts = list(random_wire(rng, (3, count), "fp16"))
        got = allreduce(parts, SimpleNamespace(index=b))
        want = A.ring_partials(np.stack(parts), A.chunk_index(plan, b))[-1]
        assert got.dtype == np.float16 and np.array_equal(as_bits(got), as_bits(want))


def test_wire_representation_is_the_trainers():
    from gradtap.simulator.training import WIRE_NUMPY
    assert {A.WIRE_DTYPE_OF[np.dtype(d)]: np.dtype(d) for d in A.WIRE_DTYPE_OF} == \
        {k: np.dtype(v) for k, v in WIRE_NUMPY.items()}


def test_bad_inputs_are_refused():
    with pytest.raises(TypeError, match="float32"):
        A.ring_partials(np.zeros((2, 3), dtype=np.float64), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="shape"):
        A.ring_partials(np.zeros((2, 3), dtype=np.float32), np.zeros(4, dtype=int))
    with pytest.raises(ValueError, match="outside"):
        A.ring_partials(np.zeros((2, 3), dtype=np.float32), np.full(3, 2))
    with pytest.raises(ValueError, match="n >= 2"):
        A.ring_partials(np.zeros((1, 3), dtype=np.float32), np.zeros(3, dtype=int))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16"])
def test_blocks_do_not_change_the_sums(monkeypatch, fmt):
    """Runs longer than a block (blocks of 7 elements here) give the sums of whole runs."""
    n, count = 5, 1500
    plan = build_plan(job(n, "LL", fmt, 8 * 1024), [count])
    inputs = random_wire(np.random.default_rng(3), (n, count), fmt)
    chunks = A.chunk_index(plan, 0)
    whole = A.ring_partials(inputs, chunks)
    monkeypatch.setattr(A, "BLOCK_ELEMENTS", 7)
    assert np.array_equal(as_bits(A.ring_partials(inputs, chunks)), as_bits(whole))
    assert np.array_equal(as_bits(A.ring_sum(inputs, chunks)), as_bits(whole[-1]))
