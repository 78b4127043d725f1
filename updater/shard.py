"""One node's shard of the replica, in a mirror group whose nodes each step their own buckets.

A :class:`ShardReplica` is a :class:`~gradtap.updater.replica.Replica` that takes and steps
only the buckets ``workload/shards.py`` gives its node, with the same kernels, so each
element of its shard is what the whole replica computes, bit for bit.

**Clipping.** ``clip_grad_norm_`` multiplies every gradient by a coefficient of the norm of
the *whole* gradient: on the CPU, ``torch.linalg.vector_norm(torch.stack(norms))`` of the
per-parameter norms in parameter order, each as ``torch._foreach_norm`` takes it
(``updater/clipping.py``, ``updater/norms.py``). A norm depends only on its own parameter's
gradient, so each node takes those of its own parameters on arrival as the whole replica
does; at the end of the iteration the nodes all-gather them (:meth:`ShardReplica.shard_norms`,
the float32 bits as they are) and each puts the others' into its list
(:meth:`ShardReplica.add_norms`): every node then stacks the very values, in the very order,
the single replica stacks, and the same torch call gives the same total and coefficient
(``tests/updater/test_shard.py`` checks them against ``clip_grad_norm_`` itself).

**Memory.** A shard holds only its slice: parameters, both moments and the widened gradient
of its own buckets (:class:`ShardLayout`: its parameters, renumbered, laid out as in the
whole flat state, so its arrays are exactly the elements :attr:`ShardReplica.shard` of the
whole one). It loads them from the trainer's full checkpoint tensor by tensor, touching no
other parameter's tensors (with ``torch.load(..., mmap=True)`` the others are never read
from disk), through the same checks as the whole replica (``updater/state.py``'s
``from_checkpoint`` over the shard's part of the checkpoint). Offers and resyncs load the
slice the same way. A shard has no whole ``state_dict``: its file is
:meth:`ShardReplica.shard_state`, the group's checkpoint ``store/shard_snapshot.assemble``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.updater.clipping import GradNorms
from gradtap.updater.replica import Replica
from gradtap.updater.state import FlatLayout, from_checkpoint
from gradtap.workload.buckets import Bucket
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.shards import Shards
from gradtap.workload.spec import JobSpec

_COUNT = np.dtype("<i8")
_INDEX = np.dtype("<i8")
_NORM = np.dtype("<f4")


class ShardNorms(GradNorms):
    """A clipped iteration's per-parameter norms, some taken here and the rest put in from
    the group's other shards. ``local``: the job's index of each of the shard's parameters,
    when :meth:`add` is given the shard's own numbering (default: the job's)."""

    def __init__(self, n_params: int, local: Sequence[int] | None = None):
        super().__init__(n_params)
        self._local = None if local is None else list(local)

    def add(self, param_indices: Sequence[int], grad: np.ndarray, spans: np.ndarray) -> None:
        if self._local is not None:
            param_indices = [self._local[i] for i in param_indices]
        super().add(param_indices, grad, spans)

    def own(self) -> dict[int, np.float32]:
        return {i: self._values[i] for i in np.flatnonzero(self._have).tolist()}

    def put(self, norms: Mapping[int, np.float32]) -> None:
        self._put(list(norms), list(norms.values()))


def encode_norms(norms: Mapping[int, np.float32]) -> bytes:
    """Parameter indices and their float32 norms, the bits as they are."""
    index = np.fromiter(norms, _INDEX, len(norms))
    values = np.array(list(norms.values()), _NORM)
    return np.array([len(norms)], _COUNT).tobytes() + index.tobytes() + values.tobytes()


def decode_norms(message: bytes, source: str) -> dict[int, np.float32]:
    """What :func:`encode_norms` wrote; ``GradtapError`` naming ``source`` when malformed."""
    if len(message) < _COUNT.itemsize:
        raise GradtapError(f"{source}: a norms message of {len(message)} bytes")
    (n,) = np.frombuffer(message, _COUNT, 1)
    if n < 0 or len(message) != _COUNT.itemsize + int(n) * (_INDEX.itemsize + _NORM.itemsize):
        raise GradtapError(f"{source}: a norms message of {len(message)} bytes for {n} norms")
    index = np.frombuffer(message, _INDEX, int(n), _COUNT.itemsize)
    values = np.frombuffer(message, _NORM, int(n), _COUNT.itemsize + int(n) * _INDEX.itemsize).astype(np.float32)
    return {int(i): values[k] for k, i in enumerate(index)}


class ShardLayout(FlatLayout):
    """The flat layout of one shard: its buckets ``own`` (contiguous, in launch order) of the
    job's ``buckets``, their parameters renumbered ``0..m-1`` in the job's order
    (:attr:`local` gives each one's index in the job). Buckets keep the job's indices
    (``bucket(b)``, ``buckets[b]``, ``work(b, ...)``: b a bucket of the shard), with their
    parameters in the shard's numbering; offsets are in the shard's arrays."""

    def __init__(self, params, buckets: Sequence[Bucket], own: Sequence[int]):
        own = list(own)
        if own and own != list(range(own[0], own[0] + len(own))):
            raise GradtapError(f"ShardLayout: buckets {own} are not a contiguous range")
        self.local = sorted(i for b in own for i in buckets[b].params)
        number = {g: k for k, g in enumerate(self.local)}
        mine = [dataclasses.replace(buckets[b], params=tuple(number[i] for i in buckets[b].params)) for b in own]
        super().__init__([params[i] for i in self.local], mine)
        self.first = own[0] if own else 0
        self._inner = FlatLayout(self.params, mine)        # the shard's own buckets, numbered from 0
        self.buckets = tuple(mine[b - self.first] if b in own else buckets[b] for b in range(len(buckets)))

    def bucket(self, b: int) -> slice:
        return self._inner.bucket(b - self.first)

    def work(self, b: int, implementation: str) -> np.ndarray:
        return self._inner.work(b - self.first, implementation)


class ShardReplica(Replica):
    """The shard of ``job``'s replica that node ``rank`` of a group sharded as ``shards`` steps,
    its slice loaded from the trainer's full ``checkpoint`` (see the module docstring)."""

    def __init__(self, job: JobSpec, checkpoint: Mapping[str, Any], shards: Shards, rank: int, *,
                 buckets: tuple[Bucket, ...] | None = None):
        # Not Replica.__init__, which would load the whole state: its fields, with the slice.
        buckets = job_buckets(job) if buckets is None else buckets
        if len(shards.owner) != len(buckets) or not 0 <= rank < shards.world:
            raise GradtapError(f"ShardReplica: shards of {len(shards.owner)} buckets over {shards.world} nodes, "
                               f"rank {rank}; the job has {len(buckets)} buckets")
        self.shards, self.rank = shards, rank
        self._own = shards.buckets_of(rank)
        self.whole = FlatLayout(job_params(job), buckets)      # where the shard sits in the whole state
        self._attach(job, ShardLayout(self.whole.params, buckets, self._own))
        self.state, self._keys = self._load(checkpoint)

    def _load(self, checkpoint: Mapping[str, Any], layout: FlatLayout | None = None, consume: bool = False):
        """The shard's flat state from the trainer's full ``checkpoint``: ``from_checkpoint``
        over the shard's parameters (their tensors only), and the step of the whole. The
        checkpoint is never consumed: the shard takes a part of it, and the whole keeps every
        tensor."""
        state, keys = from_checkpoint(self._part(checkpoint), layout or self.layout, self.cfg)
        whole = checkpoint["optimizer"].get("state", {})
        if not self.layout.local and whole:       # no parameter of its own: the step is the whole's
            state.step = int(float(whole[0]["step"]))
        return state, keys

    def _part(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """The shard's part of a trainer checkpoint, its parameters renumbered as the shard's;
        ``ConfigError`` for a checkpoint that is not the job's as a whole."""
        for key in ("model", "optimizer"):
            if key not in checkpoint:
                raise ConfigError(f"checkpoint has no {key!r} entry; expected the dict "
                                  "{'model': state_dict, 'optimizer': state_dict, 'iteration': k}")
        n, local = len(self.whole.params), self.layout.local
        groups = checkpoint["optimizer"].get("param_groups", [])
        if len(groups) != 1 or list(groups[0].get("params", [])) != list(range(n)):
            raise ConfigError(f"checkpoint optimizer: expected one param group over parameters 0..{n - 1} (the "
                              "model's parameters in order)")
        state = checkpoint["optimizer"].get("state", {})
        lacking = [i for i in range(n) if i not in state] if state else []
        if lacking:
            raise ConfigError(f"checkpoint optimizer: parameter {lacking[0]} ({self.whole.params[lacking[0]].name!r}) "
                              "has no state while others do")
        names = {self.whole.params[i].name for i in local}
        part: dict[str, Any] = {
            "model": {k: v for k, v in checkpoint["model"].items() if k in names},
            "optimizer": {"state": {k: state[i] for k, i in enumerate(local)} if state else {},
                          "param_groups": [{**groups[0], "params": list(range(len(local)))}]}}
        if state and not local:       # no parameter of its own: the step is the whole's
            part["iteration"] = checkpoint.get("iteration", int(float(state[0]["step"])))
        elif "iteration" in checkpoint:
            part["iteration"] = checkpoint["iteration"]
        return part

    def relayout(self, buckets: tuple[Bucket, ...]) -> None:
        raise GradtapError("relayout(): a shard of a mirror group keeps the bucket layout it was sharded by; "
                           "a group needs the job's final layout from the start (ddp.layout: rebuilt or explicit)")

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        raise GradtapError(f"state_dict(): node rank {self.rank} holds only elements {self.shard.start}.."
                           f"{self.shard.stop} of the replica; take shard_state(), or join the group's snapshot "
                           "(store/shard_snapshot.assemble)")

    def stepped_buckets(self) -> list[int]:
        return list(self._own)

    def _new_norms(self) -> GradNorms:
        return ShardNorms(len(self.whole.params), self.layout.local)

    def apply_bucket(self, bucket: int, grad: np.ndarray, *, lasting: bool = False) -> None:
        if bucket not in self._own:
            raise GradtapError(f"apply_bucket: bucket {bucket} belongs to node rank {self.shards.owner[bucket]}'s "
                               f"shard, not this node's (rank {self.rank})"
                               if 0 <= bucket < len(self.shards.owner) else
                               f"apply_bucket: bucket {bucket} is not one of the job's {len(self.shards.owner)}")
        super().apply_bucket(bucket, grad, lasting=lasting)

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
        """This shard's elements of the whole flat state (empty when it owns no bucket)."""
        if not self._own:
            return slice(0, 0)
        return slice(self.whole.bucket(self._own[0]).start, self.whole.bucket(self._own[-1]).stop)

    def shard_state(self) -> dict[str, np.ndarray]:
        """The shard's flat ``param``, ``exp_avg`` and ``exp_avg_sq`` (copies), with its bucket
        indices and element range, between iterations."""
        if self.open_iteration is not None:
            raise GradtapError(f"shard_state(): iteration {self.open_iteration} is half applied")
        sl = self.shard
        return {"param": self.state.param.copy(), "exp_avg": self.state.exp_avg.copy(),
                "exp_avg_sq": self.state.exp_avg_sq.copy(), "buckets": np.asarray(self._own, np.int64),
                "elements": np.asarray([sl.start, sl.stop], np.int64)}
