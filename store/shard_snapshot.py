"""Snapshots of a sharded replica: one file per shard, one group manifest committed last.

Each node of a mirror group (``merger/group.py``) writes its shard into its snapshot
directory, and, once every node's shard is on disk, the group's manifest beside it::

    iteration-000120/
        shard-0001-of-0003.pt     torch.save({"param", "exp_avg", "exp_avg_sq": float32 tensors of the
                                  shard's element range, "buckets", "elements", "step", "iteration", "lr"})
        group.json                the group manifest: job, iteration, step, world size, and per shard
                                  its rank, file, sha256, bytes, buckets and element range

A shard file is written to a temporary name, fsynced and renamed, then its directory is
fsynced; the nodes all-gather the shards' entries (name, sha256, size) and each writes the
same ``group.json`` the same way, last. A group snapshot is complete when ``group.json``
exists and every shard it lists matches its sha256 (:func:`verify_group`), wherever the
shards are: one directory shared by the nodes, or each node's own (pass them all).
:func:`assemble` joins the shards into the trainer's ``{"model", "optimizer", "iteration"}``
checkpoint, loadable with ``load_state_dict``.

Retention keeps the ``keep`` newest iterations of this node's directory.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradtap.core.errors import GradtapError
from gradtap.store.snapshot import file_sha256, fsync_dir

MANIFEST = "group.json"


def _commit(tmp: Path, final: Path) -> None:
    """``tmp`` (written) fsynced and renamed to ``final``, then the directory fsynced."""
    with tmp.open("rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:04d}-of-{world:04d}.pt"


class ShardSnapshots:
    """Node ``rank`` of ``world``'s snapshots of ``job``'s replica shard in ``directory``,
    every ``every`` iterations, the ``keep`` newest kept."""

    def __init__(self, directory: str | Path, job: str, rank: int, world: int, *, every: int = 1, keep: int = 3):
        self.directory, self.job, self.rank, self.world = Path(directory), job, rank, world
        self.every, self.keep = every, keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def due(self, iteration: int) -> bool:
        return iteration % self.every == 0

    def write_shard(self, state: Mapping[str, np.ndarray], *, iteration: int, step: int, lr: float) -> dict:
        """Write this node's shard (``ShardReplica.shard_state()``) of the state ready for
        ``iteration``; returns its manifest entry."""
        folder = self.directory / f"iteration-{iteration:06d}"
        folder.mkdir(exist_ok=True)
        name = shard_name(self.rank, self.world)
        tmp = folder / f".{name}.tmp"
        torch.save({**{k: torch.from_numpy(np.ascontiguousarray(state[k]))
                       for k in ("param", "exp_avg", "exp_avg_sq")},
                    "buckets": [int(b) for b in state["buckets"]], "elements": [int(e) for e in state["elements"]],
                    "step": step, "iteration": iteration, "lr": lr}, tmp)
        _commit(tmp, folder / name)
        return {"rank": self.rank, "file": name, "sha256": file_sha256(folder / name),
                "bytes": (folder / name).stat().st_size, "buckets": [int(b) for b in state["buckets"]],
                "elements": [int(e) for e in state["elements"]]}

    def commit(self, iteration: int, step: int, entries: Sequence[dict]) -> Path:
        """Write the group manifest of ``iteration`` (every shard's entry), last; then retention."""
        folder = self.directory / f"iteration-{iteration:06d}"
        ranks = sorted(e["rank"] for e in entries)
        if ranks != list(range(self.world)):
            raise GradtapError(f"group snapshot of iteration {iteration}: shards of ranks {ranks}; the group has "
                               f"{self.world} nodes")
        tmp = folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"job": self.job, "iteration": iteration, "step": step, "world_size": self.world,
                                   "shards": sorted(entries, key=lambda e: e["rank"])}, indent=1))
        _commit(tmp, folder / MANIFEST)
        for old in sorted(self.directory.glob("iteration-*"))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return folder


def verify_group(folders: Sequence[str | Path]) -> dict[str, Any]:
    """The group manifest of one iteration's snapshot, once every shard it lists is found in
    one of ``folders`` (the nodes' ``iteration-N`` directories) with its sha256; ``GradtapError``
    saying what is missing or wrong otherwise. Returns the manifest with each shard's path."""
    folders = [Path(f) for f in folders]
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if not manifests:
        raise GradtapError(f"no {MANIFEST} in {', '.join(map(str, folders))}: the group snapshot was never "
                           "committed (a node's shard is missing)")
    manifest = json.loads(manifests[0].read_text())
    for entry in manifest["shards"]:
        found = [f / entry["file"] for f in folders if (f / entry["file"]).is_file()]
        if not found:
            raise GradtapError(f"group snapshot of iteration {manifest['iteration']}: shard {entry['file']} "
                               f"(rank {entry['rank']}) is in none of {', '.join(map(str, folders))}")
        if file_sha256(found[0]) != entry["sha256"]:
            raise GradtapError(f"{found[0]}: sha256 differs from {MANIFEST}'s; the shard is damaged")
        entry["path"] = str(found[0])
    return manifest


def assemble(replica, folders: Sequence[str | Path]) -> dict[str, Any]:
    """The trainer checkpoint ``{"model", "optimizer", "iteration"}`` of a group snapshot: its
    shards placed into ``replica`` (a :class:`~gradtap.updater.replica.Replica` of the job,
    whose state they replace), then ``replica.state_dict()``."""
    manifest = verify_group(folders)
    covered = 0
    for entry in manifest["shards"]:
        shard = torch.load(entry["path"], weights_only=True)
        lo, hi = shard["elements"]
        for name in ("param", "exp_avg", "exp_avg_sq"):
            getattr(replica.state, name)[lo:hi] = shard[name].numpy()
        covered += hi - lo
        replica.state.step, replica.state.iteration, replica.state.lr = shard["step"], shard["iteration"], shard["lr"]
    if covered != replica.layout.total:
        raise GradtapError(f"group snapshot of iteration {manifest['iteration']}: its shards hold {covered} of the "
                           f"replica's {replica.layout.total} elements")
    return replica.state_dict()
