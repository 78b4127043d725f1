"""``gradtap.trainer.describe``: the job spec from a live DDP trainer.

A real two-process gloo DDP job trains a small GPT (``gradtap.workload.models:gpt2``) with a
0.01 MiB bucket cap, so DDP rebuilds its one initial bucket into seven, in gradient-ready
order. The buckets describe reads from the reducer must be the ones the job's allreduces
carried, recorded independently by a comm hook (``GradBucket.parameters()``), and the ones
gradtap derives for the same model and cap (``job_buckets(job, "rebuilt")``). The document
must parse as a job spec once a ring and mirrors are added. The NCCL environment, the
optimizer and the scheduler are checked in-process: each mapping, and each refusal by name."""

from __future__ import annotations

import functools
import json
import os
import warnings

import pytest
import torch

import yaml

from gradtap.core.errors import ConfigError
from gradtap.trainer.describe import ddp_param_names, describe_to, nccl_section, nccl_version, optimizer_section
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.schedule import lr_factor
from gradtap.workload.spec import Schedule, dump_job, load_job, parse_job
from tests.forked import start_ranks
from tests.gloo import end_spawned_rank, gloo_group

WORLD = 2
FACTORY = "gradtap.workload.models:gpt2"
KWARGS = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "block_size": 16}
CAP_MB = 0.01
SCHEDULE = Schedule(kind="warmup_cosine", warmup_steps=2, total_steps=20, min_lr_ratio=0.1)
ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
RING_AND_MIRRORS = {"ring": {"ranks": [{"ip": "198.18.0.1", "mac": "02:00:00:00:00:01"},
                                       {"ip": "198.18.1.1", "mac": "02:00:00:00:00:02"}]},
                    "mirrors": [{"name": "r0-egress", "rank": 0, "direction": "egress"}]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """What rank 0 of the gloo job saw (see :func:`_worker`)."""
    tmp = tmp_path_factory.mktemp("describe")
    (tmp / "job.yaml").write_text(yaml.safe_dump({"name": "operator-named", **RING_AND_MIRRORS,
                                                  "nccl": {"mtu": 4096, "channels": 4, "era": "2.21"}}))
    ctx = start_ranks(_worker, (WORLD, str(tmp)), WORLD)
    while not ctx.join(timeout=120):
        pass
    return json.loads((tmp / "seen.json").read_text()), tmp


def _job(doc: dict):
    return parse_job({**doc, **RING_AND_MIRRORS}, "described")


def _names(job, buckets) -> list[list[str]]:
    params = job_params(job)
    return [[params[i].name for i in b.params] for b in buckets]


@pytest.mark.slow
def test_the_buckets_are_those_ddp_allreduced(run):
    seen, _ = run
    recorded = seen["recorded"]
    assert len(recorded[0]) == 1 and len(recorded[1]) == 7       # the initial bucket, then the rebuilt ones
    assert recorded[1] == recorded[2]
    assert not seen["logged_at_step2"] and seen["logged_at_step3"]    # both ways of reading are exercised
    for doc in (seen["step2"], seen["step3"], seen["plain"], seen["fp16"]):
        assert doc["ddp"]["layout"] == "explicit" and doc["ddp"]["buckets"] == recorded[1]
        assert job_buckets(_job(doc)) == job_buckets(_job(seen["step3"]))


@pytest.mark.slow
def test_the_buckets_are_gradtaps_own_rebuilt_layout(run):
    seen, _ = run
    derived = _job({**seen["plain"], "ddp": {"bucket_cap_mb": CAP_MB, "layout": "rebuilt"}})
    assert _names(derived, job_buckets(derived, "rebuilt")) == seen["recorded"][1]
    assert seen["plain"]["ddp"]["bucket_cap_mb"] == pytest.approx(CAP_MB, rel=1e-3)


@pytest.mark.slow
def test_the_document_is_a_job_spec_and_round_trips(run):
    seen, _ = run
    doc = seen["plain"]
    assert doc["model"] == {"factory": FACTORY, "kwargs": KWARGS}
    assert doc["ddp"]["grad_dtype"] == "fp32" and doc["ddp"]["predivide"] is True
    assert seen["fp16"]["ddp"]["grad_dtype"] == "fp16"
    assert doc["optimizer"] == {"kind": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                "weight_decay": 0.01, "implementation": "single_tensor",
                                "schedule": SCHEDULE.model_dump(mode="json"), "clip_grad_norm": 1.0}
    assert doc["nccl"] == {"era": "auto", "protocol": "Simple"}      # gloo on CPU: no NCCL to ask
    params = [p["name"] for p in seen["step3"]["model"]["params"]]
    assert params == [p.name for p in job_params(_job(doc))]         # DDP's order is the factory's
    job = _job(doc)
    again = parse_job(yaml.safe_load(dump_job(job)))
    assert again == job and job_buckets(again) == job_buckets(job)


@pytest.mark.slow
def test_describe_to_merges_into_the_operators_file(run):
    seen, tmp = run
    job = load_job(tmp / "job.yaml")
    assert job.name == "operator-named" and len(job.ring.ranks) == 2 and job.mirrors[0].name == "r0-egress"
    assert (job.nccl.mtu, job.nccl.channels, job.nccl.era, job.nccl.protocol) == (4096, 4, "2.21", "Simple")
    assert _names(job, job_buckets(job)) == seen["recorded"][1]
    assert (tmp / "job.yaml").read_text().startswith("# model, ddp, optimizer and nccl written by")


@pytest.mark.slow
def test_ddp_states_describe_refuses_by_name(run):
    seen, _ = run
    assert "has not rebuilt its buckets yet" in seen["step1_error"] and "second training step" in seen["step1_error"]
    assert "the comm hook 'tests.gradtap.test_describe._worker.<locals>.record' is not one gradtap knows" \
        in seen["hook_error"] and "grad_dtype=" in seen["hook_error"]
    # DDP's buffer broadcast shares the communicator: refused, naming the buffer and the fix.
    assert "broadcast_buffers=True and the model has buffers (mask)" in seen["buffers_error"] \
        and "broadcast_buffers=False" in seen["buffers_error"]
    assert seen["buffers_quiet"] == [p["name"] for p in seen["step3"]["model"]["params"]]


def _worker(rank: int, world: int, tmp: str) -> None:
    """Three DDP copies of one model (a recording comm hook, none, ``fp16_compress_hook``: the
    bf16 one needs CUDA) train three steps; rank 0 describes them and writes what it saw to
    ``seen.json``."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradtap.trainer import describe
    from gradtap.workload.data import batch_loss
    from gradtap.workload.models import build

    torch.set_num_threads(1)
    with gloo_group(init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world):
        kinds = ("recorded", "plain", "fp16")
        models = {k: build(FACTORY, KWARGS, seed=0) for k in kinds}
        ddps = {k: DDP(m, bucket_cap_mb=CAP_MB) for k, m in models.items()}
        # A model with a buffer: DDP broadcasts it before every forward unless told not to.
        buffered = build(FACTORY, KWARGS, seed=0)
        buffered.register_buffer("mask", torch.ones(4))
        broadcasting, quiet = DDP(buffered, bucket_cap_mb=CAP_MB), DDP(buffered, bucket_cap_mb=CAP_MB,
                                                                       broadcast_buffers=False)
        names = {id(p): n for n, p in models["recorded"].named_parameters()}
        recorded: list[list[list[str]]] = []

        def record(state, bucket):       # what this iteration's allreduces carry, in launch order
            recorded[-1].append([names[id(p)] for p in bucket.parameters()])
            assert bucket.index() == len(recorded[-1]) - 1
            return allreduce_hook(state, bucket)

        ddps["recorded"].register_comm_hook(None, record)
        ddps["fp16"].register_comm_hook(None, fp16_compress_hook)
        optimizers = {k: torch.optim.AdamW(d.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
                      for k, d in ddps.items()}
        schedulers = {k: torch.optim.lr_scheduler.LambdaLR(o, functools.partial(lr_factor, SCHEDULE))
                      for k, o in optimizers.items()}
        data = models["plain"].synthetic_data(batch_size=2, seed=0)
        seen: dict = {"recorded": recorded}

        def describe_recorded(**extra):
            return describe(ddps["recorded"], optimizers["recorded"], schedulers["recorded"], name="gpt-tiny",
                            environ=ENV, clip_grad_norm=1.0, **extra)

        def logged(k):
            return "rebuilt_per_bucket_param_indices" in ddps[k]._get_ddp_logging_data()

        for step in range(3):
            recorded.append([])
            for k in kinds:
                batch_loss(ddps[k], data.batch(rank, step)).backward()
                optimizers[k].step()
                optimizers[k].zero_grad()
                schedulers[k].step()
            if rank != 0:
                continue
            if step == 0:
                try:
                    describe_recorded(grad_dtype="fp32", predivide=True)
                except ConfigError as exc:
                    seen["step1_error"] = str(exc)
            if step == 1:
                seen["logged_at_step2"] = logged("recorded")
                seen["step2"] = describe_recorded(grad_dtype="fp32", predivide=True)
        if rank == 0:
            seen["logged_at_step3"] = logged("recorded")
            seen["step3"] = describe_recorded(grad_dtype="fp32", predivide=True)
            try:
                describe_recorded()
            except ConfigError as exc:
                seen["hook_error"] = str(exc)
            seen["plain"] = describe(ddps["plain"], optimizers["plain"], schedulers["plain"], name="gpt-tiny",
                                     factory=FACTORY, kwargs=KWARGS, environ=ENV, clip_grad_norm=1.0)
            seen["fp16"] = describe(ddps["fp16"], optimizers["fp16"], schedulers["fp16"], name="gpt-tiny",
                                    environ=ENV)
            describe_to(f"{tmp}/job.yaml", ddps["plain"], optimizers["plain"], schedulers["plain"], environ=ENV)
            for ddp, key in ((broadcasting, "buffers_error"), (quiet, "buffers_quiet")):
                try:
                    seen[key] = ddp_param_names(ddp)
                except ConfigError as exc:
                    seen[key] = str(exc)
            with open(f"{tmp}/seen.json", "w") as f:
                json.dump(seen, f)
    end_spawned_rank()


# --- the optimizer and its scheduler ------------------------------------------------------------

def _params():
    return list(torch.nn.Linear(3, 2).parameters())


def test_adam_and_adamw_map_with_their_schedule():
    opt = torch.optim.AdamW(_params(), lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, SCHEDULE))
    opt.step()
    sched.step()
    assert optimizer_section(opt, sched) == {
        "kind": "adamw", "lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
        "implementation": "single_tensor", "schedule": SCHEDULE.model_dump(mode="json")}
    adam = optimizer_section(torch.optim.Adam(_params(), lr=0.01, fused=True))
    assert (adam["kind"], adam["implementation"], adam["schedule"]) == ("adam", "fused", {"kind": "constant"})
    assert optimizer_section(torch.optim.Adam(_params(), foreach=True))["implementation"] == "foreach"
    # Unset foreach/fused: torch's own choice for CPU tensors, the single-tensor loop.
    assert optimizer_section(torch.optim.Adam(_params()))["implementation"] == "single_tensor"
    assert optimizer_section(torch.optim.Adam(_params(), decoupled_weight_decay=True))["kind"] == "adamw"


@pytest.mark.parametrize("make, match", [
    (lambda p: torch.optim.SGD(p, lr=0.1), r"optimizer: torch\.optim\.sgd\.SGD is not torch\.optim\.Adam or AdamW"),
    (lambda p: torch.optim.Adam(p, amsgrad=True), r"optimizer\.amsgrad: True is not modelled"),
    (lambda p: torch.optim.Adam(p, maximize=True), r"optimizer\.maximize"),
    (lambda p: torch.optim.AdamW([{"params": p[:1]}, {"params": p[1:], "weight_decay": 0.0}]),
     r"optimizer\.weight_decay: param_groups\[1\] has 0\.0, param_groups\[0\] 0\.01"),
    (lambda p: torch.optim.Adam([{"params": p[:1]}, {"params": p[1:], "lr": 0.1}]),
     r"optimizer\.lr: param_groups\[1\]"),
])
def test_optimizers_gradtap_cannot_step_are_refused_by_name(make, match):
    with pytest.raises(ConfigError, match=match):
        optimizer_section(make(_params()))


@pytest.mark.parametrize("make, match", [
    (lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3),
     r"scheduler torch\.optim\.lr_scheduler\.StepLR is not one gradtap models"),
    (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10), r"scheduler .*CosineAnnealingLR"),
    (lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s), r"LambdaLR with lr_lambda '.*<lambda>'"),
])
def test_schedulers_gradtap_cannot_evaluate_are_refused_by_name(make, match):
    opt = torch.optim.Adam(_params())
    with pytest.raises(ConfigError, match=r"optimizer\.schedule: " + match):
        optimizer_section(opt, make(opt))


def test_a_scheduler_left_out_is_noticed():
    opt = torch.optim.Adam(_params(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    with pytest.raises(ConfigError, match=r"optimizer\.schedule: the optimizer's lr 0\.05 is not its initial_lr 0\.1"):
        optimizer_section(opt)


def test_the_optimizer_must_step_ddps_parameters():
    params = _params()
    with pytest.raises(ConfigError, match="optimizer: steps 1 parameters, DDP reduces 2"):
        optimizer_section(torch.optim.Adam(params[:1]), params=params)


# --- the NCCL environment -----------------------------------------------------------------------

def _nccl(monkeypatch, env: dict, version=None) -> dict:
    for key in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return nccl_section(os.environ, version)


def test_nccl_variables_map_as_documented(monkeypatch):
    got = _nccl(monkeypatch, {
        "NCCL_ALGO": "ring", "NCCL_PROTO": "LL128", "NCCL_IB_QPS_PER_CONNECTION": "4",
        "NCCL_IB_SPLIT_DATA_ON_QPS": "0", "NCCL_IB_ADAPTIVE_ROUTING": "1", "NCCL_IB_AR_THRESHOLD": "0x4000",
        "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8", "NCCL_BUFFSIZE": "8388608",
        "NCCL_LL_BUFFSIZE": "1048576", "NCCL_LL128_BUFFSIZE": "2097152", "NCCL_LL128_NTHREADS": "320",
        "NCCL_NTHREADS": "256", "NCCL_DEBUG": "INFO"}, (2, 21, 5))
    assert got == {"era": "2.21", "protocol": "LL128", "qps_per_connection": 4, "split_data_on_qps": False,
                   "adaptive_routing": True, "ar_threshold": 16384, "channels": 8,
                   "buffsize": {"Simple": 8388608, "LL": 1048576, "LL128": 2097152}, "nthreads": 320}


@pytest.mark.parametrize("proto, protocol", [
    ("Simple", "Simple"), ("simple", "Simple"), ("LL,LL128", "auto"), ("^LL,LL128", "Simple"), ("^LL", "auto"),
    ("Simple;allreduce:LL", "LL"), ("LL;broadcast:Simple", "LL"), (None, "auto")])
def test_nccl_proto_pins_a_protocol_only_when_it_leaves_one(monkeypatch, proto, protocol):
    env = {"NCCL_ALGO": "Ring"} | ({"NCCL_PROTO": proto} if proto else {})
    assert _nccl(monkeypatch, env)["protocol"] == protocol


def test_channels_need_min_and_max_equal_and_the_new_names_win(monkeypatch):
    assert "channels" not in _nccl(monkeypatch, {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "4"})
    assert "channels" not in _nccl(monkeypatch, {"NCCL_ALGO": "Ring", "NCCL_MIN_NCHANNELS": "2",
                                                 "NCCL_MAX_NCHANNELS": "4"})
    legacy = {"NCCL_ALGO": "Ring", "NCCL_MIN_NRINGS": "2", "NCCL_MAX_NRINGS": "2"}
    assert _nccl(monkeypatch, legacy)["channels"] == 2
    assert "channels" not in _nccl(monkeypatch, legacy | {"NCCL_MAX_NCHANNELS": "6"})


@pytest.mark.parametrize("algo", ["Tree", "Ring,Tree", "^NVLS", "Ring;allreduce:Tree", "CollNetDirect"])
def test_nccl_algo_other_than_ring_is_refused(monkeypatch, algo):
    with pytest.raises(ConfigError, match=r"NCCL_ALGO: .* allows .* for allreduce; gradtap reads ring allreduce"):
        _nccl(monkeypatch, {"NCCL_ALGO": algo})


def test_nccl_algo_ring_for_allreduce_only_is_enough(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _nccl(monkeypatch, {"NCCL_ALGO": "Tree;allreduce:Ring"})["protocol"] == "auto"


def test_nccl_algo_unset_warns(monkeypatch):
    with pytest.warns(UserWarning, match="NCCL_ALGO is unset: NCCL may run allreduce as Tree"):
        _nccl(monkeypatch, {})


@pytest.mark.parametrize("env, match", [
    ({"NCCL_PROTO": "Simple,LL9"}, r"NCCL_PROTO: 'Simple,LL9': 'LL9' is not one of"),
    ({"NCCL_PROTO": "^LL,LL128,Simple"}, r"NCCL_PROTO: .* leaves allreduce no protocol"),
    ({"NCCL_IB_QPS_PER_CONNECTION": "two"}, r"NCCL_IB_QPS_PER_CONNECTION: 'two' is not an integer"),
    ({"NCCL_NTHREADS": "256"}, r"nccl\.nthreads: NCCL_NTHREADS set while NCCL_PROTO leaves several protocols"),
    ({"NCCL_IB_OOO_RQ": "1"}, r"nccl\.ib_ooo_rq: .*NCCL_IB_OOO_RQ=1"),
])
def test_nccl_settings_gradtap_cannot_read_are_refused_by_name(monkeypatch, env, match):
    with pytest.raises(ConfigError, match=match):
        _nccl(monkeypatch, {"NCCL_ALGO": "Ring"} | env, (2, 30, 3))


def test_the_era_comes_from_torchs_nccl(monkeypatch):
    assert nccl_version() is None or torch.cuda.is_available()      # this CPU build has no NCCL to ask
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 18, 3))
    assert nccl_version() == (2, 18, 3)
    assert _nccl(monkeypatch, {"NCCL_ALGO": "Ring"}, nccl_version())["era"] == "2.19"     # 2.19 covers 2.18.x
    assert _nccl(monkeypatch, {"NCCL_ALGO": "Ring"}, (2, 27, 7))["era"] == "2.27"
    with pytest.raises(ConfigError, match=r"nccl\.era: NCCL 2\.17\.1 is not a release gradtap reads"):
        _nccl(monkeypatch, {"NCCL_ALGO": "Ring"}, (2, 17, 1))
