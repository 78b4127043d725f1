"""The in-process N-rank trainer: its wire buffers, its schedule, and bit-equality with real
multi-process DDP (gloo, CPU) runs of the same jobs."""

import types

import numpy as np
import pytest
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.workload import models
from gradtap.workload.data import batch_loss
from gradtap.simulator.training import (WIRE_DTYPES, WIRE_NUMPY, Trainer, from_wire_array, make_optimizer,
                                to_wire_array)
from gradtap.workload.schedule import learning_rate, lr_factor
from tests.simulator import naive_ddp
from gradtap.workload.buckets import ddp_buckets, layout_at
from gradtap.workload.spec import OptimizerSpec, Schedule

MLP = ("gradtap.workload.models:mlp", {"sizes": [16, 32, 10]})
GPT = ("gradtap.workload.models:gpt2", {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 97, "block_size": 16})


@pytest.fixture
def one_thread():
    """The DDP reference runs one intra-op thread per rank; do the same here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def ring_sum(wire_dtype):
    """A sequential sum over ranks 0..N-1 in the wire dtype's own arithmetic (as gloo's
    and NCCL's sums do: each addition rounds to the wire dtype)."""
    def allreduce(per_rank, bucket):
        acc = from_wire_array(per_rank[0], wire_dtype)
        for x in per_rank[1:]:
            acc = acc + from_wire_array(x, wire_dtype)
        return to_wire_array(acc)
    return allreduce


class SameData:
    """Every rank gets rank 0's shard."""

    def __init__(self, data):
        self.data = data

    def batch(self, rank, iteration):
        return self.data.batch(0, iteration)


def simulate(job, world_size, wire_dtype, predivide):
    """The in-process twin of a naive_ddp.Job: same model, data, layouts and optimizer.
    Returns (trainer, per-iteration .grad after the step, per-iteration results)."""
    model = models.build(job.factory, job.kwargs, seed=job.seed)
    params, ready = models.describe(job.factory, job.kwargs, seq_len=job.seq_len)
    flags = dict(find_unused_parameters=False, static_graph=False)
    layouts = [ddp_buckets(params, bucket_cap_mb=job.ddp.get("bucket_cap_mb"), layout=layout_at(it, **flags),
                           ready_order=ready, **flags) for it in range(job.iterations)]
    data = model.synthetic_data(batch_size=job.batch_size, seed=job.seed, seq_len=job.seq_len)
    trainer = Trainer(model, params, layouts[0], world_size=world_size, optimizer=job.optimizer,
                      wire_dtype=wire_dtype, predivide=predivide, data=SameData(data) if job.same_data else data,
                      allreduce=ring_sum(wire_dtype))
    grads, results = [], []
    for it in range(job.iterations):
        results.append(trainer.step(layouts[it]))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return trainer, grads, results


def assert_bit_equal(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k}"


def assert_same_optimizer_state(ours, theirs):
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for k in ours["state"]:
        assert_bit_equal(ours["state"][k], theirs["state"][k], f"optimizer state {k}")


def opt(**kw):
    return OptimizerSpec(**kw)


def test_lr_factor():
    const = Schedule()
    assert lr_factor(const, 0) == lr_factor(const, 1000) == 1.0
    s = Schedule(kind="warmup_cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [lr_factor(s, i) for i in (0, 1, 2, 4, 6, 50)] == [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1]
    assert lr_factor(Schedule(kind="warmup_cosine", warmup_steps=3, total_steps=3), 7) == 0.0
    with pytest.raises(ConfigError, match="schedule.kind"):
        lr_factor(types.SimpleNamespace(kind="step"), 0)


def test_learning_rate_equals_lambda_lr():
    cfg = opt(lr=3e-4, schedule=Schedule(kind="warmup_cosine", warmup_steps=3, total_steps=11, min_lr_ratio=0.05))
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([p], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg.schedule, s))
    for step in range(14):
        assert optimizer.param_groups[0]["lr"] == learning_rate(cfg, step)
        p.grad = torch.ones(1)
        optimizer.step()
        sched.step()


def test_make_optimizer():
    params = [torch.nn.Parameter(torch.zeros(2))]
    o = make_optimizer(params, opt(kind="adamw", implementation="fused", weight_decay=0.1, betas=(0.8, 0.9)))
    assert type(o) is torch.optim.AdamW and o.defaults["fused"] and o.defaults["betas"] == (0.8, 0.9)
    assert make_optimizer(params, opt(implementation="foreach")).defaults["foreach"] is True
    o = make_optimizer(params, opt())
    assert type(o) is torch.optim.Adam and o.defaults["foreach"] is False and not o.defaults["fused"]
    with pytest.raises(ConfigError, match="optimizer.kind"):
        make_optimizer(params, types.SimpleNamespace(kind="sgd", implementation="foreach"))


def test_wire_arrays_round_trip():
    t = torch.tensor([1.0, -2.5, 3e-39, float("inf")], dtype=torch.bfloat16)
    a = to_wire_array(t)
    assert a.dtype == np.uint16 and a.tolist() == t.view(torch.int16).numpy().view(np.uint16).tolist()
    assert a.tolist()[:2] == [0x3F80, 0xC020]
    assert torch.equal(from_wire_array(a, "bf16"), t)
    for wire in ("fp32", "fp16"):
        t = torch.randn(5).to(WIRE_DTYPES[wire])
        assert to_wire_array(t).dtype == WIRE_NUMPY[wire] and torch.equal(from_wire_array(to_wire_array(t), wire), t)


@pytest.mark.parametrize("kind,implementation,clip", [("adam", "single_tensor", None), ("adamw", "foreach", 0.1),
                                                      ("adam", "fused", 0.5)])
def test_one_rank_equals_plain_training(kind, implementation, clip):
    cfg = opt(kind=kind, implementation=implementation, clip_grad_norm=clip, weight_decay=0.01,
              schedule=Schedule(kind="warmup_cosine", warmup_steps=1, total_steps=4))
    factory, kwargs = GPT
    params, ready = models.describe(factory, kwargs, seq_len=8)
    model = models.build(factory, kwargs, seed=3)
    data = model.synthetic_data(batch_size=2, seed=5, seq_len=8)
    trainer = Trainer(model, params, ddp_buckets(params, ready_order=ready, bucket_cap_mb=0.01), world_size=1,
                      optimizer=cfg, data=data, allreduce=lambda per_rank, bucket: per_rank[0].copy())
    plain = models.build(factory, kwargs, seed=3)
    optimizer = make_optimizer(list(plain.parameters()), cfg)
    for it in range(4):
        result = trainer.step()
        plain.zero_grad()
        loss = batch_loss(plain, data.batch(0, it))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)
        optimizer.param_groups[0]["lr"] = learning_rate(cfg, it)
        optimizer.step()
        assert result.iteration == it and result.losses == (loss.item(),) and result.lr == learning_rate(cfg, it)
    assert_bit_equal(trainer.model.state_dict(), plain.state_dict(), "parameters")
    assert_same_optimizer_state(trainer.optimizer.state_dict(), optimizer.state_dict())
    assert trainer.state_dict()["iteration"] == 4


@pytest.mark.parametrize("wire_dtype,predivide", [("fp32", True), ("fp32", False), ("bf16", True),
                                                  ("bf16", False), ("fp16", True), ("fp16", False)])
def test_wire_buffers_follow_ddp(wire_dtype, predivide):
    """Rank r's buffer holds g_r (its local gradient) prepared as the module docstring's
    table says, at the bucket offsets; the reduced buffer comes back as .grad."""
    factory, kwargs = MLP
    params, ready = models.describe(factory, kwargs)
    buckets = ddp_buckets(params, ready_order=ready, bucket_cap_mb=0.001)
    assert len(buckets) > 1
    model = models.build(factory, kwargs, seed=0)
    data = model.synthetic_data(batch_size=4, seed=1)
    n = 3
    trainer = Trainer(model, params, buckets, world_size=n, optimizer=opt(lr=1e-2), wire_dtype=wire_dtype,
                      predivide=predivide, data=data, allreduce=ring_sum(wire_dtype))
    reference = models.build(factory, kwargs, seed=0)
    local = []
    for r in range(n):
        reference.zero_grad()
        batch_loss(reference, data.batch(r, 0)).backward()
        local.append({name: p.grad.clone() for name, p in reference.named_parameters()})
    result = trainer.step()
    low = WIRE_DTYPES[wire_dtype]
    for b, bucket in enumerate(buckets):
        for r in range(n):
            buffer = from_wire_array(result.per_rank_buckets[b][r], wire_dtype)
            for i, offset in zip(bucket.params, bucket.offsets):
                g = local[r][params[i].name].flatten()
                if wire_dtype == "fp32":
                    want = torch.mul(g, 1.0 / n) if predivide else g
                else:
                    want = g.to(low).div_(n) if predivide else g.to(low)
                assert torch.equal(buffer[offset:offset + g.numel()], want)
        reduced = from_wire_array(result.reduced_buckets[b], wire_dtype).float()
        if not predivide:
            reduced = reduced / n
        for i, offset in zip(bucket.params, bucket.offsets):
            grad = dict(model.named_parameters())[params[i].name].grad
            assert torch.equal(grad.flatten(), reduced[offset:offset + grad.numel()])


def test_bad_inputs():
    factory, kwargs = MLP
    params, ready = models.describe(factory, kwargs)
    model = models.build(factory, kwargs, seed=0)
    data = model.synthetic_data(batch_size=2, seed=0)
    buckets = ddp_buckets(params, ready_order=ready)
    common = dict(world_size=2, optimizer=opt(), data=data, allreduce=ring_sum("fp32"))
    wrong = list(params)
    wrong[0] = type(params[0])(params[0].name, (3, 3), "float32")
    with pytest.raises(ConfigError, match=r"params\[0\]"):
        Trainer(model, wrong, buckets, **common)
    with pytest.raises(ConfigError, match="registration order"):
        Trainer(model, list(reversed(params)), buckets, **common)
    with pytest.raises(ConfigError, match="exactly once"):
        Trainer(model, params, buckets[:-1], **common)
    with pytest.raises(ConfigError, match="float32 parameters"):
        Trainer(models.build(factory, kwargs, seed=0).double(), params, buckets, **common)
    with pytest.raises(ConfigError, match="grad_dtype"):
        Trainer(model, params, buckets, **common, wire_dtype="int8")
    trainer = Trainer(model, params, buckets, **dict(common, allreduce=lambda per_rank, b: per_rank[0][:-1]))
    with pytest.raises(GradtapError, match="allreduce of bucket 0"):
        trainer.step()


TRAINING_JOBS = [
    # (job, wire dtype, predivide); the hook is what a real trainer registers for that wire.
    (naive_ddp.Job(*MLP, batch_size=8, hook=None, record=False,
                   optimizer=opt(kind="adam", lr=1e-2, implementation="single_tensor")), "fp32", True),
    (naive_ddp.Job(*GPT, batch_size=2, seq_len=8, ddp={"bucket_cap_mb": 0.01}, hook=None, record=False,
                   optimizer=opt(kind="adamw", lr=1e-2, implementation="fused", weight_decay=0.1, clip_grad_norm=0.5,
                                 schedule=Schedule(kind="warmup_cosine", warmup_steps=1, total_steps=3,
                                                   min_lr_ratio=0.1))), "fp32", True),
    (naive_ddp.Job(*GPT, batch_size=2, seq_len=8, hook="bf16", record=False,
                   optimizer=opt(lr=1e-2, implementation="foreach", clip_grad_norm=1.0)), "bf16", True),
    (naive_ddp.Job(*MLP, batch_size=8, ddp={"bucket_cap_mb": 0.001}, hook="fp16", record=False,
                   optimizer=opt(kind="adamw", lr=1e-2)), "fp16", True),
    (naive_ddp.Job(*GPT, batch_size=2, seq_len=8, hook="sum_divide", record=False,
                   optimizer=opt(lr=1e-2, implementation="foreach")), "fp32", False),
    (naive_ddp.Job(*MLP, batch_size=8, hook="bf16_sum_divide", record=False,
                   optimizer=opt(lr=1e-2, implementation="fused")), "bf16", False),
]


@pytest.mark.slow
def test_equals_real_ddp_on_two_ranks(tmp_path, one_thread):
    per_rank = naive_ddp.run_spawned([job for job, _, _ in TRAINING_JOBS], world_size=2, work_dir=tmp_path)
    for (job, wire_dtype, predivide), ddp0, ddp1 in zip(TRAINING_JOBS, *per_rank):
        what = f"{job.factory} {wire_dtype} predivide={predivide}"
        trainer, grads, _ = simulate(job, 2, wire_dtype, predivide)
        for it in range(job.iterations):
            assert_bit_equal(grads[it], ddp0.reduced_grads[it], f"{what}: gradients of iteration {it}")
        assert_bit_equal(trainer.model.state_dict(), ddp0.model, f"{what}: parameters")
        assert_bit_equal(ddp1.model, ddp0.model, f"{what}: ranks agree")
        assert_same_optimizer_state(trainer.optimizer.state_dict(), ddp0.optimizer)


THREE_RANK_JOBS = [
    (naive_ddp.Job(*MLP, batch_size=8, hook=None, record=False, same_data=True,
                   optimizer=opt(lr=1e-2, implementation="foreach")), "fp32", True),
    (naive_ddp.Job(*MLP, batch_size=8, hook="bf16", record=False, same_data=True,
                   optimizer=opt(lr=1e-2)), "bf16", True),
    (naive_ddp.Job(*MLP, batch_size=8, hook="fp16", record=False, same_data=True,
                   optimizer=opt(lr=1e-2)), "fp16", True),
    (naive_ddp.Job(*MLP, batch_size=8, hook="sum_divide", record=False, same_data=True,
                   optimizer=opt(lr=1e-2)), "fp32", False),
]


@pytest.mark.slow
def test_equals_real_ddp_on_three_ranks(tmp_path, one_thread):
    """N = 3 tells apart what N = 2 cannot: multiplying by float(1/3) versus dividing by 3,
    and dividing before versus after the cast to bf16/fp16. All ranks get the same batch
    here, so the sum of the three contributions is the same in any order."""
    per_rank = naive_ddp.run_spawned([job for job, _, _ in THREE_RANK_JOBS], world_size=3, work_dir=tmp_path)
    for (job, wire_dtype, predivide), ddp0 in zip(THREE_RANK_JOBS, per_rank[0]):
        what = f"{wire_dtype} predivide={predivide}"
        trainer, grads, _ = simulate(job, 3, wire_dtype, predivide)
        for it in range(job.iterations):
            assert_bit_equal(grads[it], ddp0.reduced_grads[it], f"{what}: gradients of iteration {it}")
        assert_bit_equal(trainer.model.state_dict(), ddp0.model, f"{what}: parameters")
        assert_same_optimizer_state(trainer.optimizer.state_dict(), ddp0.optimizer)
    # The test has teeth: a plain division would not have matched DDP's built-in reduction.
    job, ddp0 = THREE_RANK_JOBS[0][0], per_rank[0][0]
    model = models.build(job.factory, job.kwargs, seed=job.seed)
    batch_loss(model, model.synthetic_data(batch_size=job.batch_size, seed=job.seed).batch(0, 0)).backward()
    divided = {n: (p.grad / 3 + p.grad / 3) + p.grad / 3 for n, p in model.named_parameters()}
    assert any(not torch.equal(divided[n], ddp0.reduced_grads[0][n]) for n in divided)
