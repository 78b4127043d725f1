"""From a job spec to its parameters, its DDP buckets and its wire plan.

The bucket layout DDP uses after iteration 0 follows the order in which gradients become
ready in backward. For a model given by a factory, that order is measured by running one
backward pass of the model on PyTorch's ``meta`` device (no memory, no data); a job can
also list its buckets explicitly (``ddp.layout: explicit``).
"""

from __future__ import annotations

from functools import lru_cache

from gradtap.core.errors import ConfigError
from gradtap.workload.buckets import Bucket, ddp_buckets, explicit_buckets
from gradtap.workload.spec import JobSpec, ParamSpec
from gradtap.workload.wire_plan import WirePlan, build_plan


def job_params(job: JobSpec) -> tuple[ParamSpec, ...]:
    """DDP's parameter list: trainable, deduplicated, in registration order."""
    if job.model.params is not None:
        return tuple(ParamSpec(p.name, tuple(p.shape), p.dtype) for p in job.model.params)
    return _describe(job)[0]


def _describe(job: JobSpec):
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in job.model.kwargs.items()))
    return _describe_model(job.model.factory, frozen, job.training.data_kwargs.get("seq_len"))


@lru_cache(maxsize=8)
def _describe_model(factory: str, frozen_kwargs: tuple, seq_len: int | None):
    from gradtap.workload.models import describe  # torch-heavy; only factory-built models need it

    kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in frozen_kwargs}
    return describe(factory, kwargs, seq_len=seq_len)


def job_buckets(job: JobSpec, layout: str | None = None) -> tuple[Bucket, ...]:
    """The buckets of the job's layout (or of ``layout``: ``initial``/``rebuilt``), in launch order."""
    params = job_params(job)
    layout = layout or job.ddp.layout
    if layout == "explicit":
        return explicit_buckets(params, job.ddp.buckets)
    ready = None
    if layout == "rebuilt":
        if job.model.params is not None:
            raise ConfigError("ddp.layout: 'rebuilt' needs the gradient ready order, which a parameter list "
                              "does not give; use a model factory, or list the buckets (layout: explicit)")
        ready = _describe(job)[1]
    return ddp_buckets(params, bucket_cap_mb=job.ddp.bucket_cap_mb, layout=layout, ready_order=ready)


def job_plan(job: JobSpec, buckets: tuple[Bucket, ...] | None = None) -> WirePlan:
    """The wire plan of one iteration in the job's bucket layout."""
    buckets = job_buckets(job) if buckets is None else buckets
    return build_plan(job, [b.numel for b in buckets])


def layout_document(params: tuple[ParamSpec, ...], buckets: tuple[Bucket, ...], wire_dtype: str,
                    first_iteration: int) -> dict:
    """The bucket layout on the wire, as ``layout.json`` beside a flat gradient holds it: per
    bucket in launch order its parameters (name, shape, element offset in the bucket) and
    its element offset in the flat gradient; the wire dtype; the first iteration."""
    offset, out = 0, []
    for b in buckets:
        out.append({"index": b.index, "numel": b.numel, "flat_offset": offset,
                    "params": [{"name": params[i].name, "shape": list(params[i].shape), "offset": o}
                               for i, o in zip(b.params, b.offsets)]})
        offset += b.numel
    return {"wire_dtype": wire_dtype, "total_elems": offset, "first_iteration": first_iteration, "buckets": out}
