"""Atomic snapshots of the replica that a trainer loads with two standard PyTorch calls.

Layout of a snapshot directory (``Snapshots.directory``)::

    LATEST                        one line: the name of the newest complete snapshot
    iteration-000120/
        model.pt                  torch.save(model state_dict)
        optimizer.pt              torch.save(Adam/AdamW state_dict)
        manifest.json             job, iteration, step, sha256 of both files
    iteration-000130/ ...

``iteration`` is the trainer's convention (``truth/start.pt``): the next iteration the
state is ready for, i.e. the state after iterations ``0 .. iteration - 1``. A trainer
resumes with::

    model.load_state_dict(torch.load(snap / "model.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(snap / "optimizer.pt", weights_only=True))

where ``snap = latest(directory)`` (or ``directory / open(directory / "LATEST").read().strip()``)
and training continues at ``manifest["iteration"]``.

Atomicity. A snapshot is written into a temporary directory next to the others, every
file is fsynced, the manifest goes last, the directory is fsynced and renamed into place,
and the parent is fsynced. ``LATEST`` is then replaced the same way (temporary file,
fsync, rename, fsync of the directory). So at every instant ``LATEST`` names a directory
whose files are complete and match its manifest, and a process killed at any point leaves
the previous snapshot untouched; its temporary directory is removed by the next writer.
Only one writer per directory is allowed (an ``fcntl`` lock enforces it).

Retention keeps the ``keep`` most recently written snapshots, so the one ``LATEST`` names
always stays (after a resync to an older checkpoint it can be an older iteration). The
snapshots retention would drop once the new one is complete are dropped before it is
written, except the one ``LATEST`` names: ``keep: K`` needs room for K snapshots (2 when
K is 1), never K + 1.

Disk space. Before writing, the free space of the directory's filesystem is compared with
the snapshot's size (its tensors' bytes, plus the files' overhead). A snapshot that does
not fit, or whose writing fails (``ENOSPC``, a read-only remount, an I/O error), raises
:class:`SnapshotWriteError` saying what happened and what to do; nothing of it is left on
disk and ``LATEST`` still names the previous snapshot. The caller decides what follows
(the appliance logs an event, keeps updating its replica in memory, and tries again at the
next snapshot due).

Writing in the background. ``Snapshots`` writes on the caller's thread (:meth:`Snapshots.write`,
:meth:`Snapshots.write_replica`). Given ``buffers`` >= 1, the appliance's sink hands due
snapshots to :class:`gradtap.store.snapshot_writer.SnapshotWriter` instead: the update path
copies the replica's state into one of ``buffers`` pre-allocated copies and goes on, and one
thread writes it here as above; a snapshot due while every buffer is still waiting or being
written is skipped and counted. :meth:`Snapshots.close` lets that writer finish first. Every
write, from either thread, holds :attr:`Snapshots.write_lock`, so they never interleave.

Counted. :meth:`Snapshots.counts` holds ``written``, ``failed`` and ``skipped`` (and the newest
iteration written); the ``snapshot.*`` events say the same as it happens (``on_event``):
``snapshot.failed`` once per run of failures (again if the reason changes) and
``snapshot.resumed`` at the first success after them; ``snapshot.skipped`` at the first skip
of a run of skips and ``snapshot.caught_up`` (the iterations skipped) when the next is taken.

Ownership. A directory holds the snapshots of one replica: :class:`Snapshots` given the
replica's :class:`~gradtap.updater.replica_origin.ReplicaOrigin` records it in
``ORIGIN.json`` and refuses a directory that holds another replica's snapshots, unless
told to clear them (``force``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.updater.replica_origin import ORIGIN, ReplicaOrigin, origin_json, parse_origin

log = logging.getLogger(__name__)

FORMAT = "gradtap-snapshot/1"
LATEST = "LATEST"
PREFIX = "iteration-"
TMP_PREFIX = ".tmp-"
FILES = ("model.pt", "optimizer.pt")
# Bytes a snapshot needs beyond its tensors' storage: torch.save's zip records (measured
# 350-460 B per tensor with torch 2.x, taken as 1 KiB) and, per file and for the
# directory, up to one filesystem block of rounding; plus the manifest and LATEST.
RECORD_OVERHEAD = 1024
SMALL_FILES = 64 * 1024
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class SnapshotWriteError(GradtapError):
    """A snapshot could not be written. Nothing of it is left on disk, and ``LATEST`` still
    names the previous snapshot. ``reason`` is ``disk_full``, ``read_only`` or ``io_error``;
    ``needed_bytes``/``free_bytes`` are set when the space check refused it."""

    def __init__(self, message: str, *, directory: Path, iteration: int, reason: str,
                 needed_bytes: int | None = None, free_bytes: int | None = None):
        super().__init__(message)
        self.directory, self.iteration, self.reason = directory, iteration, reason
        self.needed_bytes, self.free_bytes = needed_bytes, free_bytes


@dataclass
class SnapshotCounters:
    written: int = 0                     # snapshots complete on disk (LATEST named each)
    failed: int = 0                      # writes that raised SnapshotWriteError
    skipped: int = 0                     # due while every buffer of the background writer was busy: not taken
    last_written: int | None = None      # the iteration of the newest written

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _no_events(kind: str, **fields) -> None:
    del kind, fields


class _HashingWriter:
    """A file object for ``torch.save`` that hashes what it writes."""

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.sha256.update(data)
        try:
            return self.f.write(data)
        except OSError as exc:          # torch.save reports it as "unexpected pos"
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> str:
    """``torch.save`` to ``path``, fsynced; returns the file's sha256. A failed write raises
    its ``OSError`` (torch.save would turn it into a ``RuntimeError`` about positions)."""
    with open(path, "xb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return writer.sha256.hexdigest()


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def snapshot_bytes(state: dict[str, Any], block: int) -> int:
    """An upper estimate of the bytes a snapshot of ``state`` takes on a filesystem of
    ``block``-byte blocks: every storage ``torch.save`` writes, once, plus the overhead."""
    storages: dict[int, int] = {}
    count = 0
    for part in ("model", "optimizer"):
        for t in _tensors(state[part]):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
            count += 1
    return sum(storages.values()) + RECORD_OVERHEAD * count + (len(FILES) + 2) * block + SMALL_FILES


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _write_small(path: Path, text: str) -> None:
    with open(path, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def snapshot_name(iteration: int) -> str:
    return f"{PREFIX}{iteration:06d}"


def verify(path: str | Path) -> dict[str, Any]:
    """The manifest of the snapshot at ``path`` after checking every file's sha256.

    Raises ``GradtapError`` when it is incomplete or does not match its manifest.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise GradtapError(f"{path}: no readable manifest.json ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise GradtapError(f"{path}: manifest format {manifest.get('format')!r} is not {FORMAT!r}")
    for name in FILES:
        want = manifest.get("sha256", {}).get(name)
        try:
            got = file_sha256(path / name)
        except OSError as exc:
            raise GradtapError(f"{path}: {name} is unreadable ({exc.strerror})") from None
        if got != want:
            raise GradtapError(f"{path}: {name} has sha256 {got[:16]}…, "
                               f"the manifest says {str(want)[:16]}…")
    return manifest


def named_latest(directory: str | Path) -> Path:
    """The snapshot ``LATEST`` names in ``directory``, not yet verified: for a reader that
    verifies it anyway as it loads (``load``), so that its files are hashed once."""
    directory = Path(directory)
    try:
        name = (directory / LATEST).read_text().strip()
    except OSError:
        raise GradtapError(f"{directory}: no {LATEST} file; no snapshot was completed there") from None
    if not name.startswith(PREFIX) or "/" in name:
        raise GradtapError(f"{directory}/{LATEST} names {name!r}, not a snapshot directory")
    return directory / name


def latest(directory: str | Path) -> Path:
    """The snapshot ``LATEST`` names in ``directory``, verified (``GradtapError`` if none)."""
    path = named_latest(directory)
    verify(path)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """``{"model", "optimizer", "iteration"}`` of a verified snapshot (a checkpoint dict that
    ``Replica`` and ``Replica.resync`` accept)."""
    manifest = verify(path)
    path = Path(path)
    return {"model": torch.load(path / "model.pt", weights_only=True),
            "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
            "iteration": int(manifest["iteration"])}


def _discard(path: Path) -> None:
    """Remove a snapshot directory: out of the snapshot namespace first (atomic), so a kill
    mid-delete leaves a temporary directory for the next writer, never a half snapshot.
    Best effort: what cannot be removed stays, under a temporary name when possible."""
    doomed = path.with_name(f"{TMP_PREFIX}{path.name}-deleted-{os.getpid()}")
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


class Snapshots:
    """The snapshot directory of one replica, with its policy.

    Parameters
    ----------
    directory:
        Where snapshots go (created if missing).
    job:
        The job's name, recorded in every manifest and checked against existing ones.
    every:
        Write one every ``every`` iterations (:meth:`due`); ``None``: only on request.
    keep:
        How many snapshots to keep (at least 1).
    origin:
        The replica's origin (``ReplicaOrigin.of(replica)``, taken before its first
        iteration), recorded in ``ORIGIN.json``. A directory that records another origin,
        or holds snapshots but records none, is refused (``ConfigError``). ``None``: no
        origin is recorded or checked (a directory of snapshots only).
    force:
        Clear a directory holding another replica's snapshots instead of refusing it.
    continues:
        Where the replica's start state was loaded from (``--start``). When that is one of
        this directory's snapshots, the run continues the replica the directory records: its origin is kept, not refused for the new start state, provided
        the job and its spec sections are the same (a restart in place after a crash).
    uploader:
        The durable tier (:class:`gradtap.store.uploader.Uploader`): every snapshot written
        is handed to it once, as hard links in a staging directory here, and :meth:`close` gives
        it ``close_timeout_s`` to upload the last one.
    buffers:
        Copies of the replica's state for writing in the background (each as large as the
        replica's parameters and both moments: 12 B per parameter); 0: the sink writes each
        snapshot on the update path (``gradtap/replica_sink.py``). :meth:`write` and
        :meth:`write_replica` always write on the caller's thread.
    on_event:
        ``on_event(kind, **fields)`` for the ``snapshot.*`` events (``ControlPlane.event``; the
        sink sets it); called from the update path and from the background writer's thread.
    """

    def __init__(self, directory: str | Path, job: str, *, every: int | None = None, keep: int = 3,
                 origin: ReplicaOrigin | None = None, force: bool = False, continues: Path | None = None,
                 uploader=None, close_timeout_s: float = 60.0, buffers: int = 0, on_event=_no_events):
        if every is not None and every < 1:
            raise ConfigError(f"snapshot every: {every} must be at least 1 iteration (or unset)")
        if keep < 1:
            raise ConfigError(f"snapshot keep: {keep} must be at least 1")
        if buffers < 0:
            raise ConfigError(f"snapshot buffers: {buffers} must be at least 0 (0: each snapshot is written on the "
                              "update path; 1 or more: in the background)")
        self.directory = Path(directory)
        self.job, self.every, self.keep, self.buffers = job, every, keep, buffers
        self.uploader, self.close_timeout_s = uploader, close_timeout_s
        self.on_event = on_event
        self.write_lock = threading.Lock()       # held for the whole of every write, whichever thread writes
        self.counters = SnapshotCounters()
        self._counting = threading.Lock()
        self._failure: SnapshotWriteError | None = None   # the first of a run of failed writes
        self._failed_run = 0
        self._skips: list[int] = []              # iterations skipped since the last snapshot taken
        self._background = None                  # the SnapshotWriter writing here (it attaches itself)
        self._handed: int | None = None          # the iteration last handed to the uploader
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.directory / ".lock", "a")
        except OSError as exc:
            raise ConfigError(f"{self.directory}: cannot write snapshots there ({exc.strerror}); give an output "
                              "directory this process can write (--out; is its filesystem mounted "
                              "read-only?)") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise GradtapError(f"{self.directory}: another process is writing snapshots there") from None
        try:
            for stale in self.directory.glob(TMP_PREFIX + "*"):    # left by a writer that was killed
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
            if origin is not None:
                self._claim(origin, force, continues)
            if (self.directory / LATEST).exists():
                other = verify(named_latest(self.directory)).get("job")
                if other != job:
                    raise ConfigError(f"{self.directory}: holds snapshots of job {other!r}, not {job!r}; "
                                      "give each job its own snapshot directory")
        except OSError as exc:
            self._lock.close()
            raise ConfigError(f"{self.directory}: cannot use it for snapshots ({exc.strerror}); give an output "
                              "directory this process can read and write (--out)") from None
        except BaseException:
            self._lock.close()
            raise

    def _claim(self, origin: ReplicaOrigin, force: bool, continues: Path | None) -> None:
        """Make the directory ``origin``'s: it already is, the run continues from one of its
        snapshots (``continues``), it holds nothing, or (``force``) it is cleared; otherwise
        refuse it."""
        recorded_path = self.directory / ORIGIN
        text = recorded_path.read_text() if recorded_path.exists() else None
        recorded = None if text is None else parse_origin(text)
        if recorded == origin:
            return
        if recorded is not None and continues is not None and self._holds(continues) \
                and recorded.differences(origin) == ["the start state"]:
            log.info("%s: continuing %s from its snapshot %s", self.directory, recorded.describe(), continues)
            return
        held = text is not None or (self.directory / LATEST).exists() or bool(self.snapshots())
        if held and not force:
            if recorded is None:
                whose = f"holds snapshots of an unknown replica (no readable {ORIGIN} records whose they are)"
                what = ""
            else:
                whose = f"holds the snapshots of {recorded.describe()}"
                differ = recorded.differences(origin)
                what = f" ({' and '.join(differ)} {'differs' if len(differ) == 1 else 'differ'})"
            newest = self._latest_name()
            resume = f" (to continue that replica after a restart: --start {self.directory / newest}, its " \
                     "newest snapshot)" if newest and recorded is not None and \
                     recorded.differences(origin) == ["the start state"] else ""
            raise ConfigError(f"{self.directory}: {whose}; this run is {origin.describe()}{what}. Give this run "
                              f"another output directory (--out){resume}, or pass --force to clear "
                              f"{self.directory} and begin it anew")
        if held:
            log.warning("%s: clearing the snapshots of another replica (force)", self.directory)
            (self.directory / LATEST).unlink(missing_ok=True)   # first: nothing names the old replica's state
            fsync_dir(self.directory)
            for old in self.snapshots():
                _discard(old)
        self._replace_small(ORIGIN, origin_json(origin))

    def _holds(self, path: Path) -> bool:
        """``path`` is one of this directory's snapshots (symbolic links resolved)."""
        return os.path.dirname(os.path.realpath(path)) == os.path.realpath(self.directory)

    def attach(self, writer) -> None:
        """``writer`` (a :class:`gradtap.store.snapshot_writer.SnapshotWriter`) writes here in
        the background: :meth:`close` lets it finish first."""
        if self._background is not None:
            raise GradtapError(f"{self.directory}: a background writer is already attached")
        self._background = writer

    def close(self, replica=None) -> None:
        """Release the directory; first let the background writer write every snapshot taken
        (it waits for the disk), then, with ``replica``, write its final snapshot (a clean
        shutdown), unless it is stale, whose state is not the trainer's."""
        try:
            if self._background is not None:
                self._background.close()
            if replica is not None and not replica.stale:
                self.write_replica(replica)
        finally:
            try:
                if self.uploader is not None:
                    self.uploader.close(self.close_timeout_s)
            finally:
                self._lock.close()

    def due(self, iteration: int) -> bool:
        """Whether a state ready for ``iteration`` falls on the ``every`` schedule."""
        return self.every is not None and iteration > 0 and iteration % self.every == 0

    def next_due(self, iteration: int) -> int | None:
        """The first iteration after ``iteration`` on the ``every`` schedule."""
        return None if self.every is None else (iteration // self.every + 1) * self.every

    def write(self, state: dict[str, Any], *, step: int) -> Path:
        """Write ``state`` (``Replica.state_dict()``) as a snapshot and point ``LATEST`` at it.

        Returns its directory. Blocks until everything is on disk (and until a write of
        another thread is over). Raises :class:`SnapshotWriteError` when it does not fit or
        cannot be written.
        """
        with self.write_lock:
            try:
                final = self._write(state, step)
            except Exception:
                with self._counting:
                    self.counters.failed += 1
                raise
        with self._counting:
            self.counters.written += 1
            self.counters.last_written = int(state["iteration"])
        return final

    def _write(self, state: dict[str, Any], step: int) -> Path:
        iteration = int(state["iteration"])
        final = self.directory / snapshot_name(iteration)
        try:
            if final.exists():
                try:
                    verify(final)
                except GradtapError:
                    _discard(final)
                else:
                    self._replace_small(LATEST, final.name + "\n")
                    if iteration != self._handed:    # not again (the final write at close): once is counted once
                        self._upload(final, iteration)
                    return final
            for old in self._expiring(new=1):
                _discard(old)
            self._check_space(state, iteration)
            self._write_new(state, step, final)
        except OSError as exc:
            raise self._failed(exc, iteration) from None
        self._upload(final, iteration)
        self._retain()
        return final

    def counts(self) -> dict:
        """``written``, ``failed``, ``skipped``, ``last_written`` (thread-safe)."""
        with self._counting:
            return self.counters.as_dict()

    # -- the events of the update path's snapshots (the sink's and the background writer's) --

    def note_written(self, iteration: int, path: Path) -> None:
        """A due snapshot was written: ``snapshot.resumed`` if it ends a run of failures."""
        if self._failure is not None:
            self.on_event("snapshot.resumed", iteration=iteration, snapshot=str(path), missed=self._failed_run)
            self._failure, self._failed_run = None, 0

    def note_failed(self, exc: SnapshotWriteError) -> None:
        """A due snapshot failed: logged, and ``snapshot.failed`` once per run of failures
        (again when the reason changes); the replica goes on in memory."""
        log.error("%s", exc)
        failing, self._failure = self._failure, exc
        self._failed_run += 1
        if failing is None or failing.reason != exc.reason:
            self.on_event("snapshot.failed", iteration=exc.iteration, directory=str(exc.directory),
                          reason=exc.reason, error=str(exc), needed_bytes=exc.needed_bytes,
                          free_bytes=exc.free_bytes, next_attempt=self.next_due(exc.iteration),
                          replica="updating in memory")

    def note_skipped(self, iteration: int, writing: int | None) -> None:
        """The snapshot due at ``iteration`` was not taken: the background writer still
        writes ``writing`` and no buffer is free. ``snapshot.skipped`` at the first of a run."""
        with self._counting:
            self.counters.skipped += 1
        if not self._skips:
            log.warning("%s: snapshot of iteration %d skipped: the disk is still writing iteration %s", self.directory,
                        iteration, writing)
            self.on_event("snapshot.skipped", iteration=iteration, writing=writing, directory=str(self.directory),
                          reason="no free buffer: the disk is slower than the snapshot rate",
                          next_attempt=self.next_due(iteration))
        self._skips.append(iteration)

    def note_taken(self, iteration: int) -> None:
        """A due snapshot was taken (copied for the background writer): ``snapshot.caught_up``,
        naming the iterations skipped, if it ends a run of skips."""
        if self._skips:
            self.on_event("snapshot.caught_up", iteration=iteration, skipped=self._skips)
            self._skips = []

    def _upload(self, final: Path, iteration: int) -> None:
        """Hand ``final`` to the uploader as hard links (cheap: no data is copied), so that
        retention here may drop it before it goes; a staging failure is logged, not raised."""
        if self.uploader is None:
            return
        staged = self.directory / f"{TMP_PREFIX}upload-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        try:
            staged.mkdir()
            for name in (*FILES, "manifest.json"):
                os.link(final / name, staged / name)
        except OSError as exc:
            shutil.rmtree(staged, ignore_errors=True)
            log.error("%s: cannot stage %s for the store (%s); it is not uploaded", self.directory, final.name,
                      exc.strerror)
            return
        self.uploader.submit(iteration, staged)
        self._handed = iteration

    def write_replica(self, replica) -> Path:
        """Snapshot a :class:`gradtap.updater.replica.Replica` between iterations (no copy).

        A stale replica is refused: its state is not the trainer's, and ``LATEST`` only ever
        names states that are.
        """
        if replica.stale:
            raise GradtapError(f"{self.directory}: the replica is stale (iteration {replica.iteration} "
                               "was not applied); resync it before snapshotting")
        return self.write(replica.state_dict(copy=False), step=replica.step)

    def snapshots(self) -> list[Path]:
        """Snapshot directories, oldest first (by iteration)."""
        found = [p for p in self.directory.glob(PREFIX + "*")
                 if p.is_dir() and p.name[len(PREFIX):].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))

    def _latest_name(self) -> str | None:
        try:
            return (self.directory / LATEST).read_text().strip()
        except OSError:
            return None

    def _write_new(self, state: dict[str, Any], step: int, final: Path) -> None:
        """Write the snapshot into a temporary directory, rename it to ``final`` and point
        ``LATEST`` at it; on any failure remove what was written."""
        tmp = self.directory / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            sums = {"model.pt": _save(state["model"], tmp / "model.pt"),
                    "optimizer.pt": _save(state["optimizer"], tmp / "optimizer.pt")}
            manifest = {"format": FORMAT, "job": self.job, "iteration": int(state["iteration"]),
                        "step": int(step), "created_unix": time.time(), "torch": torch.__version__,
                        "sha256": sums}
            _write_small(tmp / "manifest.json", json.dumps(manifest, indent=1) + "\n")
            fsync_dir(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            fsync_dir(self.directory)
            self._replace_small(LATEST, final.name + "\n")
        except BaseException:
            if self._latest_name() != final.name:      # complete, but nothing names it: the space back
                _discard(final)
            raise

    def _replace_small(self, name: str, text: str) -> None:
        """Replace the small file ``name`` atomically (temporary file, fsync, rename, fsync)."""
        tmp = self.directory / f"{TMP_PREFIX}{name}-{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            _write_small(tmp, text)
            os.rename(tmp, self.directory / name)
        except BaseException:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass                                    # the next writer removes it
            raise
        fsync_dir(self.directory)

    def _expiring(self, new: int) -> list[Path]:
        """The snapshots retention drops once ``new`` more are written: all but the ``keep - new``
        most recently written, never the one ``LATEST`` names (until it is replaced, it is the
        only complete state)."""
        def written(path: Path) -> float:
            try:
                return float(json.loads((path / "manifest.json").read_text())["created_unix"])
            except (OSError, ValueError, KeyError, TypeError):
                return float("-inf")          # unreadable: the first to go

        old = sorted(self.snapshots(), key=written)
        latest = self._latest_name()
        return [p for p in old[:max(0, len(old) - max(0, self.keep - new))] if p.name != latest]

    def _retain(self) -> None:
        """Keep the ``keep`` most recently written snapshots (LATEST is always one of them). A
        snapshot that cannot be removed is logged, not raised: the new one is complete."""
        for old in self._expiring(new=0):
            _discard(old)
            if old.exists():
                log.warning("%s: could not remove the expired snapshot %s", self.directory, old.name)

    def _check_space(self, state: dict[str, Any], iteration: int) -> None:
        fs = os.statvfs(self.directory)
        free = fs.f_bavail * fs.f_frsize
        needed = snapshot_bytes(state, fs.f_frsize)
        if needed > free:
            raise SnapshotWriteError(
                f"{self.directory}: disk full: the snapshot of iteration {iteration} needs about {_mib(needed)} "
                f"and its filesystem has {_mib(free)} free; nothing was written, and {self._still()}. "
                f"Free space there, give the appliance an output directory (--out) on a larger filesystem, or "
                f"keep fewer snapshots (appliance.snapshot_keep: {self.keep}, each about {_mib(needed)})",
                directory=self.directory, iteration=iteration, reason="disk_full", needed_bytes=needed,
                free_bytes=free)

    def _still(self) -> str:
        latest = self._latest_name()
        return f"{LATEST} still names {latest}" if latest else "there is no earlier snapshot"

    def _failed(self, exc: OSError, iteration: int) -> SnapshotWriteError:
        """The :class:`SnapshotWriteError` of an ``OSError`` raised while writing."""
        what = exc.strerror or str(exc)
        if exc.errno in DISK_FULL:
            reason, head, advice = "disk_full", "disk full: ", (
                "Free space there, give the appliance an output directory (--out) on a larger filesystem, or "
                f"keep fewer snapshots (appliance.snapshot_keep: {self.keep})")
        elif exc.errno in NOT_WRITABLE:
            reason, head, advice = "read_only", "", (
                "Make the directory writable again (was its filesystem remounted read-only?), or give the "
                "appliance another output directory (--out)")
        else:
            reason, head, advice = "io_error", "", "Check the disk (the kernel log names the device's errors)"
        return SnapshotWriteError(f"{self.directory}: {head}cannot write the snapshot of iteration {iteration} "
                                  f"({what}); what was written of it is removed, and {self._still()}. {advice}",
                                  directory=self.directory, iteration=iteration, reason=reason)
