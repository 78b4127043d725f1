"""Synthetic, deterministic training data: one shard per (seed, rank, iteration).

Every batch is drawn from its own ``torch.Generator``, seeded from the triple
``(seed, rank, iteration)`` through ``numpy.random.SeedSequence``, so a batch can be
regenerated anywhere (in the in-process simulator, in a real multi-process DDP run, in a
test) without replaying the batches before it, and different ranks or iterations never
share a stream. The data carries no signal worth learning; it exists to make real,
rank-dependent gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gradtap.core.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    """One rank's micro-batch: model ``inputs`` and class-index ``targets``.

    The model maps ``inputs`` to logits of shape ``targets.shape + (num_classes,)``.
    """

    inputs: torch.Tensor
    targets: torch.Tensor

    def to(self, device: str | torch.device) -> Batch:
        return Batch(self.inputs.to(device), self.targets.to(device))


def shard_generator(seed: int, rank: int, iteration: int) -> torch.Generator:
    """A CPU generator private to one (seed, rank, iteration) shard."""
    for name, value in (("seed", seed), ("rank", rank), ("iteration", iteration)):
        if value < 0:
            raise ConfigError(f"{name}: {value} is negative; data shards are numbered from 0")
    state = np.random.SeedSequence([seed, rank, iteration]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass(frozen=True)
class ClassificationData:
    """Gaussian feature vectors ``[batch_size, in_features]`` (float32) with uniformly
    random labels ``[batch_size]`` (int64) in ``0..num_classes-1``."""

    in_features: int
    num_classes: int
    batch_size: int
    seed: int

    def batch(self, rank: int, iteration: int) -> Batch:
        g = shard_generator(self.seed, rank, iteration)
        inputs = torch.randn(self.batch_size, self.in_features, generator=g)
        targets = torch.randint(0, self.num_classes, (self.batch_size,), generator=g)
        return Batch(inputs, targets)


@dataclass(frozen=True)
class TokenData:
    """Uniformly random token ids for next-token prediction: ``inputs`` and ``targets``
    are ``[batch_size, seq_len]`` int64, ``targets`` being ``inputs`` shifted by one."""

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int

    def batch(self, rank: int, iteration: int) -> Batch:
        g = shard_generator(self.seed, rank, iteration)
        tokens = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1),
                               generator=g)
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def batch_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of ``model(batch.inputs)`` against ``batch.targets`` (a scalar)."""
    logits = model(batch.inputs)
    return F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten())
