"""The durable tier: snapshots in any fsspec store (``file://DIR``, ``s3://BUCKET/PREFIX``).

Layout under the store's URL::

    objects/ab/abcdef…            one object per distinct file, keyed by its sha256 (the first two
                                  hex digits as a prefix spread the keys)
    snapshots/000120/MANIFEST     JSON: format, job, iteration, step, and for each file of the
                                  snapshot (model.pt, optimizer.pt) its object's sha256 and size

A snapshot is PENDING while its objects are written and READY once its ``MANIFEST`` exists:
the manifest is written last, after every object it names is complete, so a reader that
lists the manifests sees only complete snapshots. Every object is written atomically (an S3
PUT or multipart upload becomes visible whole, or not at all; on a local filesystem it is
written under a temporary name and renamed), so a writer killed at any moment leaves at most
unreferenced objects, which retention removes, and never a READY snapshot whose objects are
missing or short. A reader still checks every object's size and sha256 as it loads it
(:func:`load`), and :func:`load_newest` passes over a snapshot that fails to the one before.

Retention (:meth:`SnapshotStore.retain`) keeps the ``keep_last`` newest iterations and every
iteration that is a multiple of ``keep_every``; it deletes the other manifests first (so the
snapshot stops being READY) and only then the objects no remaining manifest names. One
writer per store URL: two appliances writing one prefix would collect each other's objects.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.store import snapshot

log = logging.getLogger(__name__)

FORMAT = "gradtap-store/1"
MANIFEST = "MANIFEST"
OBJECTS = "objects"
SNAPSHOTS = "snapshots"
CHUNK = 1 << 22


@dataclass(frozen=True)
class StoreObject:
    sha256: str
    size: int


def object_key(sha256: str) -> str:
    return f"{OBJECTS}/{sha256[:2]}/{sha256}"


def manifest_key(iteration: int) -> str:
    return f"{SNAPSHOTS}/{iteration:06d}/{MANIFEST}"


def open_store(url: str, endpoint_url: str | None = None, storage_options: dict | None = None):
    """``(filesystem, root path)`` of the store at ``url``; ``endpoint_url`` names an
    S3-compatible server for ``s3://``."""
    import fsspec

    options = dict(storage_options or {})
    if endpoint_url is not None:
        options.setdefault("client_kwargs", {})["endpoint_url"] = endpoint_url
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"store {url}: {exc}") from None
    return fs, root.rstrip("/")


def _sha256_file(path: Path) -> StoreObject:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
            size += len(block)
    return StoreObject(h.hexdigest(), size)


class _HashedRead(io.RawIOBase):
    """A store object's file, for ``torch.load``, hashed on the way. Bytes read in order from
    the start are hashed as they pass, and a short gap (a zip member's header fields the
    reader skips) is read for the hash where it lies; what lies further ahead, such as the zip
    directory at the end that the reader reads first, is hashed by :meth:`digest` at the end,
    with whatever the reader never read. ``torch.save``'s members lie in the order
    ``torch.load`` reads them, so the object is read about once."""

    GAP = 1 << 20       # a skip no longer than this is read for the hash at once

    def __init__(self, f, on_hashed: Callable[[int], None] | None = None):
        self._f = f
        self._at = 0                    # where the next read starts
        self._hash = hashlib.sha256()
        self._hashed = 0                # bytes [0, _hashed) are in the hash
        self._on_hashed = on_hashed     # told how far the hash has come, as it moves on

    def _update(self, data) -> None:
        self._hash.update(data)
        self._hashed += len(data)
        if self._on_hashed is not None:
            self._on_hashed(self._hashed)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = self._f.seek(offset, whence)
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, buffer) -> int:
        if self._hashed < self._at <= self._hashed + self.GAP:
            self._f.seek(self._hashed)
            self._update(self._f.read(self._at - self._hashed))
            self._f.seek(self._at)
        n = self._f.readinto(buffer)
        if n and self._at <= self._hashed < self._at + n:
            self._update(memoryview(buffer).cast("B")[self._hashed - self._at:n])
        self._at += n
        return n

    def digest(self) -> tuple[str, int]:
        """The object's sha256 and size, once the rest of it is read."""
        self._f.seek(self._hashed)
        while chunk := self._f.read(CHUNK):
            self._update(chunk)
        return self._hash.hexdigest(), self._hashed


class SnapshotStore:
    """The snapshots of one job in the store at ``url`` (see the module's docstring).

    Parameters
    ----------
    url:
        fsspec URL (``file:///DIR``, ``s3://BUCKET/PREFIX``).
    job:
        The job's name, written in every manifest and checked on load.
    keep_last, keep_every:
        Retention: the newest ``keep_last`` READY iterations, and every multiple of
        ``keep_every`` (``None``: none beyond them).
    endpoint_url, storage_options:
        Passed to fsspec (an S3-compatible server's URL; s3fs options such as ``key``).
    """

    def __init__(self, url: str, job: str, *, keep_last: int = 3, keep_every: int | None = None,
                 endpoint_url: str | None = None, storage_options: dict | None = None):
        if keep_last < 1:
            raise ConfigError(f"store keep_last: {keep_last} must be at least 1")
        if keep_every is not None and keep_every < 1:
            raise ConfigError(f"store keep_every: {keep_every} must be at least 1 (or unset)")
        self.url, self.job, self.keep_last, self.keep_every = url, job, keep_last, keep_every
        self.fs, self.root = open_store(url, endpoint_url, storage_options)
        self.opened = datetime.now(timezone.utc)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    @classmethod
    def of_spec(cls, spec, job: str) -> "SnapshotStore":
        """From the job spec's ``appliance.store`` (:class:`gradtap.workload.spec.StoreSpec`)."""
        return cls(spec.url, job, keep_last=spec.keep_last, keep_every=spec.keep_every,
                   endpoint_url=spec.endpoint_url)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # -- writing ---------------------------------------------------------------------------

    def _put(self, local: Path | None, data: bytes | None, key: str) -> None:
        """Write one object whole or not at all (see the module's docstring)."""
        path = self._path(key)
        if not self.local:
            if local is not None:
                self.fs.put_file(str(local), path)
            else:
                self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            if local is not None:
                self.fs.put_file(str(local), tmp)
            else:
                self.fs.pipe_file(tmp, data)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            self.fs.mv(tmp, path)
            snapshot.fsync_dir(Path(path).parent)  # the name survives a power loss before the manifest
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except OSError:
                pass
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` as the object ``key`` (a path under the store's URL), whole or not at
        all (the gradient log's records and entries, ``store/gradient_log.py``)."""
        self._put(None, data, key)

    def put_snapshot(self, directory: str | Path) -> str:
        """Upload the local snapshot ``directory`` (``store/snapshot.py``): its objects, each
        only when the store lacks it, then its manifest. The files are hashed as they are read
        and must match the local manifest (``GradtapError`` otherwise: nothing becomes READY).
        Returns the manifest's key."""
        directory = Path(directory)
        local = json.loads((directory / "manifest.json").read_text())
        objects: dict[str, StoreObject] = {}
        for name in snapshot.FILES:
            obj = _sha256_file(directory / name)
            if obj.sha256 != local["sha256"][name]:
                raise GradtapError(f"{directory}: {name} has sha256 {obj.sha256[:16]}…, its manifest says "
                                   f"{local['sha256'][name][:16]}…; not uploaded")
            key = object_key(obj.sha256)
            if not self._has(key, obj.size):
                self._put(directory / name, None, key)
            objects[name] = obj
        iteration = int(local["iteration"])
        manifest = {"format": FORMAT, "job": self.job, "iteration": iteration, "step": int(local["step"]),
                    "created_unix": local.get("created_unix"), "torch": local.get("torch"),
                    "objects": {n: {"sha256": o.sha256, "size": o.size} for n, o in objects.items()}}
        key = manifest_key(iteration)
        self._put(None, (json.dumps(manifest, indent=1) + "\n").encode(), key)    # last: READY
        return key

    def abort_dead_uploads(self) -> list[str]:
        """Abort the S3 multipart uploads under the store's prefix that began before this store
        was opened (less a minute for clocks), and return their keys. One writer per store URL:
        such an upload belongs to a writer that was killed mid-object, and its parts would be
        kept (and billed) for ever. Other stores have nothing to abort."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return []
        bucket, _, prefix = self.root.partition("/")
        before = self.opened - timedelta(minutes=1)
        aborted, markers = [], {}
        while True:
            page = call("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", **markers)
            for upload in page.get("Uploads", []):
                if upload["Initiated"] < before:
                    call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted.append(upload["Key"])
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def _has(self, key: str, size: int) -> bool:
        try:
            return int(self.fs.info(self._path(key))["size"]) == size
        except FileNotFoundError:
            return False

    def retain(self) -> list[int]:
        """Apply retention; the iterations whose manifests were deleted."""
        ready = self.ready()
        keep = set(ready[-self.keep_last:])
        if self.keep_every is not None:
            keep |= {i for i in ready if i % self.keep_every == 0}
        dropped = [i for i in ready if i not in keep]
        for iteration in dropped:                  # manifests first: no longer READY
            self.fs.rm_file(self._path(manifest_key(iteration)))
        if dropped:
            named = set()
            for iteration in keep:
                manifest = self.manifest(iteration)
                if manifest is not None:
                    named |= {o["sha256"] for o in manifest["objects"].values()}
            for path in self._objects():
                if path.rsplit("/", 1)[-1] not in named:     # also what a killed writer left (.tmp-)
                    self.fs.rm_file(path)
        return dropped

    def _objects(self) -> list[str]:
        try:
            return [p for p in self.fs.find(self._path(OBJECTS))]
        except FileNotFoundError:
            return []

    # -- reading ---------------------------------------------------------------------------

    def ready(self) -> list[int]:
        """The iterations of READY snapshots (with a manifest), oldest first."""
        try:
            self.fs.invalidate_cache()
            found = self.fs.glob(self._path(f"{SNAPSHOTS}/*/{MANIFEST}"))
        except FileNotFoundError:
            return []
        out = []
        for path in found:
            name = path.rstrip("/").split("/")[-2]
            if name.isdigit():
                out.append(int(name))
        return sorted(out)

    def manifest(self, iteration: int) -> dict[str, Any] | None:
        """The manifest of ``iteration`` (``None``: not READY, or unreadable)."""
        try:
            manifest = json.loads(self.fs.cat_file(self._path(manifest_key(iteration))))
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            return None
        return manifest

    def load(self, iteration: int, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """``{"model", "optimizer", "iteration"}`` of the READY snapshot ``iteration``, every
        object's size and sha256 checked (``GradtapError`` when one fails or is missing).
        ``progress(done, total)``: bytes read of all the snapshot's objects, as they are read."""
        where = f"{self.url}/{manifest_key(iteration)}"
        manifest = self.manifest(iteration)
        if manifest is None:
            raise GradtapError(f"{where}: no READY manifest")
        if manifest.get("job") != self.job:
            raise GradtapError(f"{where}: a snapshot of job {manifest.get('job')!r}, not {self.job!r}")
        wanted = [manifest["objects"].get(name, {}) for name in snapshot.FILES]
        sizes = [w.get("size") if isinstance(w.get("size"), int) else 0 for w in wanted]
        total, parts, before = sum(sizes), {}, 0
        for name, want, size in zip(snapshot.FILES, wanted, sizes):
            read = None if progress is None else lambda n, before=before: progress(min(before + n, total), total)
            try:
                parts[name] = self._load_object(self._path(object_key(str(want.get("sha256")))), want,
                                                f"{where}: {name}", read)
            except FileNotFoundError:
                raise GradtapError(f"{where}: the object of {name} is missing") from None
            before += size
        return {"model": parts["model.pt"], "optimizer": parts["optimizer.pt"],
                "iteration": int(manifest["iteration"])}

    def _load_object(self, path: str, want: dict, what: str, read: Callable[[int], None] | None = None) -> Any:
        """``torch.load`` of the object at ``path``, which must have ``want``'s size and sha256
        (``GradtapError`` otherwise): hashed as ``torch.load`` reads it (:class:`_HashedRead`),
        so that it crosses the network about once and its bytes are never held whole beside
        its tensors (read whole, a snapshot's bytes and tensors peaked at 20 bytes per
        parameter, where its tensors are 12). What a failed check loaded is dropped unseen.
        ``read(n)``: the first ``n`` bytes of the object are read, as that grows."""
        with self.fs.open(path, "rb") as f:
            reader = _HashedRead(f, read)
            try:
                loaded = torch.load(reader, weights_only=True)
            except Exception as exc:         # a torn or corrupt object fails here, or in the check
                loaded, failed = None, exc
            else:
                failed = None
            got, size = reader.digest()
        if got != want.get("sha256") or size != want.get("size"):
            raise GradtapError(f"{what} has sha256 {got[:16]}… and {size} B, the manifest says "
                               f"{str(want.get('sha256'))[:16]}… and {want.get('size')} B")
        if failed is not None:
            raise GradtapError(f"{what} matches its manifest but does not load: {failed}")
        return loaded

    def load_newest(self) -> dict[str, Any]:
        """The newest READY snapshot that verifies; older ones are tried when a newer fails
        (``GradtapError`` when none does)."""
        tried = []
        for iteration in reversed(self.ready()):
            try:
                return self.load(iteration)
            except GradtapError as exc:
                log.warning("%s", exc)
                tried.append(str(exc))
        raise GradtapError(f"{self.url}: no READY snapshot of job {self.job!r} that verifies"
                           + (f" ({'; '.join(tried)})" if tried else ""))


def load_url(url: str, *, job: str | None = None, endpoint_url: str | None = None,
             storage_options: dict | None = None) -> dict[str, Any]:
    """The newest verified READY snapshot at the store ``url`` (of any job when ``job`` is
    ``None``: the job recorded in the newest manifest)."""
    store = SnapshotStore(url, job or "", endpoint_url=endpoint_url, storage_options=storage_options)
    if job is None:
        ready = store.ready()
        manifest = store.manifest(ready[-1]) if ready else None
        if manifest is None:
            raise GradtapError(f"{url}: no READY snapshot")
        store.job = str(manifest.get("job"))
    return store.load_newest()
