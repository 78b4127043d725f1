"""The job's durable store tier, as the shell wires it (``store/object_store.py``, ``store/uploader.py``):
``--store URL`` over the job spec's ``appliance.store``, the uploader a run hands its snapshots
to, and the newest READY snapshot a restarted appliance starts from (``--start-from-store``)."""

from __future__ import annotations

from gradtap.core.errors import ConfigError
from gradtap.store.object_store import SnapshotStore
from gradtap.store.uploader import Uploader
from gradtap.workload.spec import JobSpec, StoreSpec


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


def store_checkpoint(job: JobSpec) -> dict:
    """The newest READY snapshot of ``job`` in its store that verifies, as a trainer checkpoint
    (declared: its iteration is the captures' first, as ``--start`` with a file says)."""
    spec = job.appliance.store
    if spec is None:
        raise ConfigError("--start-from-store: the job configures no store (appliance.store) and no --store "
                          "URL is given")
    return SnapshotStore.of_spec(spec, job.name).load_newest()


def store_close_timeout(job: JobSpec) -> float:
    """How long a clean shutdown waits for the last upload."""
    return 0.0 if job.appliance.store is None else job.appliance.store.close_timeout_s
