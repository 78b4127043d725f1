"""Trainer checkpoints the shell loads: the one a replica starts from, and the ones handed to
it for a resync.

A trainer checkpoint is ``{"model": state_dict, "optimizer": state_dict, "iteration": k}``
(``torch.save``d by the trainer, or the simulator's ``truth/start.pt``); a gradtap snapshot
directory holds the same as its ``model.pt``/``optimizer.pt`` pair.

Every file is read the same careful way, because an offered checkpoint comes from the
control endpoint (:func:`offered_checkpoint`): the path is resolved and, for an offer, must
lie under a directory the operator allowed; only a regular file is opened (checked before
opening and again on the open descriptor, so a FIFO or a device is never opened for
reading), and never more than ``max_bytes`` of it is read: an offered file is loaded in
place, each tensor read into its own memory (so that the file's bytes and its tensors are not
both held, 12 bytes per parameter each), never past the size it had when opened, and refused
if it changed while it was read. The bytes must be a ``torch.save`` zip archive with stored
(uncompressed) members, so loading them cannot take more memory than the file has, and
``torch.load`` runs with ``weights_only=True``. A file
that is missing, unreadable or not a regular file gets one answer, so that the answer does
not tell which (no existence oracle). What is checked here is the shape of a trainer
checkpoint; whether it is *this job's* model and optimizer is ``Replica.check_offer``'s
business.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import stat
import zipfile
from collections.abc import Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from gradtap.core.errors import ConfigError
from gradtap.store import snapshot
from gradtap.updater.replica import seed_checkpoint
from gradtap.workload.layout import job_params
from gradtap.workload.spec import JobSpec

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20

Progress = Callable[[int, int], None]       # (bytes read, of all to read)


def start_checkpoint(job: JobSpec, path: Path | None, progress: Progress | None = None) -> dict:
    """The checkpoint at ``path`` (``--start``), else the job's ``initial_state``: its
    checkpoint file, or the model built under its seed. Its iteration is the one the capture
    starts at; a job whose buckets are DDP's rebuilt ones cannot start at iteration 0 (DDP
    rebuilds them after it), so a start state of iteration 0 for it is refused rather than
    replayed into a replica the trainer never was. ``progress``: as :func:`load_checkpoint`'s."""
    given = path or job.initial_state.checkpoint
    start = seed_checkpoint(job, job.initial_state.seed or 0) if given is None else \
        load_checkpoint(Path(given), what="--start", progress=progress)
    if job.ddp.layout == "rebuilt" and int(start["iteration"]) == 0:
        source = f"--start {given}" if path else f"initial_state.checkpoint {given}" if given else \
            f"initial_state (seed {job.initial_state.seed or 0})"
        raise ConfigError(f"{source}: the start state is iteration 0, but job {job.name!r} has ddp.layout "
                          f"'rebuilt', whose traffic begins at iteration 1 (DDP rebuilds its buckets after "
                          f"iteration 0); give the trainer's checkpoint of the iteration the capture starts at "
                          f"(--start; `gradtap simulate` writes it as truth/start.pt), or ddp.layout: initial "
                          f"for a capture from iteration 0")
    return start


def load_checkpoint(path: Path, *, max_bytes: int | None = None, what: str = "checkpoint",
                    progress: Progress | None = None, mapped: bool = False) -> dict:
    """A trainer checkpoint file, or a gradtap snapshot directory, to resynchronise from
    (``ConfigError`` naming the path when it is neither). At most ``max_bytes`` are read
    (``None``: no limit). ``progress(done, total)`` hears the bytes read so far of all it
    reads (a snapshot's files twice: hashed, then loaded). ``mapped``: the tensors are mapped
    from the file (``torch.load(mmap=True)``), not read, for a caller that only checks the
    checkpoint's shape (``gradtap resync``) and should not hold 12 bytes per parameter for it."""
    path = Path(os.path.realpath(path))      # unlike Path.resolve, never raises (on a symlink loop)
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        is_dir = False        # reported by _open_regular, in the same words as any unreadable file
    if is_dir:
        return _load_snapshot(path, max_bytes, what, progress, mapped)
    with _open_regular(path, what) as f:
        meter = _Meter(progress, os.fstat(f.fileno()).st_size)
        return _checked(_load_in_place(f, max_bytes, path, what, meter=meter, mapped=mapped)[0], path, what)


def offered_checkpoint(path: str, allowed_dirs: Sequence[Path], max_bytes: int) -> dict:
    """The checkpoint a control request names: ``path`` must be absolute and lie, once its
    symbolic links are resolved, under one of ``allowed_dirs``; then as :func:`load_checkpoint`."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise ConfigError(f"checkpoint {path!r}: give an absolute path on the appliance's host")
    resolved = Path(os.path.realpath(path))      # lexical where nothing exists: no existence oracle
    if not any(resolved.is_relative_to(d) for d in allowed_dirs):
        raise ConfigError(f"checkpoint {path}: outside the directories this appliance takes checkpoints from "
                          f"({', '.join(map(str, allowed_dirs)) or 'none configured'}; gradtap run --resync-dir)")
    return load_checkpoint(resolved, max_bytes=max_bytes)


def offer_size_limit(job: JobSpec) -> int:
    """The bytes an offered checkpoint of ``job`` may have: its parameters and both Adam
    moments in float32, twice over (buffers, the archive's padding and pickles), plus 64 MiB."""
    numel = sum(p.numel for p in job_params(job))
    return 2 * 3 * 4 * numel + (64 << 20)


def _unreadable(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{what} {path}: not a readable regular file (it is missing, the appliance may not read it, "
                       "or it is a FIFO, device or socket)")


def _open_regular(path: Path | str, what: str, *, dir_fd: int | None = None, shown: Path | None = None) -> BinaryIO:
    """The regular file ``path`` (relative to ``dir_fd`` when given), open for reading; a
    symbolic link as its last part is refused (``path`` is resolved already)."""
    shown = shown or Path(path)
    try:
        if not stat.S_ISREG(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise _unreadable(shown, what)
        # O_NONBLOCK: should the file have become a FIFO since, opening it does not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except (OSError, ValueError) as exc:
        log.info("%s %s: %s", what, shown, exc)     # the operator's log says which; the answer does not
        raise _unreadable(shown, what) from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise _unreadable(shown, what)
    return f


class _Meter:
    """Bytes read so far, told to ``progress(done, total)`` (None: to nobody)."""

    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _load_in_place(f: BinaryIO, max_bytes: int | None, shown: Path, what: str,
                   sha256: str | None = None, meter: _Meter | None = None, mapped: bool = False) -> tuple[Any, int]:
    """``torch.load`` of the open file ``f`` where it lies (:class:`_Prefix`: each tensor read
    into its own memory, so that the file's bytes and its tensors are not both held), and the
    bytes read: never more than ``max_bytes`` (None: no limit), nor past the size the file had
    when opened. With ``sha256`` (a snapshot's manifest), the bytes are hashed first and must
    match. A file that changed meanwhile (``fstat``: size, mtime, ctime) is refused, so what was
    hashed and checked is what was loaded. Nothing else would see a file torn by a write during
    the load: ``torch.load`` checks no record's CRC (PyTorch builds miniz with
    ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``; pytorch/pytorch#28858 and #126952). ``meter``
    counts every byte read; ``mapped``: as :func:`load_checkpoint`'s."""
    opened = os.fstat(f.fileno())
    size = opened.st_size if max_bytes is None else _size_within(opened, max_bytes, shown, what)
    source = _Prefix(f, size, meter)
    if sha256 is not None:
        digest, chunk = hashlib.sha256(), bytearray(1 << 20)
        try:
            while n := source.readinto(chunk):
                digest.update(memoryview(chunk)[:n])
        except OSError as exc:
            raise ConfigError(f"{what} {shown}: reading failed ({exc.strerror})") from None
        if digest.hexdigest() != sha256:
            raise ConfigError(f"{what} {shown.parent}: {shown.name} does not match the sha256 in its {MANIFEST}")
    checkpoint = _torch_load(source, shown, what, mapped)
    if _changed(opened, os.fstat(f.fileno())):
        raise ConfigError(f"{what} {shown}: the file changed while it was read; give it once it is written")
    return checkpoint, size


def _size_within(opened: os.stat_result, max_bytes: int, shown: Path, what: str) -> int:
    """The size of the file ``opened`` describes, refused when it has more than ``max_bytes``."""
    if opened.st_size > max_bytes:
        raise ConfigError(f"{what} {shown}: {opened.st_size} bytes, more than the {max_bytes} this appliance reads "
                          "for the job's model")
    return opened.st_size


def _changed(before: os.stat_result, after: os.stat_result) -> bool:
    """Whether a file was written between two ``fstat`` calls on its open descriptor."""
    return (before.st_size, before.st_mtime_ns, before.st_ctime_ns) != (after.st_size, after.st_mtime_ns,
                                                                           after.st_ctime_ns)


class _Prefix(io.RawIOBase):
    """The first ``size`` bytes of the open file ``f``, read where the reader asks
    (``os.preadv`` into its buffer: ``torch.load`` reads each tensor into the tensor's own
    memory), never past them: bytes the file gains while it is read are not there, and bytes
    it loses read short, which ``torch.load`` refuses."""

    def __init__(self, f: BinaryIO, size: int, meter: _Meter | None = None):
        super().__init__()
        self._fd, self._size, self._pos, self._meter = f.fileno(), size, 0, meter or _Meter(None, size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset}, before the start of the file")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        want, done = max(0, min(len(view), self._size - self._pos)), 0
        while done < want:
            got = os.preadv(self._fd, [view[done:want]], self._pos + done)
            if got == 0:
                break
            done += got
        self._pos += done
        self._meter(done)
        return done


def _read_bounded(f: BinaryIO, max_bytes: int, shown: Path, what: str) -> bytes:
    """All of ``f``, refused when it has more than ``max_bytes`` (by its size, or while reading)."""
    _size_within(os.fstat(f.fileno()), max_bytes, shown, what)
    try:
        data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {shown}: reading failed ({exc.strerror})") from None
    if len(data) > max_bytes:
        raise ConfigError(f"{what} {shown}: grew past {max_bytes} bytes while being read")
    return data


def _torch_load(source: BinaryIO, path: Path, what: str, mapped: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a ``torch.save`` zip archive whose members are stored,
    so that nothing inflates beyond the bytes read; ``mapped``: of the file at ``path``, its
    tensors mapped from it (``mmap=True``)."""
    try:
        with zipfile.ZipFile(source) as archive:
            compressed = [m.filename for m in archive.infolist() if m.compress_type != zipfile.ZIP_STORED]
    except (zipfile.BadZipFile, ValueError, EOFError, OSError):
        raise ConfigError(f"{what} {path}: not a torch.save archive (the zip format torch has written since "
                          "1.6)") from None
    if compressed:
        raise ConfigError(f"{what} {path}: compressed members {compressed[:3]}; torch.save stores them "
                          "uncompressed")
    source.seek(0)
    try:
        return torch.load(str(path), mmap=True, weights_only=True) if mapped else torch.load(source, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, TypeError, KeyError, pickle.UnpicklingError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{what} {path}: cannot load a trainer checkpoint ({reason})") from None


def _load_snapshot(path: Path, max_bytes: int | None, what: str, progress: Progress | None = None,
                   mapped: bool = False) -> dict:
    """A gradtap snapshot directory: its manifest, and both files checked against its sha256s."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise _unreadable(path, what) from None
    try:
        try:
            with _open_regular(MANIFEST, what, dir_fd=dir_fd, shown=path / MANIFEST) as f:
                manifest = json.loads(_read_bounded(f, MAX_MANIFEST_BYTES, path / MANIFEST, what))
        except ConfigError:
            raise ConfigError(f"{what} {path}: a directory, but not a gradtap snapshot (no readable "
                              f"{MANIFEST})") from None
        except (ValueError, RecursionError):
            raise ConfigError(f"{what} {path}: {MANIFEST} is not JSON (or nested too deeply)") from None
        if not isinstance(manifest, dict) or manifest.get("format") != snapshot.FORMAT:
            raise ConfigError(f"{what} {path}: {MANIFEST} is not a {snapshot.FORMAT!r} manifest")
        sha256 = manifest.get("sha256") if isinstance(manifest.get("sha256"), dict) else {}
        state, left = {}, max_bytes
        meter = _Meter(progress, 2 * sum(_size_of(name, dir_fd) for name in snapshot.FILES))
        for name in snapshot.FILES:
            with _open_regular(name, what, dir_fd=dir_fd, shown=path / name) as f:
                state[name], size = _load_in_place(f, left, path / name, what, sha256.get(name), meter, mapped)
            if left is not None:
                left -= size
    finally:
        os.close(dir_fd)
    return _checked({"model": state["model.pt"], "optimizer": state["optimizer.pt"],
                     "iteration": manifest.get("iteration")}, path, what)


def _size_of(name: str, dir_fd: int) -> int:
    """The size of ``name`` in the directory ``dir_fd`` for a progress bar's total (0 when it
    cannot be read: opening it says why)."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError:
        return 0


def _checked(checkpoint: Any, path: Path, what: str) -> dict:
    """``checkpoint`` when it has the shape of a trainer checkpoint: a model state_dict of
    tensors, an Adam/AdamW state_dict, and an ``iteration`` that is an int ≥ 0."""
    def refuse(why: str) -> ConfigError:
        return ConfigError(f"{what} {path}: not a trainer checkpoint ({why}); expected "
                           "{'model': state_dict, 'optimizer': state_dict, 'iteration': k}")

    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "iteration"} <= set(checkpoint):
        raise refuse("a dict of model, optimizer and iteration")
    iteration = checkpoint["iteration"]
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise refuse(f"iteration is {iteration!r}, not an int >= 0")
    model = checkpoint["model"]
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in model.items()):
        raise refuse("model is not a state_dict of named tensors")
    optimizer = checkpoint["optimizer"]
    if not isinstance(optimizer, Mapping) or not isinstance(optimizer.get("state"), Mapping) \
            or not isinstance(optimizer.get("param_groups"), list):
        raise refuse("optimizer is not a state_dict with state and param_groups")
    for i, group in enumerate(optimizer["param_groups"]):
        if not isinstance(group, Mapping) or not _numbers(group, ("lr", "eps", "weight_decay")) \
                or not isinstance(group.get("betas"), (tuple, list)) or len(group["betas"]) != 2 \
                or not all(_number(b) for b in group["betas"]) \
                or not isinstance(group.get("params"), list) \
                or not all(isinstance(p, int) for p in group["params"]):
            raise refuse(f"optimizer param_groups[{i}] lacks params, lr, betas, eps or weight_decay")
    for key, entry in optimizer["state"].items():
        if not isinstance(entry, Mapping) or not _numbers(entry, ("step",)) \
                or not all(isinstance(entry.get(m), torch.Tensor) for m in ("exp_avg", "exp_avg_sq")):
            raise refuse(f"optimizer state[{key!r}] lacks step, exp_avg or exp_avg_sq")
    return checkpoint


def _number(value: Any) -> bool:
    """A real number, or a one-element tensor (torch keeps ``step``, and may keep ``lr``, as one)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, Real) and not isinstance(value, bool)


def _numbers(mapping: Mapping, keys: tuple[str, ...]) -> bool:
    return all(_number(mapping.get(k)) for k in keys)
