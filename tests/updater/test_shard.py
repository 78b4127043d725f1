"""Shards of a mirror group step their buckets as the whole replica does, clipping included,
and the total norm gathered from the shards is ``clip_grad_norm_``'s, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import queue

import numpy as np
import pytest
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.updater.clipping import GradNorms
from gradtap.updater.replica import Replica
from gradtap.updater.shard import ShardNorms, ShardReplica, decode_norms, encode_norms
from gradtap.workload.layout import job_buckets
from gradtap.workload.shards import Shards
from tests.updater.naive_adam import TorchStep, random_reduced
from tests.updater.test_clipping import SIZES, flat, grads
from tests.updater.test_replica import assert_equal_state, job

CLIPPED = dict(kind="adamw", weight_decay=0.01, clip=1e-3,
               schedule={"kind": "warmup_cosine", "warmup_steps": 3, "total_steps": 15, "min_lr_ratio": 0.1})


@pytest.mark.parametrize("case", [CLIPPED, dict(kind="adam", implementation="fused", clip=1e-2, wire="bf16",
                                                predivide=False), dict()],
                         ids=["adamw-clip", "fused-bf16-clip", "adam"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_step_as_the_whole_replica_and_the_trainer(case, world):
    j = job(**case)
    buckets = job_buckets(j)
    shards = Shards.balanced([b.numel for b in buckets], world)
    whole, reference = Replica.from_job(j), TorchStep(j)
    parts = [ShardReplica(j, whole.state_dict(), shards, r) for r in range(world)]
    rng = np.random.default_rng(3)
    for it in range(8):
        reduced = random_reduced(j, rng)
        reference.step(it, reduced)
        whole.apply(it, np.concatenate([r.view(np.uint8) for r in reduced]))
        for p in parts:
            p.begin(it)
            for b in p.stepped_buckets():
                p.apply_bucket(b, reduced[b])
        gathered = {r: p.shard_norms() for r, p in enumerate(parts)}
        for r, p in enumerate(parts):
            p.add_norms({q: m for q, m in gathered.items() if q != r})
            p.end()
    assert_equal_state(whole, reference)
    for p in parts:
        sl = p.shard
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert np.array_equal(p.shard_state()[name].view(np.uint32), getattr(whole.state, name)[sl].view(np.uint32))
        assert p.step == whole.step and p.iteration == whole.iteration
    covered = sorted(b for p in parts for b in p.shard_state()["buckets"])
    assert covered == list(range(len(buckets)))


def test_a_shard_refuses_other_buckets_and_a_missing_norm_stops_the_step():
    j = job(**CLIPPED)
    buckets = job_buckets(j)
    shards = Shards.balanced([b.numel for b in buckets], 2)
    p = ShardReplica(j, Replica.from_job(j).state_dict(), shards, 0)
    other = shards.buckets_of(1)[0]
    p.begin(0)
    reduced = random_reduced(j, np.random.default_rng(0))
    with pytest.raises(GradtapError, match=f"bucket {other} belongs to node rank 1"):
        p.apply_bucket(other, reduced[other])
    for b in p.stepped_buckets():
        p.apply_bucket(b, reduced[b])
    with pytest.raises(GradtapError, match="missing"):
        p.end()                      # the other shard's norms never came
    with pytest.raises(GradtapError, match="norms message"):
        p.add_norms({1: b"\x01"})


def test_norm_messages_keep_the_float32_bits():
    norms = {3: np.float32(1.2345678), 0: np.float32(3e-38), 5: np.float32(1e-45)}
    back = decode_norms(encode_norms(norms), "test")
    assert list(back) == [3, 0, 5]
    for i in norms:
        assert back[i].dtype == np.float32 and back[i].view(np.uint32) == norms[i].view(np.uint32)


def shard_coefficient(rank, world, rendezvous, max_norm, out):
    """One node: the norms of its parameters, all-gathered over gloo, then the total and the
    coefficient as every node computes them."""
    from gradtap.merger.group_link import GroupLink
    from gradtap.workload.spec import MirrorGroupSpec

    gs = grads(5)
    mine = [i for i in range(len(gs)) if i % world == rank]
    norms = ShardNorms(len(gs))
    norms.add(mine, *flat([gs[i] for i in mine]))
    link = GroupLink(MirrorGroupSpec(rank=rank, world_size=world, rendezvous=rendezvous, timeout_s=30))
    messages = link.all_gather(encode_norms(norms.own()), "norms")
    link.close()
    for r, m in enumerate(messages):
        if r != rank:
            norms.put(decode_norms(m, f"rank {r}"))
    out.put((rank, int(norms.total().numpy().view(np.uint32)), int(norms.coefficient(max_norm).view(np.uint32))))


def test_the_gathered_total_norm_is_clip_grad_norms_bit_for_bit(tmp_path):
    """Three processes on gloo, each holding a third of the parameters: every one computes the
    total norm and coefficient ``torch.nn.utils.clip_grad_norm_`` computes over them all."""
    gs = grads(5)
    max_norm = 1e-2
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    for p, g in zip(params, gs):
        p.grad = torch.from_numpy(g.copy())
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    whole = GradNorms(len(gs))
    whole.add(list(range(len(gs))), *flat(gs))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=shard_coefficient, args=(r, 3, f"file://{tmp_path / 'rdv'}", max_norm, out),
                         daemon=True) for r in range(3)]
    try:
        for p in procs:
            p.start()
        got = []
        for _ in procs:
            try:
                got.append(out.get(timeout=120))
            except queue.Empty:
                pytest.fail("a node did not finish")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    coef = whole.coefficient(max_norm)
    assert coef < 1
    for rank, total_bits, coef_bits in got:
        assert total_bits == int(total.numpy().view(np.uint32)), rank
        assert coef_bits == int(coef.view(np.uint32)), rank
    clipped = np.concatenate([p.grad.numpy() for p in params]).view(np.uint32)
    assert np.array_equal(np.concatenate([g * np.uint32(got[0][2]).view(np.float32) for g in gs]).view(np.uint32),
                          clipped)


def test_a_shard_holds_and_loads_only_its_slice():
    """Its arrays are its elements alone; the other parameters' tensors are never read (here
    float64, which the whole replica refuses); offers resync the slice; a shard without
    buckets keeps the whole's step; and it has no whole state_dict."""
    j = job(**CLIPPED)
    buckets = job_buckets(j)
    whole = Replica.from_job(j)
    rng = np.random.default_rng(4)
    for it in range(3):
        whole.apply(it, np.concatenate([r.view(np.uint8) for r in random_reduced(j, rng)]))
    later = whole.state_dict()
    shards = Shards.balanced([b.numel for b in buckets], 2)
    part = ShardReplica(j, later, shards, 0)
    sl = part.shard
    assert 0 < sl.stop - sl.start < whole.layout.total
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert getattr(part.state, name).size == sl.stop - sl.start
        assert np.array_equal(getattr(part.state, name), getattr(whole.state, name)[sl])
    assert (part.step, part.iteration) == (whole.step, whole.iteration)
    theirs = {part.whole.params[i].name for b in shards.buckets_of(1) for i in buckets[b].params}
    spoilt = {**later, "model": {k: v.double() if k in theirs else v for k, v in later["model"].items()}}
    assert np.array_equal(ShardReplica(j, spoilt, shards, 0).state.param, part.state.param)
    with pytest.raises(ConfigError, match="float32"):
        Replica(j, spoilt)
    start = ShardReplica(j, Replica.from_job(j).state_dict(), shards, 0)
    start.stale = True
    start.offer(later)
    assert start.begin(whole.iteration).value == "resynced"
    start.abort()
    assert np.array_equal(start.state.exp_avg_sq, part.state.exp_avg_sq) and start.step == whole.step
    idle = ShardReplica(j, later, Shards((0,) * len(buckets), 2), 1)
    assert idle.state.param.size == 0 and (idle.step, idle.iteration) == (whole.step, whole.iteration)
    with pytest.raises(GradtapError, match="holds only elements"):
        part.state_dict()
