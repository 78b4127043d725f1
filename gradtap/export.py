"""A replica's checkpoint in the formats trainers load: ``gradtap export``.

The source is a snapshot directory (checked against its manifest's sha256s) or a trainer
checkpoint file, read by :func:`gradtap.checkpoints.load_checkpoint`. Formats:

- ``dcp``: PyTorch Distributed Checkpoint, written by ``torch.distributed.checkpoint.save``
  itself, as ``{"model": model state_dict, "optim": optimizer state_dict}`` with the
  optimizer keyed by parameter name (the form of ``torch.distributed.checkpoint.state_dict.
  get_state_dict``). A trainer loads it into any world size and sharding with DCP's own calls::

      model_sd, optim_sd = get_state_dict(model, optimizer)      # FSDP2, DDP, one process ...
      state = {"model": model_sd, "optim": optim_sd}
      torch.distributed.checkpoint.load(state, checkpoint_id=out)
      set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

- ``state-dict``: ``checkpoint.pt``, one ``torch.save`` of ``{"model", "optimizer",
  "iteration"}``, the trainer checkpoint ``gradtap run --start`` and a resync take;
- ``safetensors``: ``model.safetensors`` (the parameters by name) and
  ``optimizer.safetensors`` (``state.<name>.exp_avg``, ``state.<name>.exp_avg_sq``,
  ``state.<name>.step``), with the optimizer's param groups as JSON in the file's metadata.

Every format is written into a temporary directory beside ``out`` and renamed into place
when complete, with ``gradtap-export.json`` (job, iteration, format, source) inside it: an
interrupted export leaves nothing that looks finished. ``out`` must not exist unless
``force``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gradtap.checkpoints import load_checkpoint
from gradtap.core.errors import ConfigError
from gradtap.out_dir import published, refuse_existing
from gradtap.trainer.restore import EXPORT_INFO
from gradtap.store.snapshot import named_latest
from gradtap.workload.layout import job_params
from gradtap.workload.spec import JobSpec

FORMATS = ("dcp", "state-dict", "safetensors")


def export_checkpoint(source: Path, job: JobSpec, fmt: str, out: Path, *, force: bool = False) -> dict:
    """Write the checkpoint at ``source`` (a snapshot, a snapshot directory's newest through
    its ``LATEST``, or a trainer checkpoint file) to ``out`` in ``fmt``; returns what
    ``gradtap-export.json`` (:data:`~gradtap.trainer.restore.EXPORT_INFO`) says."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    refuse_existing(out, force=force)
    source = Path(source)
    if (source / "LATEST").is_file():
        source = named_latest(source)          # load_checkpoint checks its sha256s as it reads
    checkpoint = load_checkpoint(source, what="snapshot")
    names = [p.name for p in job_params(job)]
    _check_names(checkpoint, names, source, job)
    info = {"format": fmt, "job": job.name, "iteration": checkpoint["iteration"], "source": str(source)}
    with published(Path(out), force=force) as tmp:
        WRITERS[fmt](checkpoint, names, tmp)
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _check_names(checkpoint: dict, names: list[str], source: Path, job: JobSpec) -> None:
    """The checkpoint holds this job's parameters, one optimizer entry per parameter."""
    model = checkpoint["model"]
    missing = [n for n in names if n not in model]
    if missing:
        raise ConfigError(f"{source}: not job {job.name!r}'s checkpoint: its model has no {missing[0]!r} "
                          f"({len(missing)} of the job's {len(names)} parameters missing)")
    ids = [i for g in checkpoint["optimizer"]["param_groups"] for i in g["params"]]
    if sorted(ids) != list(range(len(names))):
        raise ConfigError(f"{source}: not job {job.name!r}'s checkpoint: its optimizer has {len(ids)} parameters "
                          f"in its param groups, the job {len(names)}")


def by_name(optimizer: dict, names: list[str]) -> dict:
    """An optimizer state_dict keyed by parameter name (the job's parameter order is the
    optimizer's), as ``get_state_dict`` gives it and ``set_state_dict`` takes it."""
    return {"state": {names[i]: dict(entry) for i, entry in optimizer["state"].items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer["param_groups"]]}


def _dcp(checkpoint: dict, names: list[str], out: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": dict(checkpoint["model"]), "optim": by_name(checkpoint["optimizer"], names)}
    with warnings.catch_warnings():
        # Without a process group DCP writes from this one process, which is what is meant.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(out), no_dist=True)


def _state_dict(checkpoint: dict, names: list[str], out: Path) -> None:
    torch.save({"model": checkpoint["model"], "optimizer": checkpoint["optimizer"],
                "iteration": checkpoint["iteration"]}, out / "checkpoint.pt")


def _safetensors(checkpoint: dict, names: list[str], out: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in checkpoint["model"].items()}, str(out / "model.safetensors"))
    named = by_name(checkpoint["optimizer"], names)
    tensors = {}
    for name, entry in named["state"].items():
        for key, value in entry.items():
            tensors[f"state.{name}.{key}"] = torch.as_tensor(value).contiguous()
    groups = json.dumps(named["param_groups"], default=lambda v: v.tolist() if isinstance(v, torch.Tensor) else str(v))
    save_file(tensors, str(out / "optimizer.safetensors"), metadata={"param_groups": groups})


WRITERS = {"dcp": _dcp, "state-dict": _state_dict, "safetensors": _safetensors}
