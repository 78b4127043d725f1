"""The vectorised wire plan (``workload/wire_plan.py`` with ``plan_columns.py``) against its
slow twin, the message-by-message builder of ``tests/workload/naive_plan.py``: every field of
every array, and the same PlanError, over every era, protocol mix, ring size, channel and QP
count, adaptive routing, wire dtype, bucket shape and buffer size, then over random jobs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradtap.core.errors import PlanError
from gradtap.workload import nccl as N
from gradtap.workload.ring_schedule import CallSchedule
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import build_plan
from tests.workload.naive_plan import naive_plan

PROTOCOLS = ("Simple", "LL", "LL128")
ARRAYS = ("steps_per_iteration", "fifo_per_iteration", "phase_steps", "phase_period")
TABLES = ("messages", "flows", "blocks")
SCALARS = ("job_name", "world_size", "elem_size", "mtu", "geometries", "bucket_numels", "bucket_offsets")


def job(era="2.19", n=4, protocol="Simple", channels=2, nqps=1, mtu=1024, dtype="fp32", **nccl):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:00:{i + 1:02x}"} for i in range(n)]
    return parse_job({
        "name": "fast", "model": {"params": [{"name": "w", "shape": [8]}]},
        "ddp": {"grad_dtype": dtype},
        "nccl": dict(era=era, protocol=protocol, channels=channels, qps_per_connection=nqps, mtu=mtu, **nccl),
        "ring": {"ranks": ranks},
        "mirrors": [{"name": "m0", "rank": 0, "direction": "egress"}],
    })


def assert_same_plan(j, sizes) -> str:
    """Build both plans; assert they are equal (or raise the same PlanError). Returns what
    happened, for the callers that count it."""
    try:
        want = naive_plan(j, sizes)
    except PlanError as e:
        with pytest.raises(PlanError) as got:
            build_plan(j, sizes)
        assert str(got.value) == str(e)
        return "error"
    got = build_plan(j, sizes)
    for name in SCALARS:
        assert getattr(got, name) == getattr(want, name), name
    for name in ARRAYS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a, b), name
    for name in TABLES:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.shape, b.shape)
        for field in a.dtype.names:
            assert np.array_equal(a[field], b[field]), f"{name}.{field}"
    return "plan"


# One case per era and protocol mix; the other settings turn over the cases so that each era
# meets several ring sizes, channel and QP counts, AR, dtypes and buffer sizes.
SETTINGS = [  # n, channels, nqps, split, adaptive routing, dtype, mtu
    (2, 1, 1, None, False, "fp32", 1024),
    (3, 2, 2, True, True, "bf16", 4096),
    (8, 4, 2, True, False, "fp16", 2048),
    (5, 3, 2, False, True, "fp32", 1024),
    (4, 2, 1, None, True, "bf16", 4096),
    (7, 1, 2, True, True, "fp32", 1024),
    (6, 4, 1, False, False, "fp16", 2048),
]
BUCKETS = [
    [1, 5000, 70_001, 300_001],          # odd sizes, one several loops long
    [0, 3, 0, 129_999],                  # empty buckets
    [],                                   # no bucket at all
    [600_000, 7, 1, 64 * 1024],
]
BUFFSIZES = [{}, {"Simple": 1 << 20, "LL": 8 * 4096, "LL128": 8 * 38_400}, {"LL": 8 * 256}, {"Simple": 1 << 23}]
CASES = [(era, mix, i) for i, (era, mix) in enumerate((e, m) for e in N.ERAS for m in (*PROTOCOLS, "mixed"))]


def case_job(era, mix, i):
    n, ch, nq, split, ar, dtype, mtu = SETTINGS[i % len(SETTINGS)]
    sizes = BUCKETS[i % len(BUCKETS)]
    nccl = dict(adaptive_routing=ar, buffsize=BUFFSIZES[i % len(BUFFSIZES)])
    if split is not None:
        nccl["split_data_on_qps"] = split
    if i % 3 == 0:
        nccl["ar_threshold"] = 0
    if mix == "mixed":
        nccl["protocols"] = tuple(PROTOCOLS[(i + k) % 3] for k in range(len(sizes))) or None
        mix = "Simple"
    return job(era, n, mix, ch, nq, mtu, dtype, **nccl), sizes


@pytest.mark.parametrize("era,mix,i", CASES)
def test_fast_plan_equals_naive(era, mix, i):
    assert_same_plan(*case_job(era, mix, i))


@pytest.mark.parametrize("era", ["2.19", "2.22", "2.29"])
@pytest.mark.parametrize("nq,split", [(2, False), (2, True)])
def test_qp_rotation_and_its_error_are_the_same(era, nq, split):
    # 4 ranks, 1 channel: with 1 bucket of 1 element each connection posts 6 messages (fine
    # for 2 QPs), with 3 buckets 18, with 5 elements over LL 2 channels more; the unsplit
    # and the 2.29 split rotations must place and refuse alike.
    outcomes = set()
    for sizes in ([1], [1, 1, 1], [5, 40_000, 3]):
        for proto in PROTOCOLS:
            outcomes.add(assert_same_plan(job(era, 4, proto, 1, nq, split_data_on_qps=split), sizes))
    assert "plan" in outcomes


def test_era_and_buffer_errors_are_the_same():
    cases = [
        (job("2.30", 4, "Simple", 1, 2, split_data_on_qps=True), [100]),    # split over 2 QPs refused in 2.30
        (job("2.20", 4, "LL", buffsize={"LL": 8}), [100]),                   # a zero-element chunk
        (job("2.19", 4, "Simple", buffsize={"Simple": 1001}), [100]),        # not whole FIFO steps
        (job("2.22", 4, "LL128", buffsize={"LL128": 8 * 64}), [100]),
        (job("2.19", 4, "Simple", protocols=("LL", "Simple")), [100]),       # one protocol per bucket
    ]
    for j, sizes in cases:
        assert assert_same_plan(j, sizes) == "error"


@pytest.mark.parametrize("era", sorted(N.ERAS))
def test_send_table_equals_sends(era):
    rng = np.random.default_rng(len(era))
    for proto in PROTOCOLS:
        for n, nch, elem in ((2, 1, 4), (3, 2, 2), (8, 4, 4)):
            for count in (0, 1, 4097, int(rng.integers(1, 3_000_000))):
                nccl = job(era, n, proto, nch).nccl
                geo = N.geometry(nccl, n)
                sched = CallSchedule(count, elem, n, nch, geo, N.ERAS[era])
                for c in sched.channels:
                    every = sched.send_table(np.arange(n), c)
                    for p in range(n):
                        want = [(s.loop, s.ring_step, s.chunk, s.slice, s.elem_offset, s.nelem)
                                for s in sched.sends(p, c)]
                        assert list(zip(*(a.tolist() for a in sched.send_table(p, c)))) == want
                        assert list(zip(*(a[p].tolist() for a in every))) == want
                        assert {s.steps for s in sched.sends(p, c)} <= {geo.slice_steps}


@st.composite
def random_jobs(draw):
    era = draw(st.sampled_from(sorted(N.ERAS)))
    n = draw(st.integers(2, 8))
    nbuckets = draw(st.integers(0, 4))
    sizes = draw(st.lists(st.one_of(st.integers(0, 64), st.integers(0, 400_000)), min_size=nbuckets,
                          max_size=nbuckets))
    mixed = draw(st.booleans()) and nbuckets > 0
    nccl = dict(adaptive_routing=draw(st.booleans()), ar_threshold=draw(st.sampled_from([0, 4096, 8192, 1 << 20])))
    if mixed:
        nccl["protocols"] = tuple(draw(st.sampled_from(PROTOCOLS)) for _ in sizes)
    split = draw(st.sampled_from([None, True, False]))
    if split is not None:
        nccl["split_data_on_qps"] = split
    if draw(st.booleans()):
        proto = draw(st.sampled_from(PROTOCOLS))
        nccl["buffsize"] = {proto: 8 * draw(st.sampled_from([256, 4096, 20_000, 65_536, 1 << 17]))}
    return job(era, n, draw(st.sampled_from(PROTOCOLS)), draw(st.integers(1, 4)), draw(st.integers(1, 2)),
               draw(st.sampled_from([1024, 2048, 4096])), draw(st.sampled_from(["fp32", "bf16", "fp16"])),
               **nccl), sizes


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(random_jobs())
def test_fast_plan_equals_naive_on_random_jobs(case):
    assert_same_plan(*case)
