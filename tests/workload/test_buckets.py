"""DDP bucket layouts: the greedy rules by hand, against torch's own assignment routine,
and against the buckets a real DDP (gloo, CPU) hands its communication hook."""

import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradtap.core.errors import ConfigError, PlanError
from gradtap.workload import models
from tests.simulator import naive_ddp
from gradtap.workload.buckets import (DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB, bucket_caps,
                              ddp_buckets, explicit_buckets, layout_at)
from gradtap.workload.spec import ParamSpec


def specs(*numels, dtype="float32"):
    return [ParamSpec(f"p{i}", (n,), dtype) for i, n in enumerate(numels)]


def groups(buckets):
    return [list(b.params) for b in buckets]


def test_default_caps_are_torchs():
    assert DEFAULT_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert bucket_caps(None) == (dist._DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB)
    # An explicit cap, even the default value, also sets the first bucket's cap.
    assert bucket_caps(25) == (25 * MIB, 25 * MIB)
    assert bucket_caps(0.1) == (104857, 104857)
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        bucket_caps(0)


def test_greedy_closes_at_or_above_the_limit():
    # 1 MiB cap = 262144 float32 elements; the bucket closes once it holds >= the cap.
    ps = specs(262143, 1, 5, 262144, 3)
    # Ready order is reverse registration by default: 4, 3, 2, 1, 0.
    b = ddp_buckets(ps, bucket_cap_mb=1)
    assert groups(b) == [[4, 3], [2, 1, 0]]
    assert b[0].offsets == (0, 3) and b[0].numel == 262147
    b = ddp_buckets(ps, bucket_cap_mb=1, ready_order=[0, 1, 2, 3, 4])
    assert groups(b) == [[0, 1], [2, 3], [4]]


def test_default_first_bucket_is_small_then_cap_repeats():
    mib = MIB // 4
    ps = specs(mib // 2, mib // 2, 10 * mib, 10 * mib, 10 * mib, 10 * mib)
    b = ddp_buckets(ps, ready_order=range(6))
    assert groups(b) == [[0, 1], [2, 3, 4], [5]]


def test_param_larger_than_cap_closes_its_own_bucket():
    ps = specs(10, 10 * MIB, 10)
    assert groups(ddp_buckets(ps, bucket_cap_mb=1, ready_order=[0, 1, 2])) == [[0, 1], [2]]
    assert groups(ddp_buckets(ps, bucket_cap_mb=1, ready_order=[1, 0, 2])) == [[1], [0, 2]]


def test_initial_layout():
    ps = specs(*([MIB // 8] * 6))  # 512 KiB each
    # Without find_unused_parameters: one bucket, registration order.
    assert groups(ddp_buckets(ps, layout="initial")) == [[0, 1, 2, 3, 4, 5]]
    assert groups(ddp_buckets(ps, layout="initial", static_graph=True, find_unused_parameters=True)) \
        == [[0, 1, 2, 3, 4, 5]]
    # With it: limits [1 MiB, 25 MiB] in registration order, then reversed.
    assert groups(ddp_buckets(ps, layout="initial", find_unused_parameters=True)) == [[2, 3, 4, 5], [0, 1]]
    assert groups(ddp_buckets(ps, layout="initial", find_unused_parameters=True, bucket_cap_mb=1)) \
        == [[4, 5], [2, 3], [0, 1]]


def test_rebuilt_needs_a_rebuild():
    with pytest.raises(PlanError, match="never rebuilds"):
        ddp_buckets(specs(4), find_unused_parameters=True)
    ddp_buckets(specs(4), find_unused_parameters=True, static_graph=True)
    assert [layout_at(i) for i in range(3)] == ["initial", "rebuilt", "rebuilt"]
    assert [layout_at(i, static_graph=True) for i in range(3)] == ["initial", "initial", "rebuilt"]
    assert layout_at(9, find_unused_parameters=True) == "initial"


def test_bad_ready_order_and_layout():
    with pytest.raises(ConfigError, match="ready_order"):
        ddp_buckets(specs(1, 2, 3), ready_order=[0, 1, 1])
    with pytest.raises(ConfigError, match="layout"):
        ddp_buckets(specs(1), layout="steady")
    with pytest.raises(ConfigError, match="params"):
        ddp_buckets([])


def test_mixed_dtypes():
    ps = specs(4, 4) + [ParamSpec("h", (4,), "float16")]
    b = ddp_buckets(ps, layout="initial")
    assert groups(b) == [[2], [0, 1]] and b[0].dtype == "float16"
    with pytest.raises(PlanError, match="unordered_map"):
        ddp_buckets(ps)  # two partly filled buckets left: DDP's order is undefined


def test_explicit_buckets():
    ps = specs(3, 5, 7)
    b = explicit_buckets(ps, [["p2"], ["p0", "p1"]])
    assert groups(b) == [[2], [0, 1]] and b[1].offsets == (0, 3) and b[1].numel == 8
    for bad, match in [([["p0"], ["p1"]], "in no bucket"), ([["p0", "p0"], ["p1", "p2"]], "already"),
                       ([["x"], ["p0", "p1", "p2"]], "not a parameter"), ([[], ["p0", "p1", "p2"]], "empty")]:
        with pytest.raises(ConfigError, match=match):
            explicit_buckets(ps, bad)
    with pytest.raises(ConfigError, match="mixes dtypes"):
        explicit_buckets(specs(1) + [ParamSpec("h", (1,), "float16")], [["p0", "h"]])


@pytest.mark.parametrize("case", range(150))
def test_matches_torchs_assignment_routine(case):
    """Random parameter lists, caps and ready orders against torch's C++
    dist._compute_bucket_assignment_by_size (on meta tensors), driven the way
    distributed.py drives it at construction and the reducer drives it when rebuilding."""
    rng = np.random.default_rng(case)
    n = int(rng.integers(1, 60))
    dtypes = ["float32", "float16"] if case % 3 == 0 else ["float32"]
    ps = [ParamSpec(f"p{i}", tuple(int(s) for s in rng.integers(1, 1200, size=rng.integers(1, 3))),
                    str(rng.choice(dtypes))) for i in range(n)]
    tensors = [torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta") for p in ps]
    cap_mb = None if case % 2 else float(rng.uniform(0.05, 4))
    first, cap = bucket_caps(cap_mb)
    sparse = [False] * n

    unbounded, _ = dist._compute_bucket_assignment_by_size(tensors, [sys.maxsize], sparse)
    assert groups(ddp_buckets(ps, layout="initial", bucket_cap_mb=cap_mb)) == list(reversed(unbounded))
    bounded, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap] if first < cap else [cap], sparse)
    ours = ddp_buckets(ps, layout="initial", bucket_cap_mb=cap_mb, find_unused_parameters=True)
    assert groups(ours) == list(reversed(bounded))

    order = [int(i) for i in rng.permutation(n)]
    theirs, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], [first, cap], sparse, order)
    try:
        ours = ddp_buckets(ps, bucket_cap_mb=cap_mb, ready_order=order)
    except PlanError:
        assert len({p.dtype for p in ps}) > 1
        return
    assert groups(ours) == theirs
    for b in ours:
        assert list(b.offsets) == np.cumsum([0] + [ps[i].numel for i in b.params])[:-1].tolist()
        assert b.numel == sum(ps[i].numel for i in b.params)


TINY_GPT = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=3000, block_size=32)
REAL_DDP_CASES = [
    ("gradtap.workload.models:mlp", {}, {}),
    ("gradtap.workload.models:mlp", {}, {"bucket_cap_mb": 0.1}),  # every weight is larger than the cap
    ("gradtap.workload.models:mlp", {}, {"bucket_cap_mb": 5}),    # an explicit cap also sizes the first bucket
    ("gradtap.workload.models:mlp", {}, {"find_unused_parameters": True}),
    ("gradtap.workload.models:mlp", {}, {"find_unused_parameters": True, "bucket_cap_mb": 1}),
    ("gradtap.workload.models:mlp", {}, {"static_graph": True, "bucket_cap_mb": 1}),
    ("gradtap.workload.models:gpt2", TINY_GPT, {}),
    ("gradtap.workload.models:gpt2", TINY_GPT, {"bucket_cap_mb": 0.05}),
    ("gradtap.workload.models:gpt2", TINY_GPT, {"bucket_cap_mb": 0.05, "gradient_as_bucket_view": True}),
    ("gradtap.workload.models:flowcheck_testbed", {}, {}),  # the tied embedding alone exceeds 25 MiB
    ("tests.simulator.naive_ddp:small_params", {}, {"bucket_cap_mb": 0.001}),
    ("tests.simulator.naive_ddp:shuffled", {}, {"bucket_cap_mb": 0.02}),
]


def expected_layouts(factory, kwargs, ddp_kwargs, iterations):
    params, ready = models.describe(factory, kwargs)
    flags = dict(find_unused_parameters=ddp_kwargs.get("find_unused_parameters", False),
                 static_graph=ddp_kwargs.get("static_graph", False))
    return params, [ddp_buckets(params, bucket_cap_mb=ddp_kwargs.get("bucket_cap_mb"),
                                layout=layout_at(it, **flags), ready_order=ready, **flags)
                    for it in range(iterations)]


def assert_same_as_ddp(params, layouts, records):
    """DDP's hook calls per iteration equal our buckets: index, parameters in buffer order,
    size, offsets; and each buffer holds the local gradients at exactly our offsets."""
    assert len(records) == len(layouts)
    for it, (ours, calls) in enumerate(zip(layouts, records)):
        got = [(c.index, c.names, c.numel, c.offsets) for c in calls]
        want = [(b.index, [params[i].name for i in b.params], b.numel, list(b.offsets)) for b in ours]
        assert got == want, f"iteration {it}"
        for bucket, call in zip(ours, calls):
            assert call.buffer.dtype == getattr(torch, bucket.dtype)
            for i, offset in zip(bucket.params, bucket.offsets):
                grad = call.grads[params[i].name].flatten()
                assert torch.equal(call.buffer[offset:offset + grad.numel()], grad), params[i].name


@pytest.mark.slow
@pytest.mark.parametrize("factory,kwargs,ddp_kwargs", REAL_DDP_CASES,
                         ids=[f"{f.split(':')[1]}-{d}" for f, _, d in REAL_DDP_CASES])
def test_layout_equals_real_ddp(factory, kwargs, ddp_kwargs, tmp_path):
    job = naive_ddp.Job(factory, kwargs, ddp=ddp_kwargs, iterations=3, batch_size=2,
                        seq_len=8 if "gpt2" in factory or "flowcheck" in factory else None)
    [result] = naive_ddp.run_in_process([job], tmp_path)
    assert_same_as_ddp(*expected_layouts(factory, kwargs, ddp_kwargs, 3), result.buckets)


def test_ready_order_matters():
    """For a model applied out of registration order the default guess is wrong and only
    the measured ready order reproduces DDP."""
    factory, ddp_kwargs = "tests.simulator.naive_ddp:shuffled", {"bucket_cap_mb": 0.02}
    params, layouts = expected_layouts(factory, {}, ddp_kwargs, 2)
    assert ddp_buckets(params, bucket_cap_mb=0.02) != layouts[1]


@pytest.mark.slow
def test_layout_equals_real_ddp_on_two_ranks(tmp_path):
    cases = [("gradtap.workload.models:gpt2", TINY_GPT, {"bucket_cap_mb": 0.05}),
             ("tests.simulator.naive_ddp:shuffled", {}, {"bucket_cap_mb": 0.02})]
    jobs = [naive_ddp.Job(f, k, ddp=d, iterations=2, batch_size=2,
                          seq_len=8 if "gpt2" in f else None) for f, k, d in cases]
    per_rank = naive_ddp.run_spawned(jobs, world_size=2, work_dir=tmp_path)
    for (factory, kwargs, ddp_kwargs), *results in zip(cases, *per_rank):
        expected = expected_layouts(factory, kwargs, ddp_kwargs, 2)
        for result in results:
            assert_same_as_ddp(*expected, result.buckets)
