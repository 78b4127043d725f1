"""The background uploader: local snapshots to the durable store, never on the update path.

One thread uploads (``SnapshotStore.put_snapshot``, then retention). The update path only
calls :meth:`Uploader.submit`, which takes a lock held by nobody for longer than a few
assignments: there is one slot for the snapshot waiting to go. A snapshot submitted while
another waits replaces it, and the one replaced is counted as skipped (``store.skipped``):
when the store is slower than the snapshot rate, the newest state goes next and nothing
queues without bound.

A failed upload (the store is down, a timeout, a refused request) is counted
(``store.failed``, with the attempt number and the wait before the next) and retried after
a backoff that doubles from ``retry_min_s`` up to ``retry_max_s``; a newer snapshot
submitted meanwhile is what the retry uploads (the failed one is then skipped). The first
upload that succeeds after failures is a ``store.resumed`` event. Because the manifest is
written last (``store/object_store.py``), an upload cut short leaves no READY snapshot.

The files of a submitted snapshot are hard links in a staging directory (``stage``), so
local retention may drop the snapshot while its upload waits; the staging directory is
removed once the snapshot is uploaded or skipped.

Before its first upload the thread aborts the store's multipart uploads left by a writer
that was killed mid-object (:meth:`SnapshotStore.abort_dead_uploads`, ``store.aborted``);
failing to list them is logged and does not stop uploading.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gradtap.store.object_store import SnapshotStore

log = logging.getLogger(__name__)

EventSink = Callable[..., object]        # ControlPlane.event(kind, **fields)
NICE = 10                                # the uploader thread's niceness (the update path keeps 0)


@dataclass
class UploadCounters:
    submitted: int = 0
    uploaded: int = 0
    skipped: int = 0                     # replaced by a newer snapshot before they went
    failed: int = 0                      # attempts that raised
    last_uploaded: int | None = None     # iteration of the newest READY snapshot written

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Pending:
    iteration: int
    files: Path                          # the staging directory holding the snapshot's files


def _no_events(kind: str, **fields) -> None:
    del kind, fields


class Uploader:
    """Uploads submitted snapshots to ``store`` in one background thread.

    Parameters
    ----------
    store:
        Where they go.
    retry_min_s, retry_max_s:
        Backoff after a failed attempt (seconds): the first wait, and the cap of its doubling.
    on_event:
        ``on_event(kind, **fields)`` for ``store.uploaded``, ``store.skipped``,
        ``store.failed``, ``store.resumed``, ``store.abandoned`` and ``store.aborted`` (called on the uploader's
        thread); ``ControlPlane.event`` fits.
    """

    def __init__(self, store: SnapshotStore, *, retry_min_s: float = 0.5, retry_max_s: float = 30.0,
                 on_event: EventSink = _no_events):
        self.store, self.retry_min_s, self.retry_max_s = store, retry_min_s, retry_max_s
        self.on_event = on_event
        self.counters = UploadCounters()
        self._cond = threading.Condition()
        self._pending: _Pending | None = None
        self._skipped_since: list[int] = []      # iterations skipped, not yet reported
        self._closing = False
        self._idle = True
        self._thread = threading.Thread(target=self._loop, name="gradtap-uploader", daemon=True)
        self._thread.start()

    def submit(self, iteration: int, staged: Path) -> None:
        """Queue the snapshot of ``iteration`` whose files are in ``staged`` (hard links the
        uploader owns from now on); replaces, and skips, one still waiting. Never blocks on I/O."""
        with self._cond:
            old = self._pending
            self._pending = _Pending(iteration, Path(staged))
            self.counters.submitted += 1
            if old is not None:
                self.counters.skipped += 1
                self._skipped_since.append(old.iteration)
            self._cond.notify()
        if old is not None:
            shutil.rmtree(old.files, ignore_errors=True)   # a few unlinks of its staged links

    def counts(self) -> dict:
        with self._cond:
            return self.counters.as_dict()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing waits or uploads (for tests and a clean shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and self._idle, timeout)

    def close(self, timeout: float) -> None:
        """Let the snapshot waiting (the final one) go, within ``timeout`` seconds; a failure
        then is not retried (``store.abandoned``)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: the last upload did not finish within %.0f s", self.store.url, timeout)
            self.on_event("store.abandoned", url=self.store.url, reason=f"not finished within {timeout} s")

    def _loop(self) -> None:
        try:            # Linux schedules threads as tasks: the update path wins the cores it shares with us
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (OSError, AttributeError):
            pass
        try:
            aborted = self.store.abort_dead_uploads()
        except Exception as exc:          # a store that refuses the listing still takes uploads
            log.warning("%s: could not list unfinished multipart uploads: %s", self.store.url, exc)
        else:
            if aborted:
                self.on_event("store.aborted", url=self.store.url, uploads=len(aborted), keys=aborted[:10])
        failures, delay = 0, self.retry_min_s
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closing)
                job, self._pending = self._pending, None
                skipped, self._skipped_since = self._skipped_since, []
                if job is None:
                    return
                self._idle = False
            if skipped:
                self.on_event("store.skipped", iterations=skipped, total=self.counters.skipped,
                              next=job.iteration)
            iteration = job.iteration
            try:
                self.store.put_snapshot(job.files)
                self.store.retain()
            except Exception as exc:          # the store's errors are many (OSError, botocore's, ...)
                failures += 1
                with self._cond:
                    self.counters.failed += 1
                    closing = self._closing
                    if self._pending is None and not closing:
                        self._pending, job = job, None          # retried, unless a newer one comes
                    elif not closing:
                        self.counters.skipped += 1
                        self._skipped_since.append(job.iteration)
                log.warning("%s: upload of iteration %s failed (%s); next attempt in %.1f s",
                            self.store.url, iteration, exc, delay)
                self.on_event("store.failed", url=self.store.url, iteration=iteration,
                              error=f"{type(exc).__name__}: {exc}",
                              attempt=failures, retry_in_s=delay)
                if job is not None:
                    shutil.rmtree(job.files, ignore_errors=True)
                if closing:
                    self.on_event("store.abandoned", url=self.store.url, reason="upload failed at shutdown")
                    with self._cond:
                        self._idle = True
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._idle = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._closing, delay)
                delay = min(2 * delay, self.retry_max_s)
                continue
            shutil.rmtree(job.files, ignore_errors=True)
            with self._cond:
                self.counters.uploaded += 1
                self.counters.last_uploaded = job.iteration
                self._idle = True
                self._cond.notify_all()
            self.on_event("store.uploaded", url=self.store.url, iteration=job.iteration)
            if failures:
                self.on_event("store.resumed", url=self.store.url, iteration=job.iteration, failed=failures)
            failures, delay = 0, self.retry_min_s
