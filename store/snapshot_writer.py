"""Local snapshots written in the background: the update path copies, one thread writes.

A snapshot of GPT-2 small is 1.5 GB of parameters and Adam moments; serialising, hashing and
fsyncing it takes seconds, several iterations of a real training job. Written on the update
path (:meth:`Snapshots.write_replica`) it stalls the replica for that long. Here the update
path only copies the replica's flat state (``updater/state.py``: parameters, ``exp_avg``,
``exp_avg_sq``, three memcpys) into a free :class:`StateBuffer`, and goes on; one thread, at
the uploader's niceness, writes it with :meth:`Snapshots.write`: the same temporary
directory, fsyncs, manifest last, renames and ``LATEST``, the same retention, the same hand-over
to the uploader, in the order the snapshots were taken. What is written is what
:meth:`Snapshots.write_replica` would have written at that moment, byte for byte.

**Bounded.** ``Snapshots.buffers`` copies are allocated (and touched, so that their pages are
resident) once, when the writer is made, and reused. A snapshot due while every buffer is
waiting or being written is not taken: it is counted as skipped (``snapshot.skipped`` at the
first of a run, ``snapshot.caught_up`` naming them when one is taken again). The replica never
waits for the disk. One buffer (12 B per parameter) suffices to keep the disk busy; a second
absorbs a write that runs a little longer than the snapshot interval, at the same cost again.

**Failures** (a full disk, a read-only remount, an I/O error) are ``snapshot.failed`` events
from the writer's thread, once per run of failures, and ``snapshot.resumed`` at the next
success, as for snapshots written on the update path; the buffer is free again either way.

**Shutdown.** :meth:`Snapshots.close` calls :meth:`SnapshotWriter.close`, which waits until
every snapshot taken is written, then writes the final snapshot. A process killed meanwhile
loses at most the snapshots not yet renamed into place; ``LATEST`` names a complete one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradtap.core.errors import GradtapError
from gradtap.store.snapshot import Snapshots, SnapshotWriteError, snapshot_name
from gradtap.store.uploader import NICE

log = logging.getLogger(__name__)

FLAT = ("param", "exp_avg", "exp_avg_sq")      # the FlatState arrays a snapshot copies
BUFFERS = 1             # the sensible number: one copy (12 B per parameter) keeps the disk busy


class StateBuffer:
    """One copy of a replica's changing state: its three flat float32 arrays (``numel``
    elements each), allocated and touched once."""

    def __init__(self, numel: int):
        self.arrays = {name: np.empty(numel, np.float32) for name in FLAT}
        for array in self.arrays.values():
            array.fill(0)                       # fault the pages in now, not on the update path

    def fill(self, replica) -> dict[str, Any]:
        """Copy ``replica``'s state (between iterations) and return the ``state_dict`` that
        :meth:`Snapshots.write` takes, with every tensor of the replica's flat state replaced
        by the same view of this copy. Other tensors (model buffers, the step) are not changed
        in place by the replica, and are kept as they are."""
        state = replica.state_dict(copy=False)
        spans = []
        for name in FLAT:
            source, copy = getattr(replica.state, name), self.arrays[name]
            if source.shape != copy.shape or source.dtype != copy.dtype:
                raise GradtapError(f"snapshot buffer: the replica's {name} is {source.dtype}{source.shape}, the "
                                   f"buffer {copy.dtype}{copy.shape}; a replica of another size cannot be copied")
            np.copyto(copy, source)
            spans.append((source.ctypes.data, source.nbytes, copy))
        return _rebase(state, spans, {})


def _rebase(obj: Any, spans: list[tuple[int, int, np.ndarray]], memo: dict[int, Any]) -> Any:
    """``obj`` with each tensor that views one of ``spans`` (address, bytes, copy) replaced by
    the same view of the copy. A tensor met twice (a tied weight under two names) is replaced
    by one tensor, so that ``torch.save`` stores it once, as it does the original."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = _rebased_tensor(obj, spans)
        return memo[id(obj)]
    if isinstance(obj, dict):           # a dict or an OrderedDict, as torch.save would see it
        return type(obj)((k, _rebase(v, spans, memo)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_rebase(v, spans, memo) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebase(v, spans, memo) for v in obj)
    return obj


def _rebased_tensor(t: torch.Tensor, spans: list[tuple[int, int, np.ndarray]]) -> torch.Tensor:
    if t.numel() == 0:
        return t
    address = t.data_ptr()
    for base, size, copy in spans:
        if base <= address < base + size:
            if not t.is_contiguous() or t.dtype != torch.float32:
                raise GradtapError(f"snapshot buffer: a {t.dtype} view of the replica's state that is not contiguous "
                                   "float32 cannot be copied")
            start = (address - base) // copy.itemsize
            return torch.from_numpy(copy[start:start + t.numel()]).view(t.shape)
    return t


@dataclass
class _Taken:
    iteration: int
    step: int
    state: dict[str, Any] | None
    buffer: StateBuffer


class SnapshotWriter:
    """Writes the snapshots the update path takes (:meth:`take`) into ``snapshots`` from one
    background thread, with ``snapshots.buffers`` copies of ``replica``'s state (at least 1).

    It attaches itself to ``snapshots``: :meth:`Snapshots.close` waits for it. Its events go
    to ``snapshots.on_event``.
    """

    def __init__(self, snapshots: Snapshots, replica):
        if snapshots.buffers < 1:
            raise GradtapError(f"{snapshots.directory}: a background writer needs at least one buffer "
                               f"(snapshot buffers: {snapshots.buffers})")
        self.snapshots = snapshots
        self._free = [StateBuffer(replica.layout.total) for _ in range(snapshots.buffers)]
        self._queue: deque[_Taken] = deque()
        self._writing: int | None = None       # the iteration being written
        self._cond = threading.Condition()
        self._closing = False
        snapshots.attach(self)
        self._thread = threading.Thread(target=self._loop, name="gradtap-snapshots", daemon=True)
        self._thread.start()

    # -- the update path: a copy, never I/O --

    def take(self, replica) -> Path | None:
        """Take the snapshot of ``replica`` (between iterations, not stale): copy its state
        into a free buffer for the writer. Returns the directory it will have once written,
        or None when no buffer is free (skipped, counted)."""
        if replica.stale:
            raise GradtapError(f"{self.snapshots.directory}: the replica is stale (iteration {replica.iteration} "
                               "was not applied); resync it before snapshotting")
        with self._cond:
            if self._closing:
                raise GradtapError(f"{self.snapshots.directory}: the background snapshot writer is closed")
            buffer = self._free.pop() if self._free else None
            busy = self._writing if self._writing is not None else self._queue[0].iteration if self._queue else None
        iteration = replica.iteration
        if buffer is None:
            self.snapshots.note_skipped(iteration, busy)
            return None
        try:
            taken = _Taken(iteration, replica.step, buffer.fill(replica), buffer)
        except BaseException:
            with self._cond:
                self._free.append(buffer)
            raise
        with self._cond:
            self._queue.append(taken)
            self._cond.notify_all()
        self.snapshots.note_taken(iteration)
        return self.snapshots.directory / snapshot_name(iteration)

    # -- shutdown and tests --

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken is written (or failed); False on ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._writing is None, timeout)

    def close(self) -> None:
        """Write every snapshot taken, then stop the thread (waits for the disk: a clean
        shutdown loses none of them)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # -- the writer thread --

    def _loop(self) -> None:
        try:            # as the uploader's: the update path wins the cores it shares with us
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (OSError, AttributeError):
            pass
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._writing = job.iteration
            try:
                self._write(job)
            finally:
                job.state = None                  # the views of the buffer go before it is reused
                with self._cond:
                    self._free.append(job.buffer)
                    self._writing = None
                    self._cond.notify_all()

    def _write(self, job: _Taken) -> None:
        snapshots = self.snapshots
        try:
            path = snapshots.write(job.state, step=job.step)
        except SnapshotWriteError as exc:
            snapshots.note_failed(exc)
            return
        except Exception as exc:                 # never silently: the thread goes on with the next one
            log.exception("%s: the snapshot of iteration %d could not be written", snapshots.directory,
                          job.iteration)
            snapshots.note_failed(SnapshotWriteError(
                f"{snapshots.directory}: cannot write the snapshot of iteration {job.iteration} "
                f"({type(exc).__name__}: {exc})", directory=snapshots.directory, iteration=job.iteration,
                reason="error"))
            return
        snapshots.note_written(job.iteration, path)
