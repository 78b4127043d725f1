"""Real, small filesystems for tests of full and read-only disks: a size-limited tmpfs
mounted for the test (root only; the test is skipped, with the reason, where mount is not
permitted) and unmounted afterwards, and read-only bind mounts."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode:
        raise OSError(done.stderr.strip() or f"mount exited {done.returncode}")


@contextmanager
def tmpfs(where: Path, size: int):
    """A tmpfs of ``size`` bytes mounted at ``where`` (created) for the ``with`` block."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where))
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs at {where} ({exc}); these tests need root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextmanager
def read_only(where: Path):
    """``where`` (a directory) bind-mounted read-only onto itself for the ``with`` block: paths
    under it are read-only from then on, while files opened before stay as they were (a
    remount of the whole filesystem would be refused as busy)."""
    _mount("--bind", str(where), str(where))
    try:
        _mount("-o", "remount,bind,ro", str(where))
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def free_bytes(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def fill(path: Path, leave: int) -> Path:
    """A file under ``path`` that takes all the free space of its filesystem but ``leave`` bytes."""
    filler = path / "filler"
    size = free_bytes(path) - leave
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)
    return filler


def on_disk(directory: Path) -> int:
    """Bytes the files of ``directory`` occupy (allocated blocks)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())
