"""The replica: the job's parameters and Adam state, stepped bucket by bucket as gradients arrive.

One iteration, as the pipeline drives it::

    replica.begin(iteration)                  # the next iteration, in order
    replica.apply_bucket(b, grad_wire)        # every bucket once, in any order
    replica.end()                             # the step is complete; iteration += 1

Without clipping each bucket is stepped as soon as it arrives, so the update overlaps
capture. With ``optimizer.clip_grad_norm`` the coefficient depends on the norm of the
*whole* gradient, so a bucket is only widened to float32 and its norms taken on arrival;
every bucket is stepped in :meth:`Replica.end`, once the last one is in
(``updater/clipping.py``). Either way a bucket is applied whole or not at all: the caller
hands over complete buckets, and sizes are checked.

An iteration that cannot be completed (the merger found a hole) is :meth:`abort`-ed.
Buckets already stepped cannot be taken back, and the replica is one step behind the
trainer in any case, so it becomes *stale*: it opens no further iteration until
:meth:`resync` loads a checkpoint the trainer provides. A ``begin`` past the next iteration
(iterations were missed) makes it stale as well. A trainer checkpoint can be
:meth:`offer`-ed ahead of time: a stale replica asked to ``begin`` the checkpoint's
iteration resyncs from it first. ``begin`` says which of these happened (:class:`Begin`).

What it computes is ``torch.optim.Adam``/``AdamW`` of the job's implementation, bit for
bit, on this host (``updater/kernels.py``; proved at construction by
``updater/selfcheck.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.core.memory import prefaulted
from gradtap.updater import kernels, norms, selfcheck
from gradtap.updater.clipping import GradNorms
from gradtap.updater.state import (FlatLayout, FlatState, ModelKeys, aligned_empty, from_checkpoint,
                                   model_state_dict, optimizer_state_dict, param_group)
from gradtap.workload.buckets import Bucket
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.schedule import learning_rate
from gradtap.workload.spec import JobSpec

WIRE_NUMPY = {"fp32": np.dtype(np.float32), "bf16": np.dtype(np.uint16), "fp16": np.dtype(np.uint16)}
MAX_OFFERS = 4      # trainer checkpoints held for a resync; each is a whole model and optimizer state


class Begin(enum.Enum):
    """What :meth:`Replica.begin` did."""

    OPENED = "opened"           # the iteration is open
    RESYNCED = "resynced"       # stale: resynced from the offered checkpoint of the iteration, then opened
    STALE = "stale"             # stale, and no checkpoint offered for the iteration: nothing opened
    MISSED = "missed"           # past the next iteration: iterations were missed, now stale, nothing opened

    @property
    def opened(self) -> bool:
        return self in (Begin.OPENED, Begin.RESYNCED)


class Offer(NamedTuple):
    """A trainer checkpoint held for the iteration it resyncs (:meth:`Replica.offer`): its flat
    state, made in ``layout``, and its keys."""

    state: FlatState
    keys: ModelKeys
    layout: FlatLayout


def _move(state: FlatState, old: FlatLayout, new: FlatLayout) -> None:
    """Move ``state`` from the order of ``old`` into that of ``new`` (the same parameters).
    One array is made for the move, not three: each state array, once moved, lends its memory
    to the next."""
    spare = aligned_empty(old.total)
    for name in ("param", "exp_avg", "exp_avg_sq"):
        held = getattr(state, name)
        for i in range(len(new.params)):
            spare[new.param(i)] = held[old.param(i)]
        setattr(state, name, spare)
        spare = held


class Replica:
    """The optimizer state of ``job`` on this host, initialised from ``checkpoint``.

    ``checkpoint`` is a trainer checkpoint dict ``{"model": state_dict, "optimizer":
    state_dict, "iteration": k}`` (``truth/start.pt``); :meth:`from_job` builds one from the
    job's ``initial_state``. ``buckets`` is the wire layout (default: the job's). With
    ``consume`` the checkpoint is handed over and left without its tensors
    (``updater.state.from_checkpoint``).
    """

    def __init__(self, job: JobSpec, checkpoint: Mapping[str, Any], *,
                 buckets: tuple[Bucket, ...] | None = None, consume: bool = False):
        self._attach(job, FlatLayout(job_params(job), job_buckets(job) if buckets is None else buckets))
        self.state, self._keys = from_checkpoint(checkpoint, self.layout, self.cfg, consume=consume)

    def _attach(self, job: JobSpec, layout: FlatLayout) -> None:
        """The fields of a replica of ``job`` laid out as ``layout``, but its state."""
        self.job = job
        self.cfg = job.optimizer
        self.wire = job.ddp.grad_dtype
        self.layout = layout
        self.stale = False
        self.offers: dict[int, Offer] = {}                  # iteration -> its state, made (offer())
        self._reached = -1                                  # the latest iteration begin() was asked for
        self.root = selfcheck.root_source(self.cfg)
        if self.cfg.clip_grad_norm:
            norms.reproduces_torch()       # proven (and compiled) at start-up, not at the first bucket
        self._open: _Iteration | None = None
        self._grad32: np.ndarray | None = None     # widened gradient of a clipped iteration, made when first needed

    @classmethod
    def from_job(cls, job: JobSpec, *, buckets: tuple[Bucket, ...] | None = None) -> "Replica":
        """From ``job.initial_state``: its checkpoint file, or the model built under its seed
        (``gradtap.workload.models.build``) with empty optimizer state at iteration 0."""
        if job.initial_state.checkpoint is not None:
            checkpoint = torch.load(job.initial_state.checkpoint, weights_only=True)
        else:
            checkpoint = seed_checkpoint(job, job.initial_state.seed or 0)
        return cls(job, checkpoint, buckets=buckets, consume=True)

    @property
    def iteration(self) -> int:
        """The next iteration the replica expects."""
        return self.state.iteration

    @property
    def step(self) -> int:
        """Optimizer steps taken (torch's ``state[p]["step"]``)."""
        return self.state.step

    @property
    def open_iteration(self) -> int | None:
        """The iteration begun and not yet ended or aborted, if any."""
        return None if self._open is None else self._open.iteration

    def offer(self, checkpoint: Mapping[str, Any], *, only: bool = False) -> list[int]:
        """Hold the trainer checkpoint ``checkpoint`` (``{"model", "optimizer", "iteration"}``)
        to resync from: a stale replica asked to :meth:`begin` ``checkpoint["iteration"]``
        loads it first. It is checked completely first (:meth:`check_offer`), so that a resync
        never fails. A later offer for the same iteration replaces the earlier one; with
        ``only`` (the control endpoint's rule: one pending offer) it replaces every pending
        offer. At most :data:`MAX_OFFERS` are held: the earliest iterations, which the streams
        reach first (those the streams have passed are dropped by :meth:`begin`). Returns the
        iterations of the pending offers it replaced. :meth:`make_offer` then :meth:`hold`.

        What is held is the flat state the check made from it, so that :meth:`begin` only
        installs it (moved into the layout of the moment if :meth:`relayout` came between).
        Making it allocates and fills 12 bytes per parameter, which must not land on the
        update path while an iteration arrives: on a KVM guest whose host takes freed pages
        back, it took 0.06-0.53 s for 16.8 M parameters, and a live trial whose first
        iteration resynced for 0.53 s lost 24 k frames in rings that hold 0.37 s."""
        return self.hold(self.make_offer(checkpoint), only=only)

    def make_offer(self, checkpoint: Mapping[str, Any], *, consume: bool = False) -> Offer:
        """:meth:`offer`'s checks and flat state, not yet held: the part that takes time (the
        12 bytes per parameter made and checked; GPT-2 small: 1.3-6.8 s on a 2-core AMD EPYC, KVM).
        It changes nothing, and reads only what no step changes (the job, the names, shapes
        and dtypes of the keys, the layout it makes the state in) and the iteration the replica
        has reached, which :meth:`hold` checks again. So it runs beside the update path,
        without the lock that guards the replica (``gradtap/appliance.py``). ``consume``: the
        checkpoint is handed over, and its tensors leave it as they are copied
        (``from_checkpoint``)."""
        layout = self.layout
        _, state, keys = self._checked(checkpoint, layout, consume)
        return Offer(state, keys, layout)

    def hold(self, offer: Offer, *, only: bool = False) -> list[int]:
        """Hold an ``offer`` :meth:`make_offer` made (as :meth:`offer` says), once its iteration is
        still one the streams have not passed (they may have moved on while it was made)."""
        iteration = offer.state.iteration
        self._not_passed(iteration)
        before = set(self.offers)
        if only:
            self.offers.clear()
        self.offers[iteration] = offer
        while len(self.offers) > MAX_OFFERS:
            del self.offers[max(self.offers)]
        return sorted((before - set(self.offers)) | (before & {iteration}))

    def check_offer(self, checkpoint: Mapping[str, Any]) -> int:
        """The iteration of ``checkpoint`` once it is known to be one this replica can resync
        from; ``ConfigError`` saying why not otherwise. It must be an iteration the streams
        have not reached yet, of the job's model (the same state_dict keys, parameter shapes
        and dtypes, buffers as the replica's), with the job's optimizer (betas, eps,
        weight_decay, and the schedule's lr of its last or next step) and finite values (a
        second moment is never negative)."""
        return self._checked(checkpoint, self.layout)[0]

    def _checked(self, checkpoint: Mapping[str, Any], layout: FlatLayout,
                 consume: bool = False) -> tuple[int, FlatState, ModelKeys]:
        """:meth:`check_offer`, and the flat state it made from ``checkpoint`` in ``layout``
        with its keys (``consume``: as :meth:`make_offer`'s)."""
        iteration = checkpoint.get("iteration")
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ConfigError(f"checkpoint iteration is {iteration!r}; expected an int >= 0")
        self._not_passed(iteration)
        state, keys = self._load(checkpoint, layout, consume)
        want, got = _key_kinds(self._keys), _key_kinds(keys)
        if got != want:
            differ = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
            raise ConfigError(f"checkpoint model state_dict differs from the job's model at {differ[:3]} "
                              f"({len(differ)} keys): missing, extra, or another shape or dtype")
        lrs = {learning_rate(self.cfg, max(iteration - 1, 0)), learning_rate(self.cfg, iteration)}
        if state.lr not in lrs:
            raise ConfigError(f"checkpoint optimizer: lr is {state.lr!r} but the job's schedule gives "
                              f"{' or '.join(map(repr, sorted(lrs)))} at iteration {iteration}")
        if state.step < 0:
            raise ConfigError(f"checkpoint optimizer: step is {state.step}")
        for name in ("param", "exp_avg", "exp_avg_sq"):
            values = getattr(state, name)
            if not np.isfinite(values).all() or (name == "exp_avg_sq" and (values < 0).any()):
                raise ConfigError(f"checkpoint {name} holds {'negative or ' if name == 'exp_avg_sq' else ''}"
                                  "non-finite values; no Adam step of a finite gradient makes them")
        return iteration, state, keys

    def _not_passed(self, iteration: int) -> None:
        """``ConfigError`` when the streams are past ``iteration``: too late to resync at it."""
        usable = max(self.state.iteration, self._reached + 1)
        if iteration < usable:
            raise ConfigError(f"checkpoint of iteration {iteration}: the streams are past it (the replica can "
                              f"resync at iteration {usable} or later); offer the trainer's checkpoint of a "
                              "later iteration")

    def begin(self, iteration: int) -> Begin:
        """Open ``iteration``, the next one (:attr:`iteration`), and say what happened.

        A stale replica first resyncs from the checkpoint offered for ``iteration``
        (:meth:`offer`), if any; without one it stays stale and opens nothing. An iteration
        past the next one means iterations were missed: the replica becomes stale and opens
        nothing. Checkpoints offered for iterations before ``iteration`` can no longer be
        used and are dropped. Raises for an iteration still open or one already applied.
        """
        if self._open is not None:
            raise GradtapError(f"iteration {self._open.iteration} is still open; end() or abort() it first")
        self._reached = max(self._reached, iteration)
        for old in [k for k in self.offers if k < iteration]:
            del self.offers[old]
        outcome = Begin.OPENED
        if self.stale:
            if iteration not in self.offers:
                return Begin.STALE
            offer = self.offers.pop(iteration)
            if offer.layout is not self.layout:
                _move(offer.state, offer.layout, self.layout)
            self._install(offer.state, offer.keys)
            outcome = Begin.RESYNCED
        if iteration < self.state.iteration:
            raise GradtapError(f"begin({iteration}): the replica's next iteration is {self.state.iteration}")
        if iteration > self.state.iteration:
            self.stale = True
            return Begin.MISSED
        lr = learning_rate(self.cfg, iteration)
        self._open = _Iteration(iteration, lr, len(self.layout.buckets),
                                self._new_norms() if self.cfg.clip_grad_norm else None)
        return outcome

    def apply_bucket(self, bucket: int, grad: np.ndarray, *, lasting: bool = False) -> None:
        """Hand over the complete reduced gradient of bucket ``bucket`` (an index in launch
        order): a 1-D ``uint8`` array of its wire bytes, or a 1-D array of the wire dtype
        (float32; bf16/fp16 as uint16 bit patterns, fp16 also as float16) of ``numel``
        elements.

        A clipped iteration steps only at :meth:`end`, once every norm is known, so its
        gradient is kept until then: widened into float32 (and divided by the world size
        when DDP did not divide it); or, with ``lasting``, where the wire already holds the
        float32 gradient the trainer clips (fp32, pre-divided), ``grad`` itself, read again
        at :meth:`end`. ``lasting`` promises that ``grad`` stays unchanged until then (the
        merger's buckets do: ``merger/merger.py``)."""
        it = self._require_open()
        if not 0 <= bucket < len(self.layout.buckets):
            raise GradtapError(f"apply_bucket: bucket {bucket} is not one of the job's "
                               f"{len(self.layout.buckets)} buckets")
        if it.arrived[bucket]:
            raise GradtapError(f"apply_bucket: bucket {bucket} of iteration {it.iteration} "
                               "was already applied")
        g = self._wire_array(bucket, grad)
        c = self._constants(it, clip=1.0)
        sl = self.layout.bucket(bucket)
        work = self.layout.work(bucket, self.cfg.implementation)
        if it.norms is None:
            kernels.adam_step(self.cfg.implementation, self.state.param[sl], g, self.state.exp_avg[sl],
                              self.state.exp_avg_sq[sl], work, c, wire=self.wire, sqrt=self.root)
        else:
            b = self.layout.buckets[bucket]
            if self._kept_as_handed(lasting):
                it.kept[bucket] = g
                it.norms.add(b.params, g, self.layout.param_spans(bucket))
            else:
                if self._grad32 is None:
                    self._grad32 = self._widened()
                kernels.widen_gradient(g, self._grad32[sl], work, c, wire=self.wire)
                it.norms.add(b.params, self._grad32[sl], self.layout.param_spans(bucket))
        it.arrived[bucket] = True

    def end(self) -> None:
        """Complete the open iteration: every bucket must have arrived."""
        it = self._require_open()
        missing = [b for b in self.stepped_buckets() if not it.arrived[b]]
        if missing:
            raise GradtapError(f"end(): iteration {it.iteration} lacks buckets {missing[:8]}; a partial "
                               "gradient is never applied (abort() the iteration instead)")
        if it.norms is not None:
            c = self._constants(it, clip=it.norms.coefficient(self.cfg.clip_grad_norm), summed=False)
            for b in self.stepped_buckets():
                sl = self.layout.bucket(b)
                g = it.kept[b] if b in it.kept else self._grad32[sl]
                kernels.adam_step(self.cfg.implementation, self.state.param[sl], g,
                                  self.state.exp_avg[sl], self.state.exp_avg_sq[sl],
                                  self.layout.work(b, self.cfg.implementation), c, wire="fp32",
                                  sqrt=self.root)
        self.state.step += 1
        self.state.iteration += 1
        self.state.lr = it.lr
        self._open = None

    def apply(self, iteration: int, grad: np.ndarray) -> None:
        """One whole iteration from the flat gradient of all buckets in launch order (the
        simulator's ``truth/iter_N/grad.npy``, or its bytes): ``begin``, every bucket, ``end``."""
        itemsize = WIRE_NUMPY[self.wire].itemsize
        flat = np.ascontiguousarray(grad).reshape(-1)
        if flat.dtype != np.uint8 and flat.itemsize != itemsize:
            raise GradtapError(f"apply: a {self.wire} gradient has {itemsize}-byte elements, "
                               f"not {flat.dtype}")
        flat = flat.view(np.uint8)
        if flat.size != self.layout.total * itemsize:
            raise GradtapError(f"apply: the gradient has {flat.size} bytes; the job's buckets take "
                               f"{self.layout.total * itemsize}")
        outcome = self.begin(iteration)
        if not outcome.opened:
            raise GradtapError(f"apply({iteration}): the replica is stale (next iteration "
                               f"{self.state.iteration}, begin: {outcome.value}); resync it from a trainer "
                               "checkpoint first")
        for b in range(len(self.layout.buckets)):
            sl = self.layout.bucket(b)
            self.apply_bucket(b, flat[sl.start * itemsize:sl.stop * itemsize])
        self.end()

    def abort(self) -> None:
        """Give up the open iteration: the replica becomes stale until :meth:`resync`."""
        self._require_open()
        self._open = None
        self.stale = True

    def resync(self, checkpoint: Mapping[str, Any]) -> None:
        """Replace the whole state with a trainer checkpoint; clears :attr:`stale`."""
        self._install(*self._load(checkpoint))

    def _load(self, checkpoint: Mapping[str, Any], layout: FlatLayout | None = None,
              consume: bool = False) -> tuple[FlatState, ModelKeys]:
        """The flat state of a trainer checkpoint in ``layout`` (the replica's by default), and
        its keys; ``consume``: as ``from_checkpoint``'s."""
        return from_checkpoint(checkpoint, layout or self.layout, self.cfg, consume=consume)

    def _install(self, state: FlatState, keys: ModelKeys) -> None:
        self.state, self._keys = state, keys
        self._open = None
        self.stale = False

    def relayout(self, buckets: tuple[Bucket, ...]) -> None:
        """Take gradients in another bucket layout from the next iteration on (DDP rebuilds
        its buckets after iteration 0): the state is moved into the new wire order.

        It runs on the update path between two iterations, while the next one arrives, so it
        makes one array, not three (:func:`_move`): memory touched for the first time can be
        slow. On a KVM guest whose host takes freed pages back, 3 arrays of 64 MiB took
        0.08-0.60 s to make and fill, longer than a live ring of 32 k frames at 0.26 Mpps."""
        if self._open is not None:
            raise GradtapError("relayout(): an iteration is open; change layouts between iterations")
        new = FlatLayout(self.layout.params, buckets)
        _move(self.state, self.layout, new)
        self.layout = new          # the widened gradient keeps its size: the same parameters

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """``{"model", "optimizer", "iteration"}`` as the trainer's checkpoint holds them.

        With ``copy=False`` the tensors share the replica's memory: cheaper, but the next
        step changes them, so finish with them (e.g. a snapshot write) first.
        """
        if self._open is not None:
            raise GradtapError(f"state_dict(): iteration {self._open.iteration} is half applied; "
                               "take the state between iterations")
        state = self.state.copy() if copy else self.state
        return {"model": model_state_dict(self._keys, self.layout, state.param),
                "optimizer": optimizer_state_dict(self.cfg, self.layout, state),
                "iteration": state.iteration}

    def stepped_buckets(self) -> list[int]:
        """The buckets this replica steps: every one (a shard of a mirror group steps its own,
        ``updater/shard.py``)."""
        return list(range(len(self.layout.buckets)))

    def _new_norms(self) -> GradNorms:
        """Where a clipped iteration's per-parameter norms are kept."""
        return GradNorms(len(self.layout.params))

    def _require_open(self) -> "_Iteration":
        if self._open is None:
            raise GradtapError("no iteration is open; call begin(iteration) first")
        return self._open

    def prepare(self, *, lasting: bool = False) -> None:
        """Make and fault in now, at start-up, what stepping will need, so that none of it is
        made on the update path while the first iteration arrives: the widened gradient of
        clipped iterations (4 bytes per parameter), unless every bucket will be handed over
        ``lasting`` as the fp32 pre-divided gradient, which is kept as it is. (Memory touched
        for the first time can take seconds for a large model: 64 MiB arrays took up to 0.2 s
        each on a KVM guest whose host takes freed pages back.)"""
        if self.cfg.clip_grad_norm and self._grad32 is None and not self._kept_as_handed(lasting):
            self._grad32 = self._widened()

    def _kept_as_handed(self, lasting: bool) -> bool:
        """Whether a clipped iteration keeps a bucket handed over with ``lasting`` as it is, to
        read again at :meth:`end`: the wire holds the float32 gradient the trainer clips."""
        return lasting and self.wire == "fp32" and self.job.ddp.predivide

    def _widened(self) -> np.ndarray:
        """The float32 gradient clipped iterations are widened into, made and faulted in once
        (``core.memory.prefaulted``): by :meth:`prepare`, or when a clipped bucket first needs
        it."""
        return prefaulted(4 * self.layout.total).view(np.float32)

    def _constants(self, it: "_Iteration", clip: float, summed: bool = True) -> kernels.StepConstants:
        """The step's constants; ``summed=False`` once the gradient is already divided."""
        cfg = self.cfg
        return kernels.step_constants(
            cfg.implementation, decoupled=cfg.kind == "adamw", lr=it.lr, betas=tuple(cfg.betas),
            eps=cfg.eps, weight_decay=cfg.weight_decay, step=self.state.step + 1,
            world=None if self.job.ddp.predivide or not summed else self.job.world_size, clip=clip)

    def _wire_array(self, bucket: int, grad: np.ndarray) -> np.ndarray:
        numel = self.layout.buckets[bucket].numel
        want = WIRE_NUMPY[self.wire]
        if not isinstance(grad, np.ndarray) or grad.ndim != 1:
            raise GradtapError(f"apply_bucket: bucket {bucket}'s gradient must be a 1-D numpy array")
        if grad.dtype == np.uint8:
            if grad.size != numel * want.itemsize:
                raise GradtapError(f"apply_bucket: bucket {bucket} takes {numel * want.itemsize} bytes "
                                   f"({numel} {self.wire} elements), got {grad.size}")
            grad = np.ascontiguousarray(grad)
            if grad.ctypes.data % want.itemsize:
                grad = grad.copy()      # a view needs the element alignment
            return grad.view(want)
        if self.wire == "fp16" and grad.dtype == np.float16:
            grad = grad.view(np.uint16)
        if grad.dtype != want or grad.size != numel:
            raise GradtapError(f"apply_bucket: bucket {bucket} takes {numel} elements of {want} "
                               f"({self.wire} on the wire), got {grad.size} of {grad.dtype}")
        return np.ascontiguousarray(grad)


def _key_kinds(keys: ModelKeys) -> dict[str, Any]:
    """A model state_dict's keys, each with its parameter index or its buffer's shape and dtype."""
    return {key: ref if isinstance(ref, int) else (tuple(ref.shape), ref.dtype) for key, ref in keys.keys}


class _Iteration:
    def __init__(self, iteration: int, lr: float, n_buckets: int, norms: GradNorms | None):
        self.iteration = iteration
        self.lr = lr
        self.arrived = [False] * n_buckets
        self.norms = norms
        self.kept: dict[int, np.ndarray] = {}     # bucket -> its lasting float32 gradient (clipping)


def seed_checkpoint(job: JobSpec, seed: int) -> dict[str, Any]:
    """The trainer's state before its first step: the model built under ``seed``, an empty
    optimizer state with the learning rate of iteration 0, iteration 0."""
    from gradtap.workload.models import build  # the model factory; torch-heavy, only for seeds

    if job.model.factory is None:
        raise ConfigError("initial_state: a seed needs model.factory to build the model; a job that "
                          "lists its parameters must start from initial_state.checkpoint")
    model = build(job.model.factory, job.model.kwargs, seed=seed)
    n_params = len(job_params(job))
    return {"model": model.state_dict(),
            "optimizer": {"state": {}, "param_groups": [param_group(job.optimizer, n_params,
                                                                    learning_rate(job.optimizer, 0))]},
            "iteration": 0}
