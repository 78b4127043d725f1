"""Publishing a command's output directory whole: written beside ``out`` under a temporary
name, then renamed into place, so that a crash or an error never leaves a half-written ``out``
(``gradtap export``, ``gradtap restore --at``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gradtap.core.errors import ConfigError
from gradtap.store.snapshot import fsync_dir


def refuse_existing(out: Path, *, force: bool) -> None:
    """Fails early, before any work, when ``out`` exists and ``force`` was not given."""
    if Path(out).exists() and not force:
        raise ConfigError(f"--out {out}: exists; give a new directory, or --force to replace it")


@contextmanager
def published(out: Path, *, force: bool) -> Iterator[Path]:
    """Yields a fresh directory beside ``out``; when the block ends without an exception it
    becomes ``out`` (an existing ``out`` only with ``force``: moved aside first and removed once
    the new one is in place), otherwise it is removed."""
    out = Path(out)
    refuse_existing(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

