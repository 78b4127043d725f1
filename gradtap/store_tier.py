"""The job's durable store tier, as the shell wires it (``store/object_store.py``, ``store/uploader.py``,
``store/gradient_log.py``): ``--store URL`` over the job spec's ``appliance.store``, the uploader a
run hands its snapshots to, the gradient log it hands its applied gradients to, and the state a
restarted appliance starts from (``--start-from-store``): the newest READY snapshot and the log
after it, or, when the store has nothing usable, no state and a fallback asking the trainer."""

from __future__ import annotations

import dataclasses
import logging

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.start import ReplicaStart, replica_start
from gradtap.store.gradient_log import GradientLog, Progress, rebuild
from gradtap.store.object_store import SnapshotStore
from gradtap.store.uploader import Uploader
from gradtap.updater.replica import Replica
from gradtap.updater.replica_origin import ReplicaOrigin
from gradtap.workload.spec import JobSpec, StoreSpec

log = logging.getLogger(__name__)


def with_store(job: JobSpec, url: str | None) -> JobSpec:
    """``job`` with ``appliance.store.url`` set to ``url`` (``--store``; the section's other
    fields kept, or their defaults); ``url`` None: ``job`` as it is."""
    if url is None:
        return job
    fields = {} if job.appliance.store is None else job.appliance.store.model_dump()
    try:
        store = StoreSpec(**{**fields, "url": url})
    except ValueError as exc:
        raise ConfigError(f"--store {url}: {exc}") from None
    return job.model_copy(update={"appliance": job.appliance.model_copy(update={"store": store})})


def uploader_for(job: JobSpec) -> Uploader | None:
    """A started uploader to the job's store (``None`` when it configures none); its events go
    nowhere until the caller sets ``on_event`` (``ControlPlane.event``)."""
    spec = job.appliance.store
    if spec is None:
        return None
    return Uploader(SnapshotStore.of_spec(spec, job.name), retry_min_s=spec.retry_min_s,
                    retry_max_s=spec.retry_max_s)


def gradient_log_for(job: JobSpec, replica: Replica, origin: ReplicaOrigin | None) -> GradientLog | None:
    """A started gradient log of ``replica`` in the job's store (``None`` unless the job sets
    ``appliance.store.gradient_log``); ``origin``: the replica's start state, named by the first
    record. Its events go nowhere until the caller sets ``on_event``."""
    spec = job.appliance.store
    if spec is None or not spec.gradient_log:
        return None
    return GradientLog.for_replica(SnapshotStore.of_spec(spec, job.name), replica, origin,
                                   queue=spec.gradient_log_queue, retry_min_s=spec.retry_min_s,
                                   retry_max_s=spec.retry_max_s)


def store_checkpoint(job: JobSpec, progress: Progress | None = None, loading: Progress | None = None) -> dict:
    """The newest state of ``job`` its store holds, as a trainer checkpoint (declared: its
    iteration is the captures' first, as ``--start`` with a file says): the newest READY
    snapshot that verifies, and the gradient log replayed after it as far as it goes
    (``progress`` and ``loading``: as ``rebuild``'s)."""
    spec = job.appliance.store
    if spec is None:
        raise ConfigError("--start-from-store: the job configures no store (appliance.store) and no --store "
                          "URL is given")
    rebuilt = rebuild(job, SnapshotStore.of_spec(spec, job.name), progress=progress, loading=loading)
    if rebuilt.replayed:
        log.info("%s: snapshot of iteration %d, then the gradient log to iteration %d", spec.url, rebuilt.snapshot,
                 rebuilt.replayed[-1])
    if rebuilt.stopped is not None:
        log.warning("%s: the gradient log replay stopped at iteration %d: %s", spec.url,
                    rebuilt.checkpoint["iteration"], rebuilt.stopped)
    return rebuilt.checkpoint


def store_start(job: JobSpec, progress: Progress | None = None, loading: Progress | None = None) -> ReplicaStart:
    """How a replica restarted from the store starts (``--start-from-store``): from
    :func:`store_checkpoint` (``progress`` and ``loading``: as its); or, when the store holds
    nothing usable, waiting for the trainer's checkpoint with a ``fallback`` that asks for it,
    never from a state it lacks."""
    url = job.appliance.store.url if job.appliance.store is not None else None
    try:
        return replica_start(job, store_checkpoint(job, progress, loading), f"the store {url}")
    except ConfigError:
        raise
    except (GradtapError, OSError) as exc:       # nothing READY, nothing that verifies, the store unreachable
        reason = f"--start-from-store: nothing usable in {url} ({exc}); the replica waits for the trainer's checkpoint"
        log.error("%s", reason)
        return dataclasses.replace(replica_start(job, None, f"the store {url}"), fallback=(0, reason))


def store_close_timeout(job: JobSpec) -> float:
    """How long a clean shutdown waits for the last upload."""
    return 0.0 if job.appliance.store is None else job.appliance.store.close_timeout_s
