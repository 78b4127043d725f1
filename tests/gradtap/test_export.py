"""``gradtap export``: a replica's snapshot as DCP, a state dict and safetensors.

The snapshot comes from a replay that ``verify`` holds equal to the simulated trainer, bit for
bit. Each format is read back by its own library (``torch.load``, ``safetensors``,
``torch.distributed.checkpoint``). The DCP export is then loaded, resharded, by a real
two-process gloo job whose model is sharded with FSDP2 (``fully_shard``), which trains on:
it must stay bit-identical to the same FSDP2 job started from the trainer's own state."""

from __future__ import annotations

import json
import shutil

import pytest
import torch


from gradtap.commands.export import FORMATS as CLI_FORMATS
from gradtap.core.errors import ConfigError
from gradtap.export import FORMATS, by_name, export_checkpoint
from gradtap.trainer.restore import EXPORT_INFO, restore
from gradtap.replay import run_replay
from gradtap.store import snapshot
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.workload.models import build
from tests.forked import run_cli, start_ranks
from tests.gloo import end_spawned_rank, gloo_group
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate

STEPS_AFTER = 3          # FSDP2 training steps after the load
WORLD = 2


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    """A job, its replay's snapshots directory (verified equal to the trainer) and the newest snapshot."""
    tmp = tmp_path_factory.mktemp("export")
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp / "sim", job, iterations=3)
    run_replay(job, streams_of(tmp / "sim", job), tmp / "replay", start_of(tmp / "sim"))
    v = verify(tmp / "replay", tmp / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale, v
    snaps = tmp / "replay" / "snapshots"
    return job, snaps, snapshot.load(snapshot.latest(snaps)), tmp


def test_the_package_offers_restore_as_the_readme_calls_it():
    import gradtap.trainer

    assert gradtap.trainer.restore is restore and callable(gradtap.trainer.restore)


def test_the_command_offers_the_formats_the_exporter_writes():
    assert CLI_FORMATS == FORMATS


def test_state_dict_export_is_the_snapshot(replica, tmp_path):
    job, snaps, state, _ = replica
    info = export_checkpoint(snaps, job, "state-dict", tmp_path / "sd")
    assert info["iteration"] == state["iteration"] and json.loads((tmp_path / "sd" / EXPORT_INFO).read_text()) == info
    got = torch.load(tmp_path / "sd" / "checkpoint.pt", weights_only=True)
    assert got["iteration"] == state["iteration"]
    assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
    assert _same_optimizer(got["optimizer"], state["optimizer"])


def test_safetensors_export_reads_back_with_safetensors(replica, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    job, snaps, state, _ = replica
    export_checkpoint(snaps, job, "safetensors", tmp_path / "st")
    model = load_file(tmp_path / "st" / "model.safetensors")
    assert model.keys() == state["model"].keys() and all(torch.equal(model[k], v) for k, v in state["model"].items())
    optim = load_file(tmp_path / "st" / "optimizer.safetensors")
    names = [p.name for p in job_params(job)]
    for i, entry in state["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim[f"state.{names[i]}.{key}"], torch.as_tensor(entry[key]))
    with safe_open(tmp_path / "st" / "optimizer.safetensors", "pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
    assert groups[0]["params"] == names and groups[0]["lr"] == state["optimizer"]["param_groups"][0]["lr"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")    # one process, as meant
def test_dcp_export_loads_into_a_plain_model_and_optimizer(replica, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    job, snaps, state, _ = replica
    export_checkpoint(snapshot.latest(snaps), job, "dcp", tmp_path / "dcp")
    model, optimizer = _fresh(job)
    msd, osd = get_state_dict(model, optimizer)
    loaded = {"model": msd, "optim": osd}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())
    assert _same_optimizer(optimizer.state_dict(), state["optimizer"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dcp_export_reshards_into_fsdp2_and_trains_on_bit_identically(replica, tmp_path):
    job, snaps, state, _ = replica
    export_checkpoint(snaps, job, "dcp", tmp_path / "dcp")
    torch.save(state, tmp_path / "trainer-state.pt")     # the trainer's own state (the replay equals it)
    results = {}
    for source in ("dcp", "trainer"):
        out = tmp_path / f"after-{source}.pt"
        ctx = start_ranks(_fsdp_worker, (WORLD, job.model_dump(mode="json"), source, str(tmp_path), str(out)), WORLD)
        while not ctx.join(timeout=300):
            pass
        results[source] = torch.load(out, weights_only=True)
    a, b = results["dcp"], results["trainer"]
    assert a["loaded"] and all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    assert _same_optimizer(a["optim"], b["optim"])
    assert not all(torch.equal(a["model"][k], state["model"][k]) for k in state["model"])    # it did train


def test_refusals_name_the_problem(replica, tmp_path):
    job, snaps, _, tmp = replica
    export_checkpoint(snaps, job, "state-dict", tmp_path / "x")
    with pytest.raises(ConfigError, match="exists; give a new directory, or --force"):
        export_checkpoint(snaps, job, "state-dict", tmp_path / "x")
    export_checkpoint(snaps, job, "dcp", tmp_path / "x", force=True)
    assert (tmp_path / "x" / ".metadata").exists() and not (tmp_path / "x" / "checkpoint.pt").exists()
    with pytest.raises(ConfigError, match="--format 'onnx' is not one of"):
        export_checkpoint(snaps, job, "onnx", tmp_path / "y")
    other = make_job(3, "Simple", 2, "fp32").model_copy(update={"model": make_job(
        3, "Simple", 2, "fp32").model.model_copy(update={"kwargs": {"sizes": [8, 4]}})})
    with pytest.raises(ConfigError, match="not job .* checkpoint"):
        export_checkpoint(snaps, other, "dcp", tmp_path / "z")
    assert not (tmp_path / "z").exists() and not list(tmp_path.glob(".z.*"))


def _fresh(job):
    from gradtap.simulator.training import make_optimizer

    model = build(job.model.factory, job.model.kwargs, seed=1)
    return model, make_optimizer(list(model.parameters()), job.optimizer)


def _same_optimizer(a: dict, b: dict) -> bool:
    def groups(sd):     # betas come back as a list from some loaders and a tuple from others
        return [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in sd["param_groups"]]

    if groups(a) != groups(b) or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(torch.as_tensor(a["state"][k][t]), torch.as_tensor(b["state"][k][t]))
               for k in b["state"] for t in ("step", "exp_avg", "exp_avg_sq"))


def _fsdp_worker(rank, world, job_doc, source, tmp, out):
    """One rank of an FSDP2 job (each Linear sharded, then the root) over gloo: load the state
    (from the DCP export, resharded by DCP; or the trainer's full state), train STEPS_AFTER
    steps on rank-seeded batches, and write the full state from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from gradtap.workload.spec import parse_job

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    with gloo_group(init_method=f"file://{tmp}/rendezvous-{source}", rank=rank, world_size=world):
        job = parse_job(job_doc)
        model, optimizer = _fresh(job)
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)
        if source == "dcp":
            restore(model, optimizer, f"{tmp}/dcp")      # every rank; DCP reshards
        else:
            full = torch.load(f"{tmp}/trainer-state.pt", weights_only=True)
            names = [n for n, _ in model.named_parameters()]
            set_state_dict(model, optimizer, model_state_dict=full["model"],
                           optim_state_dict=by_name(full["optimizer"], names),
                           options=StateDictOptions(full_state_dict=True))
        loaded = True
        gen = torch.Generator().manual_seed(1000 + rank)
        width = next(p for p in model.parameters()).shape[-1]
        for _ in range(STEPS_AFTER):
            x = torch.randn(4, width, generator=gen)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            names = [n for n, _ in model.named_parameters()]
            index = {n: i for i, n in enumerate(names)}
            optim = {"state": {index[n]: v for n, v in osd["state"].items()},
                     "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in osd["param_groups"]]}
            torch.save({"model": msd, "optim": optim, "loaded": loaded}, out)
    end_spawned_rank()


def test_the_command_exports_and_says_what(replica, tmp_path):
    from gradtap.workload.spec import dump_job

    job, snaps, state, _ = replica
    (tmp_path / "job.yaml").write_text(dump_job(job))
    run = run_cli("export", str(snaps), "--job", str(tmp_path / "job.yaml"), "--format", "safetensors",
                  "--out", str(tmp_path / "o"))
    assert run.returncode == 0, run.stderr
    assert f"exported iteration {state['iteration']} of job {job.name} as safetensors" in run.stdout
    run = run_cli("export", str(snaps), "--job", str(tmp_path / "job.yaml"), "--out", str(tmp_path / "o"))
    assert run.returncode == 2 and "exists; give a new directory, or --force" in run.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_restore_reads_every_source_the_appliance_writes(replica, tmp_path):
    job, snaps, state, _ = replica
    export_checkpoint(snaps, job, "dcp", tmp_path / "dcp")
    export_checkpoint(snaps, job, "state-dict", tmp_path / "sd")
    sources = [snaps, snapshot.latest(snaps), tmp_path / "dcp", tmp_path / "sd", tmp_path / "sd" / "checkpoint.pt"]
    for source in sources:
        model, optimizer = _fresh(job)
        assert restore(model, optimizer, source) == state["iteration"], source
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items()), source
        assert _same_optimizer(optimizer.state_dict(), state["optimizer"]), source


def test_restore_refuses_what_it_cannot_trust_or_read(replica, tmp_path):
    from gradtap.core.errors import GradtapError

    job, snaps, _, _ = replica
    export_checkpoint(snaps, job, "safetensors", tmp_path / "st")
    model, optimizer = _fresh(job)
    with pytest.raises(ConfigError, match="'safetensors' export, which restore does not read"):
        restore(model, optimizer, tmp_path / "st")
    with pytest.raises(ConfigError, match="neither a snapshots directory"):
        restore(model, optimizer, tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(snapshot.latest(snaps), bad)
    data = bytearray((bad / "model.pt").read_bytes())
    data[-100] ^= 1
    (bad / "model.pt").write_bytes(bytes(data))
    with pytest.raises(GradtapError, match="sha256|does not match"):
        restore(model, optimizer, bad)
