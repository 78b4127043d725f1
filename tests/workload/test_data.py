"""Synthetic data shards: deterministic per (seed, rank, iteration), distinct otherwise."""

import pytest
import torch

from gradtap.core.errors import ConfigError
from gradtap.workload.data import ClassificationData, TokenData, batch_loss, shard_generator


def test_shards_are_deterministic_and_distinct():
    data = TokenData(vocab_size=50, seq_len=6, batch_size=3, seed=9)
    a, b = data.batch(1, 2), data.batch(1, 2)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    others = [data.batch(0, 2), data.batch(1, 3), TokenData(50, 6, 3, seed=10).batch(1, 2)]
    assert all(not torch.equal(a.inputs, o.inputs) for o in others)


def test_token_batch():
    batch = TokenData(vocab_size=50, seq_len=6, batch_size=3, seed=0).batch(0, 0)
    assert batch.inputs.shape == batch.targets.shape == (3, 6) and batch.inputs.dtype == torch.int64
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert int(batch.inputs.max()) < 50 and int(batch.inputs.min()) >= 0


def test_classification_batch_and_loss():
    batch = ClassificationData(in_features=5, num_classes=3, batch_size=4, seed=0).batch(2, 7)
    assert batch.inputs.shape == (4, 5) and batch.inputs.dtype == torch.float32
    assert batch.targets.shape == (4,) and set(batch.targets.tolist()) <= {0, 1, 2}
    model = torch.nn.Linear(5, 3)
    want = torch.nn.functional.cross_entropy(model(batch.inputs), batch.targets)
    assert torch.equal(batch_loss(model, batch), want)


def test_shard_generator_does_not_touch_the_global_rng():
    before = torch.get_rng_state()
    torch.rand(3, generator=shard_generator(1, 2, 3))
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(ConfigError, match="rank"):
        shard_generator(0, -1, 0)
