"""Group snapshots: shards with a manifest committed last, verified by sha256, joined into the
trainer's checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradtap.core.errors import GradtapError
from gradtap.store.shard_snapshot import MANIFEST, ShardSnapshots, assemble, verify_group
from gradtap.updater.replica import Replica
from gradtap.updater.shard import ShardReplica
from gradtap.workload.layout import job_buckets
from gradtap.workload.shards import Shards
from tests.updater.naive_adam import random_reduced
from tests.updater.test_replica import job


def stepped(world: int):
    """The whole replica and its ``world`` shards after one step of the same gradient."""
    j = job(kind="adamw", weight_decay=0.01)
    whole = Replica.from_job(j)
    shards = Shards.balanced([b.numel for b in job_buckets(j)], world)
    parts = [ShardReplica(j, whole.state_dict(), shards, r) for r in range(world)]
    reduced = random_reduced(j, np.random.default_rng(1))
    whole.apply(0, np.concatenate(reduced))
    for p in parts:
        p.begin(0)
        for b in p.stepped_buckets():
            p.apply_bucket(b, reduced[b])
        p.end()
    return j, whole, parts


def write(tmp_path, parts, directories):
    writers = [ShardSnapshots(d, "t", p.rank, len(parts)) for p, d in zip(parts, directories)]
    entries = [w.write_shard(p.shard_state(), iteration=1, step=p.step, lr=p.state.lr) for w, p in zip(writers, parts)]
    assert not any((d / "iteration-000001" / MANIFEST).exists() for d in directories)
    return [w.commit(1, parts[0].step, entries) for w in writers]


def test_shards_in_one_directory_join_into_the_whole_replica(tmp_path):
    j, whole, parts = stepped(3)
    (folder, *_) = write(tmp_path, parts, [tmp_path] * 3)
    checkpoint = assemble(Replica.from_job(j), [folder])
    want = whole.state_dict()
    for key, tensor in want["model"].items():
        assert torch.equal(checkpoint["model"][key], tensor), key
    assert checkpoint["iteration"] == 1 and checkpoint["optimizer"]["state"][0]["step"] == 1


def test_a_damaged_or_missing_shard_is_refused(tmp_path):
    _, _, parts = stepped(2)
    folders = write(tmp_path, parts, [tmp_path / "a", tmp_path / "b"])
    assert len(verify_group(folders)["shards"]) == 2
    with pytest.raises(GradtapError, match="is in none of"):
        verify_group(folders[:1])
    shard = folders[1] / "shard-0001-of-0002.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(GradtapError, match="sha256 differs"):
        verify_group(folders)
    with pytest.raises(GradtapError, match="never committed"):
        verify_group([tmp_path / "nowhere"])
    with pytest.raises(GradtapError, match="shards of ranks"):
        ShardSnapshots(tmp_path / "c", "t", 0, 2).commit(1, 1, [{"rank": 0}])
