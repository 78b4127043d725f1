"""DDP gradient buckets: which parameters share one allreduce, and where each sits in it.

``torch.nn.parallel.DistributedDataParallel`` copies every gradient into a flat bucket
buffer and allreduces the buffers one by one; the bytes NCCL puts on the wire are those
buffers. This module derives the layout from the parameter list alone, reproducing
torch 2.13.0 (``torch/nn/parallel/distributed.py`` and
``torch/csrc/distributed/c10d/reducer.cpp``):

* **Parameter list.** DDP buckets the parameters that require grad, deduplicated (a tied
  weight appears once, under its first name), in module registration order, i.e. the
  order of ``module.named_parameters()``. ``params`` must be exactly that list.
* **Greedy assignment** (``compute_bucket_assignment_by_size``). Walk the parameters in
  a given order, appending each to the open bucket of its dtype; once the open bucket
  holds ``>=`` the current byte limit it is closed and the next limit applies (the last
  limit repeats). So a bucket can exceed its limit by up to one parameter, and a
  parameter larger than the limit closes the bucket it joins. Buckets never mix
  dtypes; open buckets left at the end are appended after the closed ones.
* **Initial layout** (iteration 0). The walk is in registration order. With the
  defaults (``find_unused_parameters=False``) or ``static_graph=True`` the limit is
  unbounded, so there is one bucket per dtype. With ``find_unused_parameters=True`` the
  limits are ``[first_cap, cap]`` (just ``[cap]`` when they are equal). Buckets are
  sorted by their smallest parameter index, then the list is *reversed* (DDP assumes
  gradients arrive in reverse registration order); inside a bucket parameters stay in
  registration order.
* **Rebuilt layout.** After the first backward pass DDP records the order in which
  gradients became ready on rank 0 and re-runs the walk in that order with limits
  ``[first_cap, cap]``, without sorting or reversing: bucket 0 holds the gradients that
  are ready first, and parameters sit in ready order inside each bucket. The rebuild
  happens before the forward pass of iteration 1 (iteration 2 with ``static_graph``)
  and never with ``find_unused_parameters=True`` unless ``static_graph`` (see
  :func:`layout_at`).
* **Caps.** ``bucket_cap_mb=None`` (DDP's default) means a 25 MiB cap and a 1 MiB
  first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``). Passing any
  ``bucket_cap_mb``, even 25, makes the first bucket as large as the others; bytes are
  ``int(bucket_cap_mb * 2**20)``.
* **Buffer.** Offsets are dense: each parameter's gradient follows the previous one with
  no alignment padding, and a bucket's buffer has its parameters' dtype. Within its
  slot a gradient is in the parameter's memory order (row-major for contiguous
  parameters, which is all this project models). ``gradient_as_bucket_view`` changes
  where ``.grad`` lives, not the layout.
* **Launch order.** DDP allreduces buckets strictly in index order (a bucket that is
  ready early waits for its predecessors), so ``Bucket.index`` is the wire order.

Not modelled: sparse gradients (each gets its own bucket), ``bucket_cap_mb_list``,
``DDP_SET_LAST_BUCKET_CAP=1``, and parameters unused in the forward pass.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gradtap.core.errors import ConfigError, PlanError

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES in torch 2.13.0.
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB

Layout = Literal["initial", "rebuilt"]


class ParamLike(Protocol):
    """What bucketing reads from a ``gradtap.workload.spec.ParamSpec``."""

    name: str
    dtype: str

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class Bucket:
    """One DDP gradient bucket: a flat buffer of ``numel`` elements of ``dtype``.

    ``params[k]`` (an index into the parameter list) occupies elements
    ``offsets[k] : offsets[k] + numel of that parameter`` of the buffer; ``params`` is in
    buffer order and ``offsets`` is increasing. ``index`` is the bucket's position in
    DDP's launch order.
    """

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """``(first_bucket_bytes, bucket_bytes)`` that DDP derives from its ``bucket_cap_mb``."""
    if bucket_cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB
    if not bucket_cap_mb > 0:
        raise ConfigError(
            f"bucket_cap_mb: {bucket_cap_mb!r} is not a positive number of MiB "
            f"(leave it unset for DDP's default of {DEFAULT_BUCKET_CAP_MB})"
        )
    cap = int(bucket_cap_mb * MIB)
    return cap, cap


def layout_at(iteration: int, *, find_unused_parameters: bool = False,
              static_graph: bool = False) -> Layout:
    """Which layout DDP's allreduces use in ``iteration`` (0-based).

    The reducer rebuilds only when ``static_graph or not find_unused_parameters``; it
    records the ready order in the first backward pass that runs its per-gradient hooks
    (iteration 0, or iteration 1 with ``static_graph``, whose first backward reduces
    everything at once) and rebuilds before the next forward pass.
    """
    if not (static_graph or not find_unused_parameters):
        return "initial"
    return "rebuilt" if iteration >= (2 if static_graph else 1) else "initial"


def ddp_buckets(
    params: Sequence[ParamLike],
    *,
    bucket_cap_mb: float | None = None,
    layout: Layout = "rebuilt",
    ready_order: Sequence[int] | None = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
) -> tuple[Bucket, ...]:
    """The buckets DDP builds for ``params``, in launch order.

    Parameters
    ----------
    params:
        DDP's parameter list (see the module docstring): trainable, deduplicated, in
        registration order.
    bucket_cap_mb:
        DDP's ``bucket_cap_mb`` argument; ``None`` for its default.
    layout:
        ``"initial"`` for the buckets built at construction (used in iteration 0),
        ``"rebuilt"`` for those built from the gradient ready order (every later
        iteration; :func:`layout_at` says which applies when).
    ready_order:
        For ``"rebuilt"``: indices into ``params`` in the order their gradients become
        ready in backward on rank 0 (``gradtap.workload.models.grad_ready_order`` measures it).
        Default: reverse registration order, which a plain sequential stack of layers
        produces; modules such as LayerNorm (weight before bias) or tied and reused
        weights deviate from it, so pass the measured order for real models.
    find_unused_parameters, static_graph:
        The DDP constructor arguments of the same names.
    """
    if not params:
        raise ConfigError("params: DDP needs at least one parameter that requires grad")
    first_cap, cap = bucket_caps(bucket_cap_mb)
    if layout == "initial":
        if static_graph or not find_unused_parameters:
            limits = [sys.maxsize]
        else:
            limits = [first_cap, cap] if first_cap < cap else [cap]
        closed, still_open = _assign(params, range(len(params)), limits)
        groups = sorted(closed + still_open, key=min)
        groups.reverse()
    elif layout == "rebuilt":
        if not (static_graph or not find_unused_parameters):
            raise PlanError(
                "layout 'rebuilt' does not exist: DDP never rebuilds its buckets when "
                "find_unused_parameters=True without static_graph; use layout 'initial'"
            )
        order = _check_order(ready_order, len(params))
        closed, still_open = _assign(params, order, [first_cap, cap])
        if len(still_open) > 1:
            dtypes = sorted(params[g[0]].dtype for g in still_open)
            raise PlanError(
                "the rebuilt bucket order is undefined for this model: dtypes "
                f"{dtypes} each leave a partly filled bucket, and DDP appends those in "
                "std::unordered_map iteration order"
            )
        groups = closed + still_open
    else:
        raise ConfigError(f"layout: {layout!r} is not one of 'initial', 'rebuilt'")
    return _pack(params, groups)


def explicit_buckets(params: Sequence[ParamLike],
                     buckets: Sequence[Sequence[str]]) -> tuple[Bucket, ...]:
    """Buckets given by name, in launch order, each listing its parameters in buffer order.

    For jobs whose layout was recorded from a real run (e.g. with a DDP comm hook) rather
    than derived. Every parameter must appear exactly once, and a bucket's parameters
    must share a dtype.
    """
    index = {p.name: i for i, p in enumerate(params)}
    seen: dict[str, int] = {}
    groups = []
    for b, names in enumerate(buckets):
        if not names:
            raise ConfigError(f"buckets[{b}]: is empty; every bucket needs a parameter")
        group = []
        for name in names:
            if name not in index:
                raise ConfigError(f"buckets[{b}]: {name!r} is not a parameter of the model")
            if name in seen:
                raise ConfigError(
                    f"buckets[{b}]: {name!r} is already in buckets[{seen[name]}]; "
                    "each parameter belongs to exactly one bucket"
                )
            seen[name] = b
            group.append(index[name])
        dtypes = sorted({params[i].dtype for i in group})
        if len(dtypes) > 1:
            raise ConfigError(
                f"buckets[{b}]: mixes dtypes {dtypes}; a DDP bucket holds one dtype"
            )
        groups.append(group)
    missing = [p.name for p in params if p.name not in seen]
    if missing:
        raise ConfigError(f"buckets: parameters {missing} are in no bucket")
    return _pack(params, groups)


def _check_order(ready_order: Sequence[int] | None, n: int) -> list[int]:
    if ready_order is None:
        return list(reversed(range(n)))
    order = [int(i) for i in ready_order]
    if sorted(order) != list(range(n)):
        raise ConfigError(
            f"ready_order: must be a permutation of the {n} parameter indices "
            f"0..{n - 1}, got {len(order)} indices {order[:8]}{'...' if len(order) > 8 else ''}"
        )
    return order


def _assign(params: Sequence[ParamLike], order: Sequence[int],
            limits: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """The greedy walk: ``(closed buckets in closing order, still-open buckets)``."""
    closed: list[list[int]] = []
    open_: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    limit_at: dict[str, int] = {}
    for i in order:
        dtype = params[i].dtype
        group = open_.setdefault(dtype, [])
        group.append(i)
        filled[dtype] = filled.get(dtype, 0) + params[i].nbytes
        step = limit_at.setdefault(dtype, 0)
        if filled[dtype] >= limits[step]:
            closed.append(group)
            open_[dtype] = []
            filled[dtype] = 0
            limit_at[dtype] = min(step + 1, len(limits) - 1)
    return closed, [g for g in open_.values() if g]


def _pack(params: Sequence[ParamLike], groups: Sequence[Sequence[int]]) -> tuple[Bucket, ...]:
    """Lay each group out densely, in the given order."""
    buckets = []
    for index, group in enumerate(groups):
        offsets, numel = [], 0
        for i in group:
            offsets.append(numel)
            numel += params[i].numel
        buckets.append(Bucket(index=index, params=tuple(group), offsets=tuple(offsets),
                              numel=numel, dtype=params[group[0]].dtype))
    return tuple(buckets)
