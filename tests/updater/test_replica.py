"""The replica equals the trainer's torch optimizer bit for bit, iteration after iteration, and
its state dicts load into a fresh model and torch.optim.Adam; the bucket protocol refuses
misuse; the simulator's ground truth is reproduced from its own gradients."""

from __future__ import annotations

import copy
import json
import weakref

import numpy as np
import pytest
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.workload.models import build
from gradtap.simulator.training import make_optimizer
from tests.forked import Child
from tests.simulator.test_simulate import make_job, simulate
from tests.updater.naive_adam import TorchStep, random_reduced
from gradtap.updater.replica import MAX_OFFERS, Begin, Replica
from gradtap.workload.layout import job_buckets
from gradtap.workload.spec import load_job, parse_job

RANKS = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:01:{i + 1:02x}"} for i in range(3)]


def job(kind="adam", implementation="single_tensor", wire="fp32", predivide=True, clip=None,
        schedule=None, factory=("gradtap.workload.models:mlp", {"sizes": [33, 129, 65, 17, 5]}), **opt):
    optimizer = {"kind": kind, "implementation": implementation, "lr": 1e-3, **opt}
    if clip is not None:
        optimizer["clip_grad_norm"] = clip
    if schedule is not None:
        optimizer["schedule"] = schedule
    return parse_job({
        "name": "replica-test", "model": {"factory": factory[0], "kwargs": factory[1]},
        "ddp": {"bucket_cap_mb": 0.004, "grad_dtype": wire, "predivide": predivide},
        "optimizer": optimizer, "ring": {"ranks": RANKS},
        "mirrors": [{"name": "m", "rank": 0, "direction": "egress"}],
    })


def assert_equal_state(replica: Replica, reference: TorchStep):
    want = reference.arrays()
    sd = replica.state_dict()
    names = [p.name for p in replica.layout.params]
    for key, value in want.items():
        kind, name = key.split("/", 1)
        got = sd["model"][name] if kind == "param" else sd["optimizer"]["state"][names.index(name)][kind]
        differ = np.flatnonzero(got.numpy().view(np.uint32).ravel() != value.view(np.uint32).ravel())
        assert differ.size == 0, f"{key}: {differ.size} elements differ, first {differ[:4]}"
    assert replica.step == int(reference.optimizer.state[reference.params[0]]["step"])


def train_on_alike(j, model, optimizer, reference: TorchStep, replica: Replica, iterations, seed: int) -> None:
    """A trainer resumed as ``model`` and ``optimizer`` steps ``iterations`` on the same random
    gradients as ``reference`` (the uninterrupted trainer) and ``replica``: all three end bit
    for bit equal."""
    resumed = TorchStep(j)
    resumed.model, resumed.params, resumed.optimizer = model, list(model.parameters()), optimizer
    rng = np.random.default_rng(seed)
    for it in iterations:
        reduced = random_reduced(j, rng)
        resumed.step(it, reduced)
        reference.step(it, reduced)
        replica.apply(it, np.concatenate(reduced))
    for key, value in reference.arrays().items():
        assert np.array_equal(resumed.arrays()[key].view(np.uint32), value.view(np.uint32)), key
    assert_equal_state(replica, reference)


def drive(j, iterations=20, seed=0, shuffle=True, scale_exp=(-12, 1), lasting=False):
    replica, reference = Replica.from_job(j), TorchStep(j)
    rng = np.random.default_rng(seed)
    for it in range(iterations):
        reduced = random_reduced(j, rng, scale_exp=scale_exp)
        reference.step(it, reduced)
        replica.begin(it)
        for b in (rng.permutation(len(reduced)) if shuffle else range(len(reduced))):
            replica.apply_bucket(int(b), reduced[b], lasting=lasting)
        replica.end()
    return replica, reference


CASES = [
    dict(),
    dict(kind="adamw", weight_decay=0.1, implementation="foreach"),
    dict(kind="adam", weight_decay=0.01, implementation="fused", wire="bf16"),
    dict(kind="adamw", weight_decay=0.01, wire="fp16", predivide=False, betas=(0.5, 0.99)),
    dict(kind="adamw", weight_decay=0.01, clip=1e-3, schedule={"kind": "warmup_cosine", "warmup_steps": 3,
                                                                "total_steps": 15, "min_lr_ratio": 0.1}),
    dict(kind="adam", implementation="fused", clip=1e-2, predivide=False, wire="bf16"),
    dict(kind="adamw", implementation="foreach", clip=1e9, wire="fp16"),     # clip never binds
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_equals_the_trainers_optimizer(case):
    replica, reference = drive(job(**case))
    assert_equal_state(replica, reference)
    assert replica.iteration == 20 and not replica.stale


@pytest.mark.parametrize("case", [dict(kind="adamw", weight_decay=0.01, clip=1e-3),
                                  dict(kind="adam", implementation="fused", clip=1e-2),
                                  dict(kind="adamw", implementation="foreach", clip=1e-2, wire="bf16"),
                                  dict(kind="adam", clip=1e-2, predivide=False)],
                         ids=["adamw", "fused", "bf16", "summed"])
def test_a_clipped_iteration_reads_lasting_buckets_again_instead_of_widening_them(case):
    """With ``lasting`` buckets (the merger's) and the trainer's own float32 gradient on the
    wire, a clipped iteration keeps the buckets themselves until end(): no widened copy is
    made, and the result is still the trainer's bit for bit. Another wire dtype, or a sum
    still to be divided, is widened as before."""
    replica, reference = drive(job(**case), iterations=6, lasting=True)
    assert_equal_state(replica, reference)
    widens = case.get("wire", "fp32") != "fp32" or case.get("predivide") is False
    assert (replica._grad32 is not None) == widens


def test_apply_takes_a_flat_gradient_and_bytes():
    j = job(wire="bf16")
    replica, reference = Replica.from_job(j), TorchStep(j)
    rng = np.random.default_rng(5)
    for it in range(3):
        reduced = random_reduced(j, rng)
        reference.step(it, reduced)
        flat = np.concatenate(reduced)
        replica.apply(it, flat if it % 2 else flat.view(np.uint8))
    assert_equal_state(replica, reference)


def test_state_dicts_load_into_torch_and_train_on_identically():
    j = job(kind="adamw", weight_decay=0.05)
    replica, reference = drive(j, iterations=5)
    model = build(j.model.factory, j.model.kwargs, seed=99)          # other weights, overwritten
    optimizer = make_optimizer(list(model.parameters()), j.optimizer)
    sd = replica.state_dict()
    model.load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optimizer"])
    assert optimizer.state_dict()["param_groups"] == reference.optimizer.state_dict()["param_groups"]
    train_on_alike(j, model, optimizer, reference, replica, range(5, 8), seed=11)


def test_tied_weights_appear_under_both_names():
    tiny = ("gradtap.workload.models:gpt2",
            {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 37, "block_size": 8})
    j = job(factory=tiny)
    replica, reference = drive(j, iterations=3)
    assert_equal_state(replica, reference)
    sd = replica.state_dict()["model"]
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    model = build(*tiny, seed=3)
    model.load_state_dict(sd)
    assert torch.equal(model.lm_head.weight, reference.model.lm_head.weight)
    # Handed over, the tied weight's second name leaves with the first: it holds the same memory.
    handed = replica.state_dict(copy=False)
    taken = Replica(j, handed, consume=True)
    assert not handed["model"], list(handed["model"])
    assert taken.state.param.tobytes() == replica.state.param.tobytes()


def test_protocol_misuse_is_refused():
    j = job()
    replica = Replica.from_job(j)
    reduced = random_reduced(j, np.random.default_rng(0))
    with pytest.raises(GradtapError, match="no iteration is open"):
        replica.apply_bucket(0, reduced[0])
    assert replica.begin(0) is Begin.OPENED
    with pytest.raises(GradtapError, match="still open"):
        replica.begin(0)
    with pytest.raises(GradtapError, match="not one of the job's"):
        replica.apply_bucket(len(reduced), reduced[0])
    with pytest.raises(GradtapError, match="takes"):
        replica.apply_bucket(0, reduced[0][:-1])
    with pytest.raises(GradtapError, match="takes"):
        replica.apply_bucket(0, reduced[0].astype(np.float64))
    with pytest.raises(GradtapError, match="bytes"):
        replica.apply_bucket(0, reduced[0].view(np.uint8)[:-4])
    replica.apply_bucket(0, reduced[0])
    with pytest.raises(GradtapError, match="already applied"):
        replica.apply_bucket(0, reduced[0])
    with pytest.raises(GradtapError, match="half applied"):
        replica.state_dict()
    with pytest.raises(GradtapError, match="lacks buckets"):
        replica.end()
    with pytest.raises(GradtapError, match="the job's buckets take"):
        Replica.from_job(j).apply(0, np.concatenate(reduced)[:-1])


def test_abort_makes_stale_until_resync():
    j = job(clip=1e-2)
    replica, reference = drive(j, iterations=2)
    rng = np.random.default_rng(7)
    reduced = random_reduced(j, rng)
    reference.step(2, reduced)               # the trainer goes on; the replica loses iteration 2
    replica.begin(2)
    replica.apply_bucket(1, reduced[1])
    replica.abort()
    assert replica.stale
    assert replica.begin(3) is Begin.STALE and replica.open_iteration is None
    with pytest.raises(GradtapError, match="stale"):
        replica.apply(3, np.concatenate(reduced))
    replica.resync({"model": reference.model.state_dict(), "optimizer": reference.optimizer.state_dict(),
                    "iteration": 3})
    assert not replica.stale and replica.iteration == 3 and replica.step == 3
    for it in range(3, 6):
        reduced = random_reduced(j, rng)
        reference.step(it, reduced)
        replica.apply(it, np.concatenate(reduced))
    assert_equal_state(replica, reference)


def trainer_checkpoint(reference: TorchStep, iteration: int) -> dict:
    return {"model": reference.model.state_dict(), "optimizer": reference.optimizer.state_dict(),
            "iteration": iteration}


def finish_both(j, replica: Replica, reference: TorchStep, iteration: int, rng, lasting: bool = False) -> None:
    """Iteration ``iteration``, which the replica has begun, on random gradients: the reference
    steps it, the replica takes it bucket by bucket (``apply_bucket``'s ``lasting``), and both
    must then be equal."""
    reduced = random_reduced(j, rng)
    reference.step(iteration, reduced)
    for b, grad in enumerate(reduced):
        replica.apply_bucket(b, grad, lasting=lasting)
    replica.end()
    assert_equal_state(replica, reference)


def test_a_missed_iteration_makes_stale_and_an_older_one_is_refused():
    j = job()
    replica, _ = drive(j, iterations=2)
    with pytest.raises(GradtapError, match="next iteration is 2"):
        replica.begin(1)
    assert not replica.stale
    assert replica.begin(4) is Begin.MISSED
    assert replica.stale and replica.open_iteration is None and replica.iteration == 2
    assert replica.begin(5) is Begin.STALE


def test_a_stale_replica_resyncs_from_the_checkpoint_offered_for_the_iteration_it_begins(monkeypatch):
    j = job()
    replica, reference = drive(j, iterations=2)
    rng = np.random.default_rng(3)
    for it in (2, 3):                                   # the replica loses iteration 2
        reference.step(it, random_reduced(j, rng))
    replica.begin(2)
    replica.abort()
    checkpoint = trainer_checkpoint(reference, 4)
    replica.offer(checkpoint)
    assert replica.begin(3) is Begin.STALE and replica.stale          # not the offered iteration
    assert list(replica.offers) == [4]
    # The offer holds its state ready: begin(), on the update path, makes none and reads no
    # checkpoint (here, one that no longer holds its tensors).
    checkpoint["model"].clear()
    monkeypatch.setattr("gradtap.updater.replica.from_checkpoint", None)
    assert replica.begin(4) is Begin.RESYNCED
    assert not replica.stale and replica.open_iteration == 4 and replica.step == 4 and not replica.offers
    finish_both(j, replica, reference, 4, rng)
    assert replica.begin(5) is Begin.OPENED


@pytest.mark.parametrize("case, lasting, widened", [
    (dict(clip=1e-2, predivide=False, wire="bf16"), True, True),
    (dict(clip=1e-2), False, True),             # fp32 pre-divided, but not kept as handed
    (dict(clip=1e-2), True, False),             # fp32 pre-divided and kept: nothing to widen into
    (dict(predivide=False, wire="bf16"), True, False),   # no clipping: stepped bucket by bucket
])
def test_prepare_makes_at_start_up_what_stepping_needs(case, lasting, widened, monkeypatch):
    """After prepare(), an iteration makes no memory of its own: what it would have made at its
    first clipped bucket, on the update path, was made at start-up; and only what it needs."""
    j = job(**case)
    replica, reference = Replica.from_job(j), TorchStep(j)
    replica.prepare(lasting=lasting)
    assert (replica._grad32 is not None) == widened
    monkeypatch.setattr("gradtap.updater.replica.prefaulted", None)    # any later making fails
    rng = np.random.default_rng(7)
    for it in range(3):
        replica.begin(it)
        finish_both(j, replica, reference, it, rng, lasting)


def test_an_offer_made_before_ddps_rebuild_resyncs_in_the_rebuilt_layout():
    """The offer's state is made in the layout of the moment; DDP's rebuild comes before the
    replica begins the offered iteration, which must then hold it in the rebuilt order."""
    j = job(kind="adamw", weight_decay=0.1)
    initial, rebuilt = job_buckets(j, "initial"), job_buckets(j)
    replica, reference = Replica.from_job(j, buckets=initial), TorchStep(j, buckets=initial)
    rng = np.random.default_rng(5)
    reduced = random_reduced(j, rng, buckets=initial)
    reference.step(0, reduced)
    replica.apply(0, np.concatenate(reduced))
    reference.buckets = rebuilt
    reference.step(1, random_reduced(j, rng))
    replica.offer(copy.deepcopy(trainer_checkpoint(reference, 2)))      # still in the initial layout
    replica.relayout(rebuilt)
    assert replica.begin(1) is Begin.OPENED
    replica.abort()                                                     # iteration 1 is lost
    assert replica.begin(2) is Begin.RESYNCED
    finish_both(j, replica, reference, 2, rng)


def test_offers_are_bounded_and_dropped_once_passed():
    j = job()
    replica, reference = drive(j, iterations=1)
    for k in range(10, 10 + MAX_OFFERS + 2):
        replica.offer(trainer_checkpoint(reference, k))
    assert sorted(replica.offers) == list(range(10, 10 + MAX_OFFERS))    # the earliest, reached first
    replica.offer(trainer_checkpoint(reference, 10))                      # a newer copy replaces the old
    assert len(replica.offers) == MAX_OFFERS
    assert replica.begin(1) is Begin.OPENED
    replica.abort()
    assert replica.begin(12) is Begin.RESYNCED
    assert sorted(replica.offers) == list(range(13, 10 + MAX_OFFERS))    # passed ones can never be used


def test_an_offer_made_then_passed_by_the_streams_is_refused_when_held():
    """An offer is made (copied and checked) without the replica's lock, then held: the
    streams may have passed its iteration meanwhile, and holding it checks again. One handed
    over is left without its tensors, and resyncs the replica as one kept would."""
    j = job()
    replica, reference = drive(j, iterations=1)
    handed = copy.deepcopy(trainer_checkpoint(reference, 3))    # not the reference optimizer's own state
    made = replica.make_offer(handed, consume=True)
    assert not handed["model"] and replica.offers == {}, "made, not held"
    late = replica.make_offer(trainer_checkpoint(reference, 2))
    assert replica.begin(1) is Begin.OPENED
    replica.abort()
    assert replica.begin(2) is Begin.STALE           # no offer held for it: the streams pass iteration 2
    with pytest.raises(ConfigError, match="iteration 2: the streams are past it"):
        replica.hold(late)
    assert replica.hold(made) == [] and list(replica.offers) == [3]
    kept = Replica(j, trainer_checkpoint(reference, 3))
    assert replica.begin(3) is Begin.RESYNCED
    for name in ("param", "exp_avg", "exp_avg_sq"):
        assert getattr(replica.state, name).tobytes() == getattr(kept.state, name).tobytes()


def test_a_checkpoint_of_another_optimizer_or_model_is_refused():
    j = job()
    reference = TorchStep(j)
    reference.step(0, random_reduced(j, np.random.default_rng(0)))
    good = {"model": reference.model.state_dict(), "optimizer": reference.optimizer.state_dict(),
            "iteration": 1}
    Replica(j, good)
    with pytest.raises(ConfigError, match="betas"):
        Replica(job(betas=(0.8, 0.999)), good)
    with pytest.raises(ConfigError, match="weight_decay"):
        Replica(job(weight_decay=0.1), good)
    with pytest.raises(ConfigError, match=r"'layers.2.weight' is .*\(65, 129\).* says \(5, 129\)"):
        Replica(job(factory=("gradtap.workload.models:mlp", {"sizes": [33, 129, 5]})), good)
    with pytest.raises(ConfigError, match="lacks parameters"):
        Replica(job(factory=("gradtap.workload.models:mlp", {"sizes": [33, 129, 65, 17, 5, 5]})), good)
    bad = dict(good, model={**good["model"], "layers.0.weight": torch.zeros(3, 3)})
    with pytest.raises(ConfigError, match="layers.0.weight"):
        Replica(j, bad)
    with pytest.raises(ConfigError, match="no 'optimizer'"):
        Replica(j, {"model": good["model"]})
    with pytest.raises(ConfigError, match="lists its parameters must start from initial_state.checkpoint"):
        Replica.from_job(parse_job({**json.loads(j.model_dump_json(exclude_none=True)),
                                    "model": {"params": [{"name": "w", "shape": [3]}]},
                                    "ddp": {"layout": "initial"}}))


def test_a_consumed_checkpoint_gives_each_tensor_up_once_copied_and_nothing_when_refused():
    """``consume``: a replica built from a checkpoint handed over takes its tensors out of it, so
    that the two are never both held (12 B per parameter each); the state is the one built
    from the same checkpoint kept. A checkpoint that is refused is refused whole, before any
    tensor leaves it."""
    j = job()
    reference = TorchStep(j)
    reference.step(0, random_reduced(j, np.random.default_rng(0)))
    good = trainer_checkpoint(reference, 1)
    kept = Replica(j, good)
    handed = copy.deepcopy(good)
    tensors = [*handed["model"].values(), *(t for e in handed["optimizer"]["state"].values()
                                           for k, t in e.items() if k != "step")]
    alive = [weakref.ref(t) for t in tensors]
    del tensors
    refused = copy.deepcopy(good)
    refused["optimizer"]["state"][len(kept.layout.params) - 1]["exp_avg_sq"] = torch.zeros(2)
    before = {k: list(v) for k, v in refused["optimizer"]["state"].items()}
    with pytest.raises(ConfigError, match="exp_avg_sq of 'layers.6.bias'"):
        Replica(j, refused, consume=True)
    assert {k: list(v) for k, v in refused["optimizer"]["state"].items()} == before
    assert list(refused["model"]) == list(good["model"])
    consumed = Replica(j, handed, consume=True)
    assert not handed["model"], "parameters left in the checkpoint"
    assert all(list(e) == ["step"] for e in handed["optimizer"]["state"].values())
    assert not any(r() is not None for r in alive), "a tensor of the handed checkpoint is still alive"
    for a, b in ((kept.state.param, consumed.state.param), (kept.state.exp_avg, consumed.state.exp_avg),
                 (kept.state.exp_avg_sq, consumed.state.exp_avg_sq)):
        assert a.tobytes() == b.tobytes()
    assert (kept.step, kept.iteration) == (consumed.step, consumed.iteration) == (1, 1)
    assert all(isinstance(good["model"][p.name], torch.Tensor) for p in kept.layout.params), "kept was consumed"


# A forked child: a checkpoint of 134 MB of parameters (8 weights of 16.8 MB, with both
# moments 403 MB) whose tensors lie in the heap, as they do once glibc has raised its mmap
# threshold (here fixed at 64 MiB: M_MMAP_THRESHOLD, glibc malloc.h), copied into the flat
# state kept (argv[1] "kept") or handed over ("consume"), or first into a replica whose own
# state_dict(copy=False) (views of its three flat arrays) is then handed over ("views"); prints
# how far the copy grew the process's resident memory at its peak (VmHWM after clear_refs "5",
# proc(5)).
CONSUMED = """
import gc, json, sys, torch
from gradtap.core.heap import give_back_freed, libc
from gradtap.simulator.training import make_optimizer
from gradtap.updater.state import FlatLayout, from_checkpoint
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.models import build
from tests.updater.test_replica import job

def status(field):
    return 1024 * next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

libc().mallopt(-3, 64 << 20)
j = job(factory=("gradtap.workload.models:mlp", {"sizes": [2048] * 9}))
model = build(j.model.factory, j.model.kwargs, seed=0)
optimizer = make_optimizer(list(model.parameters()), j.optimizer)
for p in model.parameters():
    p.grad = torch.ones_like(p)
optimizer.step()
checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": 1}
del model, optimizer, p
layout = FlatLayout(job_params(j), job_buckets(j))
if sys.argv[1] == "views":
    from gradtap.updater.replica import Replica
    replica = Replica(j, checkpoint, consume=True)
    checkpoint = replica.state_dict(copy=False)
    del replica
    gc.collect()
give_back_freed()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
state, _ = from_checkpoint(checkpoint, layout, j.optimizer, consume=sys.argv[1] != "kept")
print(json.dumps({"grown": status("VmHWM") - before, "state": 3 * state.param.nbytes}))
"""


def test_a_checkpoint_handed_over_in_the_heap_is_given_back_as_it_is_copied(tmp_path):
    """A checkpoint whose tensors lie in the heap (as they do in a process that has freed large
    blocks before: a later replay, a resync) gives its memory back to the system as the flat
    state takes its place: the copy grows the process by far less than the state it makes.
    Before, each freed tensor stayed resident, and GPT-2 small's later replays peaked at 23.9
    B per parameter in the start-up (22.7 in the replay itself)."""
    grown = {}
    for way in ("kept", "consume", "views"):
        with Child(CONSUMED, way, stderr=tmp_path / "err") as child:
            assert child.wait(300) == 0, (tmp_path / "err").read_text()
            grown[way] = json.loads(child.stdout.read())
    state = grown["kept"]["state"]
    assert state > 400e6
    assert grown["kept"]["grown"] > 0.9 * state, grown
    assert grown["consume"]["grown"] < state / 3, grown       # 73 MB here; 403 MB without the give-back
    # A replica's own state, handed over (``store/gradient_log.rebuild`` to ``--start-from-store``),
    # is three flat arrays, each freed once its last view leaves: copied one kind at a time, the
    # copy holds one more kind at most (a third of the state); copied parameter by parameter, all.
    assert grown["views"]["grown"] < state / 2, grown


@pytest.mark.parametrize("make", [lambda: make_job(), lambda: make_job(dtype="bf16", nqps=2),
                                  lambda: load_job("configs/small.yaml")],
                         ids=["small-mlp", "small-mlp-bf16", "configs/small.yaml"])
def test_reproduces_the_simulators_ground_truth(tmp_path, make):
    j = make()
    simulate(tmp_path, j, iterations=3)
    truth = tmp_path / "truth"
    replica = Replica(j, torch.load(truth / "start.pt", weights_only=True))
    layout = json.loads((truth / "layout.json").read_text())
    assert [b["numel"] for b in layout["buckets"]] == [b.numel for b in job_buckets(j)]
    names = [p.name for p in replica.layout.params]
    for it in json.loads((truth / "manifest.json").read_text())["iterations"]:
        d = truth / f"iter_{it:06d}"
        replica.apply(it, np.load(d / "grad.npy"))
        state = np.load(d / "state.npz")
        sd = replica.state_dict(copy=False)
        assert replica.step == int(state["step"])
        for key in state.files:
            if key == "step":
                continue
            kind, name = key.split("/", 1)
            got = sd["model"][name] if kind == "param" else sd["optimizer"]["state"][names.index(name)][kind]
            assert np.array_equal(got.numpy().view(np.uint32), state[key].view(np.uint32)), (it, key)


def test_relayout_follows_ddps_rebuild():
    """Iteration 0 in DDP's initial layout, then the rebuilt one, as a trainer from a seed does."""
    j = job(kind="adamw", weight_decay=0.1)
    initial, rebuilt = job_buckets(j, "initial"), job_buckets(j)
    assert [b.params for b in initial] != [b.params for b in rebuilt]
    replica = Replica.from_job(j, buckets=initial)
    reference = TorchStep(j, buckets=initial)
    rng = np.random.default_rng(2)
    reduced = random_reduced(j, rng, buckets=initial)
    reference.step(0, reduced)
    replica.apply(0, np.concatenate(reduced))
    replica.relayout(rebuilt)
    for name in ("param", "exp_avg", "exp_avg_sq"):     # the kernels' spans are cut on cache lines
        assert getattr(replica.state, name).ctypes.data % 64 == 0, name
    # The move lends each array's memory to the next: no two may end up sharing it.
    assert len({getattr(replica.state, name).ctypes.data for name in ("param", "exp_avg", "exp_avg_sq")}) == 3
    reference.buckets = rebuilt
    for it in range(1, 4):
        reduced = random_reduced(j, rng)
        reference.step(it, reduced)
        replica.apply(it, np.concatenate(reduced))
    assert_equal_state(replica, reference)
