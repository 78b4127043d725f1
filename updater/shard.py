"""One node's shard of the replica, in a mirror group whose nodes each step their own buckets.

A :class:`ShardReplica` is a :class:`~gradtap.updater.replica.Replica` that takes and steps
only the buckets ``workload/shards.py`` gives its node, with the same kernels, so each
element of its shard is what the whole replica computes, bit for bit.

**Clipping.** ``clip_grad_norm_`` multiplies every gradient by a coefficient of the norm of
the *whole* gradient: on the CPU, ``torch.linalg.vector_norm(torch.stack(norms))`` of the
per-parameter norms in parameter order, each from ``torch._foreach_norm``
(``updater/clipping.py``). A norm depends only on its own parameter's gradient, so each node
takes those of its own parameters on arrival as the whole replica does; at the end of the
iteration the nodes all-gather them (:meth:`ShardReplica.shard_norms`, the float32 bits as
they are) and each puts the others' into its list (:meth:`ShardReplica.add_norms`): every
node then stacks the very tensors, in the very order, the single replica stacks, and the
same torch call gives the same total and coefficient (``tests/updater/test_shard.py``
checks them against ``clip_grad_norm_`` itself).

Memory: the shard keeps the whole flat state (as loaded from the trainer's checkpoint) and
updates its slice; the other slices stay as loaded and are never written out
(:meth:`ShardReplica.shard_state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from gradtap.core.errors import GradtapError
from gradtap.updater.clipping import GradNorms
from gradtap.updater.replica import Replica
from gradtap.workload.buckets import Bucket
from gradtap.workload.shards import Shards
from gradtap.workload.spec import JobSpec

_COUNT = np.dtype("<i8")
_INDEX = np.dtype("<i8")
_NORM = np.dtype("<f4")


class ShardNorms(GradNorms):
    """A clipped iteration's per-parameter norms, some taken here and the rest put in from
    the group's other shards."""

    def own(self) -> dict[int, torch.Tensor]:
        return {i: n for i, n in enumerate(self._norms) if n is not None}

    def put(self, norms: Mapping[int, torch.Tensor]) -> None:
        for i, norm in norms.items():
            if not 0 <= i < len(self._norms):
                raise GradtapError(f"ShardNorms.put: parameter {i} is not one of the {len(self._norms)}")
            if self._norms[i] is not None:
                raise GradtapError(f"ShardNorms.put: parameter {i} already has a norm this iteration")
            self._norms[i] = norm


def encode_norms(norms: Mapping[int, torch.Tensor]) -> bytes:
    """Parameter indices and their float32 norms, the bits as they are."""
    index = np.fromiter(norms, _INDEX, len(norms))
    values = np.array([n.numpy() for n in norms.values()], _NORM)
    return np.array([len(norms)], _COUNT).tobytes() + index.tobytes() + values.tobytes()


def decode_norms(message: bytes, source: str) -> dict[int, torch.Tensor]:
    """What :func:`encode_norms` wrote; ``GradtapError`` naming ``source`` when malformed."""
    if len(message) < _COUNT.itemsize:
        raise GradtapError(f"{source}: a norms message of {len(message)} bytes")
    (n,) = np.frombuffer(message, _COUNT, 1)
    if n < 0 or len(message) != _COUNT.itemsize + int(n) * (_INDEX.itemsize + _NORM.itemsize):
        raise GradtapError(f"{source}: a norms message of {len(message)} bytes for {n} norms")
    index = np.frombuffer(message, _INDEX, int(n), _COUNT.itemsize)
    values = torch.from_numpy(np.frombuffer(message, _NORM, int(n), _COUNT.itemsize + int(n) * _INDEX.itemsize)
                              .astype(np.float32))
    return {int(i): values[k] for k, i in enumerate(index)}


class ShardReplica(Replica):
    """The shard of ``job``'s replica that node ``rank`` of a group sharded as ``shards`` steps."""

    def __init__(self, job: JobSpec, checkpoint: Mapping[str, Any], shards: Shards, rank: int, *,
                 buckets: tuple[Bucket, ...] | None = None):
        super().__init__(job, checkpoint, buckets=buckets)
        if len(shards.owner) != len(self.layout.buckets) or not 0 <= rank < shards.world:
            raise GradtapError(f"ShardReplica: shards of {len(shards.owner)} buckets over {shards.world} nodes, "
                               f"rank {rank}; the job has {len(self.layout.buckets)} buckets")
        self.shards, self.rank = shards, rank
        self._own = shards.buckets_of(rank)

    def stepped_buckets(self) -> list[int]:
        return list(self._own)

    def _new_norms(self) -> GradNorms:
        return ShardNorms(len(self.layout.params))

    def apply_bucket(self, bucket: int, grad: np.ndarray) -> None:
        if bucket not in self._own:
            raise GradtapError(f"apply_bucket: bucket {bucket} belongs to node rank {self.shards.owner[bucket]}'s "
                               f"shard, not this node's (rank {self.rank})"
                               if 0 <= bucket < len(self.shards.owner) else
                               f"apply_bucket: bucket {bucket} is not one of the job's {len(self.shards.owner)}")
        super().apply_bucket(bucket, grad)

    def shard_norms(self) -> bytes:
        """The open clipped iteration's norms of this shard's parameters, to all-gather."""
        it = self._require_open()
        return encode_norms(it.norms.own() if it.norms is not None else {})

    def add_norms(self, messages: Mapping[int, bytes]) -> None:
        """The other shards' :meth:`shard_norms`, by rank."""
        it = self._require_open()
        if it.norms is None:
            return
        for rank, message in messages.items():
            it.norms.put(decode_norms(message, f"node rank {rank}'s gradient norms"))

    @property
    def shard(self) -> slice:
        """This shard's elements of the flat state (empty when it owns no bucket)."""
        if not self._own:
            return slice(0, 0)
        return slice(self.layout.bucket(self._own[0]).start, self.layout.bucket(self._own[-1]).stop)

    def shard_state(self) -> dict[str, np.ndarray]:
        """The shard's flat ``param``, ``exp_avg`` and ``exp_avg_sq`` (copies), with its bucket
        indices and element range, between iterations."""
        if self.open_iteration is not None:
            raise GradtapError(f"shard_state(): iteration {self.open_iteration} is half applied")
        sl = self.shard
        return {"param": self.state.param[sl].copy(), "exp_avg": self.state.exp_avg[sl].copy(),
                "exp_avg_sq": self.state.exp_avg_sq[sl].copy(), "buckets": np.asarray(self._own, np.int64),
                "elements": np.asarray([sl.start, sl.stop], np.int64)}
