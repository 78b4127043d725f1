"""The Adam/AdamW kernels equal torch.optim bit for bit: every implementation with every root
this host takes, Adam and AdamW, several hyperparameter sets, fp32/bf16/fp16 gradients,
pre-divided or summed, 20+ steps, tensor sizes that are not multiples of any vector width."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater import kernels
from gradtap.updater.kernels import (IMPLEMENTATIONS, SQRT_IEEE, SQRT_MKL_SSE, SQRT_TORCH, adam_step,
                                     step_constants, work_spans)
from tests.updater.roots import MKL_ROOTS, require, torch_uses

SIZES = [1, 7, 15, 17, 1023, 4099, 16, 8, 9, 33]
# (kind, lr, betas, eps, weight_decay): plain Adam; Adam with L2 decay; AdamW with
# 1 - beta1 >= 0.5 (the lerp's other branch) and a tiny eps; AdamW with strong decay.
HYPER = {
    "adam": ("adam", 1e-3, (0.9, 0.999), 1e-8, 0.0),
    "adam-l2": ("adam", 3e-4, (0.8, 0.95), 1e-6, 0.1),
    "adamw-lowbeta": ("adamw", 1e-2, (0.3, 0.9), 1e-12, 0.05),
    "adamw-decay": ("adamw", 5e-2, (0.95, 0.9999), 1e-8, 0.3),
}
TORCH_IMPL = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# (implementation, root): the one-pass paths; each MKL root runs where this host's torch uses it.
ONE_PASS = ([(impl, root) for impl in ("single_tensor", "foreach") for root in MKL_ROOTS]
            + [("fused", SQRT_IEEE)])
# Every path adam_step has: the one-pass ones and single-tensor with torch.sqrt's roots.
EVERY_PATH = ONE_PASS + [("single_tensor", SQRT_TORCH)]


def wire_gradient(rng, n, wire):
    """(wire array, the float32 gradient torch sees before any division)."""
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 1, n)).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0
    t = torch.from_numpy(x)
    if wire == "bf16":
        low = t.to(torch.bfloat16)
        return low.view(torch.int16).numpy().view(np.uint16).copy(), low.float().numpy()
    if wire == "fp16":
        low = t.to(torch.float16)
        return low.numpy().view(np.uint16).copy(), low.float().numpy()
    return x, x.copy()


def run_both(implementation, hyper, wire="fp32", world=None, steps=20, sizes=SIZES, *, sqrt, seed=0):
    """Run torch.optim and adam_step (roots from ``sqrt``) side by side; return (ours, torch's)
    as uint32 bits."""
    kind, lr, betas, eps, wd = HYPER[hyper]
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    bounds = np.cumsum([0] + sizes)
    start = rng.standard_normal(n).astype(np.float32)
    tensors = [torch.nn.Parameter(torch.from_numpy(start[a:b].copy())) for a, b in zip(bounds, bounds[1:])]
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    optimizer = cls(tensors, lr=lr, betas=betas, eps=eps, weight_decay=wd, **TORCH_IMPL[implementation])
    p, m, v = start.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    work = work_spans(sizes, implementation, chunk=1000)
    for step in range(1, steps + 1):
        g_wire, g32 = wire_gradient(rng, n, wire)
        grad = torch.from_numpy(g32)
        if world:
            grad = grad.div_(world)
        for t, a, b in zip(tensors, bounds, bounds[1:]):
            t.grad = grad[a:b].clone()
        optimizer.step()
        c = step_constants(implementation, decoupled=kind == "adamw", lr=lr, betas=betas, eps=eps,
                           weight_decay=wd, step=step, world=world)
        adam_step(implementation, p, g_wire, m, v, work, c, wire=wire, sqrt=sqrt)
    theirs = [np.concatenate([t.detach().numpy() for t in tensors]),
              np.concatenate([optimizer.state[t]["exp_avg"].numpy() for t in tensors]),
              np.concatenate([optimizer.state[t]["exp_avg_sq"].numpy() for t in tensors])]
    return [a.view(np.uint32) for a in (p, m, v)], [a.view(np.uint32) for a in theirs]


def assert_same(ours, theirs):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, theirs):
        differ = np.flatnonzero(a != b)
        assert differ.size == 0, f"{name}: {differ.size} elements differ, first at {differ[:5]}"


@pytest.mark.parametrize("implementation,root", ONE_PASS)
@pytest.mark.parametrize("hyper", list(HYPER))
@pytest.mark.parametrize("wire,world", [("fp32", None), ("fp32", 3), ("bf16", None), ("bf16", 4),
                                        ("fp16", None), ("fp16", 3)])
def test_equals_torch(implementation, root, hyper, wire, world):
    require(root)
    assert_same(*run_both(implementation, hyper, wire, world, sqrt=root))


@pytest.mark.parametrize("implementation", ["single_tensor", "foreach"])
@pytest.mark.parametrize("hyper", ["adam", "adamw-lowbeta"])
def test_torch_root_path_equals_torch(implementation, hyper):
    assert_same(*run_both(implementation, hyper, "bf16", 2, sqrt=SQRT_TORCH))


@pytest.mark.parametrize("implementation,root", EVERY_PATH)
def test_many_steps_and_default_chunking(implementation, root):
    require(root)
    hyper = "adam-l2" if implementation == "fused" else "adamw-decay"
    assert_same(*run_both(implementation, hyper, steps=60, sizes=[70001, 3, 5000], sqrt=root))


def test_a_wrong_root_is_caught():
    """The comparison can fail: fused's IEEE root is not single-tensor's (MKL's) root."""
    ours, theirs = run_both("single_tensor", "adam", steps=20, sqrt=SQRT_TORCH, sizes=[20000])
    assert_same(ours, theirs)
    kind, lr, betas, eps, wd = HYPER["adam"]
    rng = np.random.default_rng(1)
    n = 20000
    m, v = (rng.random(n).astype(np.float32) for _ in range(2))
    p = np.zeros(n, np.float32)       # so the root's last bit reaches the parameter
    g = rng.standard_normal(n).astype(np.float32)
    single = [a.copy() for a in (p, m, v)]
    fused_like = [a.copy() for a in (p, m, v)]
    c = step_constants("single_tensor", decoupled=False, lr=lr, betas=betas, eps=eps, weight_decay=wd, step=3)
    adam_step("single_tensor", single[0], g, single[1], single[2], work_spans([n], "single_tensor"), c,
              sqrt=SQRT_TORCH)
    adam_step("fused", fused_like[0], g, fused_like[1], fused_like[2], work_spans([n], "fused"), c,
              sqrt=SQRT_IEEE)
    assert not np.array_equal(single[0], fused_like[0])


# (kind, lr, betas, eps, weight_decay, world, clip): every constant in play, lerp from m and
# from g, gradients summed over 6 ranks and clipped, or pre-divided and not clipped.
CONSTANT_CASES = {
    "adam-l2": ("adam", 0.1, (0.9, 0.999), 1e-8, 0.5, 6, 0.25),
    "adamw": ("adamw", 0.1, (0.9, 0.999), 1e-8, 0.5, 6, 0.3),
    "adamw-lowbeta": ("adamw", 3e-3, (0.3, 0.95), 1e-6, 0.01, None, 1.0),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CONSTANT_CASES))
def test_step_constants_are_the_floats_torch_uses(implementation, case):
    """torch.optim steps a crafted state from step 6 to 7; our step with ``step_constants``
    gives the same bits, and moving any one constant by one ulp does not. So each constant is
    the float32 torch computes with, whatever formula produced it.

    The state makes every constant visible: parameters that are exactly 0 (the update alone),
    dead units (zero gradient and second moment, where the denominator is ``eps``), fresh
    ones (zero second moment only, which is then ``(1 − β2)·g²`` alone), tensor sizes with a
    tail for fused.
    """
    kind, lr, betas, eps, wd, world, clip = CONSTANT_CASES[case]
    rng = np.random.default_rng(7)
    sizes = [4099, 13]
    n = sum(sizes)
    bounds = np.cumsum([0] + sizes)
    dead = rng.random(n) < 0.1
    p = rng.standard_normal(n).astype(np.float32)
    p[rng.random(n) < 0.2] = 0
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    fresh = rng.random(n) < 0.1
    v = np.where(dead | fresh, 0, rng.random(n) * 1e-4).astype(np.float32)
    g = np.where(dead, 0, rng.standard_normal(n) * 1e-2).astype(np.float32)

    grad = torch.from_numpy(g.copy())
    if world:
        grad.div_(world)
    if clip != 1:
        grad.mul_(torch.tensor(np.float32(clip)))     # clip_grad_norm_'s _foreach_mul_
    tensors = [torch.nn.Parameter(torch.from_numpy(p[a:b].copy())) for a, b in zip(bounds, bounds[1:])]
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    optimizer = cls(tensors, lr=lr, betas=betas, eps=eps, weight_decay=wd, **TORCH_IMPL[implementation])
    for t, a, b in zip(tensors, bounds, bounds[1:]):
        t.grad = grad[a:b].clone()
        optimizer.state[t] = {"step": torch.tensor(6.0), "exp_avg": torch.from_numpy(m[a:b].copy()),
                              "exp_avg_sq": torch.from_numpy(v[a:b].copy())}
    optimizer.step()
    theirs = np.concatenate([np.concatenate([t.detach().numpy() for t in tensors]),
                             np.concatenate([optimizer.state[t]["exp_avg"].numpy() for t in tensors]),
                             np.concatenate([optimizer.state[t]["exp_avg_sq"].numpy() for t in tensors])])

    root = SQRT_IEEE if implementation == "fused" else SQRT_TORCH
    work = work_spans(sizes, implementation)

    def ours(c):
        state = [a.copy() for a in (p, m, v)]
        adam_step(implementation, state[0], g, state[1], state[2], work, c, sqrt=root)
        return np.concatenate(state)

    c = step_constants(implementation, decoupled=kind == "adamw", lr=lr, betas=betas, eps=eps,
                       weight_decay=wd, step=7, world=world, clip=clip)
    assert np.array_equal(ours(c).view(np.uint32), theirs.view(np.uint32))
    unused = {"l2"} if not c.use_l2 else set()
    unused |= {"world"} if not c.divide else set()
    floats = [f for f in c._fields if isinstance(getattr(c, f), np.float32) and f not in unused]
    assert len(floats) >= 8
    for field in floats:
        moved = c._replace(**{field: np.nextafter(getattr(c, field), np.float32(np.inf))})
        assert not np.array_equal(ours(moved).view(np.uint32), theirs.view(np.uint32)), field


def test_work_spans():
    rows = work_spans([20, 5, 16], "fused", chunk=8)
    assert rows.tolist() == [[0, 8, 0], [8, 16, 0], [16, 20, 1], [20, 25, 1], [25, 32, 0], [32, 40, 0],
                             [40, 41, 0]]
    rows = work_spans([20, 5, 16], "single_tensor", chunk=16)
    assert rows.tolist() == [[0, 16, 0], [16, 32, 0], [32, 41, 0]]
    assert work_spans([], "fused").shape == (0, 3)
    # The bucket starts at flat index 3: spans are cut where the flat arrays cross multiples
    # of the chunk (flat 8, 16, 32, 40), fused tails stay each tensor's last n % 8.
    rows = work_spans([20, 5, 16], "fused", chunk=8, start=3)
    assert rows.tolist() == [[0, 5, 0], [5, 13, 0], [13, 16, 0], [16, 20, 1], [20, 25, 1],
                             [25, 29, 0], [29, 37, 0], [37, 41, 0]]
    rows = work_spans([20, 5, 16], "single_tensor", chunk=16, start=3)
    assert rows.tolist() == [[0, 13, 0], [13, 29, 0], [29, 41, 0]]
    assert work_spans([16], "fused", chunk=8, start=8).tolist() == [[0, 8, 0], [8, 16, 0]]


def _spans_walked(sizes, implementation, chunk, start):
    """``work_spans`` by walking the elements one by one: a body span ends at its range's end
    and wherever the flat index reaches a multiple of ``chunk``."""
    ranges = [(0, sum(sizes), sum(sizes))] if implementation != "fused" else []
    offset = 0
    for n in sizes if implementation == "fused" else ():
        ranges.append((offset, offset + n - n % kernels.FUSED_LANES, offset + n))
        offset += n
    rows = []
    for lo, body, hi in ranges:
        at = lo
        for i in range(lo + 1, body + 1):
            if i == body or (start + i) % chunk == 0:
                rows.append([at, i, kernels.BODY])
                at = i
        if body < hi:
            rows.append([body, hi, kernels.TAIL])
    return rows


@pytest.mark.parametrize("implementation", ["single_tensor", "fused"])
def test_work_spans_equal_an_element_walk(implementation):
    rng = np.random.default_rng(11)
    for _ in range(150):
        sizes = rng.integers(0, 3000, rng.integers(0, 5)).tolist()
        chunk, start = int(rng.choice([8, 16, 1000, kernels.CHUNK])), int(rng.integers(0, 5000))
        rows = work_spans(sizes, implementation, chunk=chunk, start=start)
        assert rows.dtype == np.int64 and rows.shape[1] == 3
        assert rows.tolist() == _spans_walked(sizes, implementation, chunk, start), (sizes, chunk, start)


@pytest.mark.parametrize("implementation,root", EVERY_PATH)
def test_results_do_not_depend_on_where_spans_are_cut(implementation, root):
    """Spans cut on the cache lines of a bucket that starts anywhere in the flat arrays
    (``work_spans(start=)``) give the bits of spans cut from the bucket's start."""
    require(root)
    rng = np.random.default_rng(4)
    sizes = [9001, 7, 3000, 16]
    n = sum(sizes)
    start = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    start[2] = np.abs(start[2])
    g = rng.standard_normal(n).astype(np.float32)
    c = step_constants(implementation, decoupled=False, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                       step=3)

    def step(chunk, first):
        p, m, v = (a.copy() for a in start)
        adam_step(implementation, p, g, m, v, work_spans(sizes, implementation, chunk=chunk, start=first), c,
                  sqrt=root)
        return np.concatenate([p, m, v]).view(np.uint32)

    reference = step(kernels.CHUNK, 0)
    for chunk, first in ((kernels.CHUNK, 5), (kernels.CHUNK, 4093), (1000, 13), (16, 1)):
        assert np.array_equal(step(chunk, first), reference), (chunk, first)


def test_validation():
    n = 10
    p, m, v, g = (np.zeros(n, np.float32) for _ in range(4))
    work = work_spans([n], "fused")
    c = step_constants("fused", decoupled=False, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, step=1)
    with pytest.raises(GradtapError, match="g is float32"):
        adam_step("fused", p, g[:9], m, v, work, c, sqrt=SQRT_IEEE)
    with pytest.raises(GradtapError, match="uint16"):
        adam_step("fused", p, g, m, v, work, c, wire="bf16", sqrt=SQRT_IEEE)
    with pytest.raises(GradtapError, match="work list"):
        adam_step("fused", p, g, m, v, work_spans([9], "fused"), c, sqrt=SQRT_IEEE)
    with pytest.raises(GradtapError, match="IEEE root"):
        adam_step("fused", p, g, m, v, work, c, sqrt=SQRT_MKL_SSE)
    with pytest.raises(GradtapError, match="not one of"):
        adam_step("lamb", p, g, m, v, work, c, sqrt=SQRT_TORCH)
    with pytest.raises(GradtapError, match="not one of"):
        adam_step("single_tensor", p, g, m, v, work_spans([n], "single_tensor"), c, sqrt="mkl")
    with pytest.raises(GradtapError, match="wire dtype"):
        adam_step("fused", p, g, m, v, work, c, wire="fp8", sqrt=SQRT_IEEE)
    ro = p.copy()
    ro.flags.writeable = False
    with pytest.raises(GradtapError, match="read-only"):
        adam_step("fused", ro, g, m, v, work, c, sqrt=SQRT_IEEE)
    with pytest.raises(GradtapError, match="C-contiguous"):
        adam_step("fused", np.zeros(2 * n, np.float32)[::2], g, m, v, work, c, sqrt=SQRT_IEEE)


def test_widen_gradient_is_the_trainers_grad():
    rng = np.random.default_rng(3)
    n = 1037
    for wire in ("fp32", "bf16", "fp16"):
        g_wire, g32 = wire_gradient(rng, n, wire)
        out = np.empty(n, np.float32)
        c = step_constants("fused", decoupled=False, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0, step=1, world=3)
        kernels.widen_gradient(g_wire, out, work_spans([n], "fused"), c, wire=wire)
        assert np.array_equal(out, torch.from_numpy(g32).div_(3).numpy())


def test_an_mkl_root_that_is_not_this_hosts_is_refused():
    """adam_step runs an MKL root only where it is this host's torch.sqrt (judged here by
    torch.sqrt itself on a sample of its own)."""
    n = 10
    p, m, v, g = (np.zeros(n, np.float32) for _ in range(4))
    c = step_constants("single_tensor", decoupled=False, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0, step=1)
    for root in MKL_ROOTS:
        if torch_uses(root):
            adam_step("single_tensor", p, g, m, v, work_spans([n], "single_tensor"), c, sqrt=root)
        else:
            with pytest.raises(GradtapError, match="is not this host's torch.sqrt"):
                adam_step("single_tensor", p, g, m, v, work_spans([n], "single_tensor"), c, sqrt=root)


@pytest.mark.parametrize("implementation,root", EVERY_PATH)
def test_results_do_not_depend_on_the_thread_count(implementation, root):
    """One and two Numba threads, 4096- and 1000-element spans, and a serial reference that
    steps each tensor alone in one thread and one span give the same bits."""
    require(root)
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"Numba's thread pool has {numba.config.NUMBA_NUM_THREADS} thread "
                    "(NUMBA_NUM_THREADS); comparing thread counts needs 2")
    rng = np.random.default_rng(9)
    sizes = [50001, 7, 30000]
    n = sum(sizes)
    bounds = np.cumsum([0] + sizes)
    start = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    start[2] = np.abs(start[2])
    g = rng.standard_normal(n).astype(np.float32)
    c = step_constants(implementation, decoupled=True, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                       step=2)

    def step(threads, chunk):
        numba.set_num_threads(threads)
        assert numba.get_num_threads() == threads
        p, m, v = (a.copy() for a in start)
        adam_step(implementation, p, g, m, v, work_spans(sizes, implementation, chunk=chunk), c, sqrt=root)
        return np.concatenate([p, m, v]).view(np.uint32)

    def serial():
        numba.set_num_threads(1)
        p, m, v = (a.copy() for a in start)
        for a, b in zip(bounds, bounds[1:]):
            adam_step(implementation, p[a:b], g[a:b], m[a:b], v[a:b],
                      work_spans([b - a], implementation, chunk=b - a), c, sqrt=root)
        return np.concatenate([p, m, v]).view(np.uint32)

    before = numba.get_num_threads()
    try:
        results = [step(1, kernels.CHUNK), step(2, kernels.CHUNK), step(2, 1000), serial()]
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("spans,threads", [(0, 2), (1, 2), (3, 2), (8, 2), (9, 2), (1000, 2), (1000, 1), (7, 3)])
def test_single_tensor_runs_of_spans_cover_the_work_list_in_order(spans, threads):
    """The single-tensor driver's runs: consecutive, none empty, together every span once,
    at most ``GROUPS_PER_THREAD`` per thread."""
    groups = kernels._groups(spans, threads)
    assert groups.shape[0] == min(spans, kernels.GROUPS_PER_THREAD * threads)
    if spans:
        assert groups[0, 0] == 0 and groups[-1, 1] == spans
        assert np.all(groups[:, 0] < groups[:, 1]) and np.array_equal(groups[1:, 0], groups[:-1, 1])


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_the_plain_fused_loop_is_the_generic_one(wire):
    """The fused kernel steps the body of a step that needs no per-element choice (gradient
    as it arrives, clip 1, no L2 term, lerp from m) with a loop of its own: it must give the
    generic loop's bits, special values included, and be taken exactly for those steps."""
    rng = np.random.default_rng(11)
    n = 4099
    g_wire, _ = wire_gradient(rng, n, wire)
    start = [rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 10, n)
             for _ in range(3)]
    start[2] = np.abs(start[2])
    for a in start:
        a[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38]
        rng.shuffle(a)
    half = wire == "fp16"
    for kind, betas, wd in (("adamw", (0.9, 0.999), 0.01), ("adam", (0.95, 0.9999), 0.0)):
        c = step_constants("fused", decoupled=kind == "adamw", lr=1e-3, betas=betas, eps=1e-8,
                           weight_decay=wd, step=7)
        assert kernels._plain(c)
        plain, generic = ([a.copy() for a in start] for _ in range(2))
        kernels._fused_plain_span(plain[0], g_wire, plain[1], plain[2], c, half)
        kernels._fused_span(generic[0], g_wire, generic[1], generic[2], c, half, False)
        for a, b in zip(plain, generic):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    plain_c = step_constants("fused", decoupled=True, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                             step=7)
    for other in (step_constants("fused", decoupled=True, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.01, step=7, world=4),
                  plain_c._replace(clip=np.float32(0.5)),
                  step_constants("fused", decoupled=False, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.01, step=7),
                  step_constants("fused", decoupled=True, lr=1e-3, betas=(0.3, 0.999), eps=1e-8,
                                 weight_decay=0.01, step=7)):
        assert not kernels._plain(other)
