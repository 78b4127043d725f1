"""Restore: a training script resumes from the newest good replica.

    iteration = restore(model, optimizer, source)   # then train from ``iteration`` on

``source`` is any of what the appliance writes:

- a snapshots directory (its ``LATEST``) or one snapshot (``iteration-NNNNNN/``): both files
  are checked against the manifest's sha256s before anything is loaded;
- a ``gradtap export`` directory (``gradtap-export.json`` inside): ``dcp`` is loaded with
  PyTorch Distributed Checkpoint into whatever ``model`` and ``optimizer`` are (one process,
  DDP, FSDP2 ``fully_shard``: every rank calls ``restore``, and DCP reshards), ``state-dict``
  with ``torch.load``;
- a trainer checkpoint file ``{"model", "optimizer", "iteration"}``;
- a store URL (``s3://BUCKET/PREFIX``, ``file:///DIR``: the appliance's durable tier,
  ``store/object_store.py``): its newest READY snapshot whose objects match their sha256s (an
  S3-compatible server is named with ``storage_options={"client_kwargs": {"endpoint_url": …}}``
  or the ``AWS_ENDPOINT_URL`` environment variable).

``model`` and ``optimizer`` are changed in place; the iteration returned is the one whose
forward pass comes next (the snapshot convention). A safetensors export is for other tools,
not for ``restore``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from gradtap.core.errors import ConfigError
from gradtap.store import snapshot

EXPORT_INFO = "gradtap-export.json"     # what ``gradtap export`` writes beside the checkpoint
STORE_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, source: str | Path, *,
            storage_options: dict | None = None) -> int:
    """Load the checkpoint at ``source`` into ``model`` and ``optimizer``; the iteration to
    continue at. ``storage_options``: fsspec's, for a store URL."""
    if isinstance(source, str) and STORE_URL.match(source):
        from gradtap.store.object_store import load_url

        return _load(model, optimizer, load_url(source, storage_options=storage_options), Path(source))
    source = Path(source)
    info = source / EXPORT_INFO
    if info.is_file():
        export = json.loads(info.read_text())
        if export.get("format") == "dcp":
            _load_dcp(model, optimizer, source)
            return int(export["iteration"])
        if export.get("format") == "state-dict":
            return _load(model, optimizer, torch.load(source / "checkpoint.pt", weights_only=True), source)
        raise ConfigError(f"{source}: a {export.get('format')!r} export, which restore does not read; export the "
                          "snapshot as dcp or state-dict (gradtap export --format)")
    if (source / "LATEST").is_file():
        return _load(model, optimizer, snapshot.load(snapshot.named_latest(source)), source)
    if (source / "manifest.json").is_file():
        return _load(model, optimizer, snapshot.load(source), source)
    if source.is_file():
        return _load(model, optimizer, torch.load(source, weights_only=True), source)
    raise ConfigError(f"{source}: neither a snapshots directory, a snapshot, a gradtap export nor a checkpoint "
                      "file; give the appliance's snapshot directory (OUT/snapshots) or an export")


def _load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict, source: Path) -> int:
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "iteration"} <= set(checkpoint):
        raise ConfigError(f"{source}: not a checkpoint of model, optimizer and iteration")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["iteration"])


def _load_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, source: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(source), no_dist=not (dist.is_available() and dist.is_initialized()))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
