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
always stays (after a resync to an older checkpoint it can be an older iteration).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from gradtap.core.errors import ConfigError, GradtapError

FORMAT = "gradtap-snapshot/1"
LATEST = "LATEST"
PREFIX = "iteration-"
TMP_PREFIX = ".tmp-"
FILES = ("model.pt", "optimizer.pt")


class _HashingWriter:
    """A file object for ``torch.save`` that hashes what it writes."""

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: Any, path: Path) -> str:
    """``torch.save`` to ``path``, fsynced; returns the file's sha256."""
    with open(path, "xb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        f.flush()
        os.fsync(f.fileno())
    return writer.sha256.hexdigest()


def _write_small(path: Path, text: str) -> None:
    with open(path, "x") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
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
            got = _sha256(path / name)
        except OSError as exc:
            raise GradtapError(f"{path}: {name} is unreadable ({exc.strerror})") from None
        if got != want:
            raise GradtapError(f"{path}: {name} has sha256 {got[:16]}…, "
                               f"the manifest says {str(want)[:16]}…")
    return manifest


def _latest_path(directory: Path) -> Path:
    try:
        name = (directory / LATEST).read_text().strip()
    except OSError:
        raise GradtapError(f"{directory}: no {LATEST} file; no snapshot was completed there") from None
    if not name.startswith(PREFIX) or "/" in name:
        raise GradtapError(f"{directory}/{LATEST} names {name!r}, not a snapshot directory")
    return directory / name


def latest(directory: str | Path) -> Path:
    """The snapshot ``LATEST`` names in ``directory``, verified (``GradtapError`` if none)."""
    path = _latest_path(Path(directory))
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


class Snapshots:
    """The snapshot directory of one job, with its policy.

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
    """

    def __init__(self, directory: str | Path, job: str, *, every: int | None = None, keep: int = 3):
        if every is not None and every < 1:
            raise ConfigError(f"snapshot every: {every} must be at least 1 iteration (or unset)")
        if keep < 1:
            raise ConfigError(f"snapshot keep: {keep} must be at least 1")
        self.directory = Path(directory)
        self.job, self.every, self.keep = job, every, keep
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.directory / ".lock", "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise GradtapError(f"{self.directory}: another process is writing snapshots there") from None
        for stale in self.directory.glob(TMP_PREFIX + "*"):    # left by a writer that was killed
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        if (self.directory / LATEST).exists():
            other = verify(_latest_path(self.directory)).get("job")
            if other != job:
                self.close()
                raise ConfigError(f"{self.directory}: holds snapshots of job {other!r}, not {job!r}; "
                                  "give each job its own snapshot directory")

    def close(self, replica=None) -> None:
        """Release the directory; with ``replica``, first write its final snapshot (a clean
        shutdown), unless it is stale, whose state is not the trainer's."""
        try:
            if replica is not None and not replica.stale:
                self.write_replica(replica)
        finally:
            self._lock.close()

    def due(self, iteration: int) -> bool:
        """Whether a state ready for ``iteration`` falls on the ``every`` schedule."""
        return self.every is not None and iteration > 0 and iteration % self.every == 0

    def write(self, state: dict[str, Any], *, step: int) -> Path:
        """Write ``state`` (``Replica.state_dict()``) as a snapshot and point ``LATEST`` at it.

        Returns its directory. Blocks until everything is on disk.
        """
        iteration = int(state["iteration"])
        final = self.directory / snapshot_name(iteration)
        if final.exists():
            try:
                verify(final)
            except GradtapError:
                shutil.rmtree(final)
            else:
                self._point_latest(final.name)
                return final
        tmp = self.directory / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        sums = {"model.pt": _save(state["model"], tmp / "model.pt"),
                "optimizer.pt": _save(state["optimizer"], tmp / "optimizer.pt")}
        manifest = {"format": FORMAT, "job": self.job, "iteration": iteration, "step": int(step),
                    "created_unix": time.time(), "torch": torch.__version__, "sha256": sums}
        _write_small(tmp / "manifest.json", json.dumps(manifest, indent=1) + "\n")
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        self._point_latest(final.name)
        self._retain(final.name)
        return final

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

    def _point_latest(self, name: str) -> None:
        tmp = self.directory / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        _write_small(tmp, name + "\n")
        os.rename(tmp, self.directory / LATEST)
        _fsync_dir(self.directory)

    def _retain(self, latest_name: str) -> None:
        """Keep the ``keep`` most recently written snapshots (LATEST is always one of them)."""
        def written(path: Path) -> float:
            try:
                return float(json.loads((path / "manifest.json").read_text())["created_unix"])
            except (OSError, ValueError, KeyError, TypeError):
                return float("-inf")          # unreadable: the first to go

        for old in sorted(self.snapshots(), key=written)[:-self.keep]:
            if old.name != latest_name:
                # Out of the snapshot namespace first (atomic), so a kill mid-delete leaves
                # a temporary directory for the next writer, never a half snapshot.
                doomed = self.directory / f"{TMP_PREFIX}{old.name}-deleted-{os.getpid()}"
                os.rename(old, doomed)
                shutil.rmtree(doomed)
