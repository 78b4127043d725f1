"""The gradient log: every applied iteration's merged gradient in the store, so that any
iteration since a READY snapshot is rebuilt bit for bit as that snapshot plus an Adam replay.

Layout under the store's URL, beside ``snapshots/`` and ``objects/`` (``store/object_store.py``)::

    gradlog/objects/000123/<sha256>   the record of iteration 123: its gradient compressed, named by
                                      the sha256 of the compressed bytes
    gradlog/iterations/000123.json    its entry, written last: the record is in the log once it exists

A **record** is the flat gradient the replica applied (``Replica.apply``: every bucket in
launch order, in the wire dtype, bf16/fp16 as their uint16 bit patterns), bytes shuffled by
element (every element's first byte, then every second byte, ...: a float's sign and
exponent bytes line up and compress) and deflated (ISA-L's ``isal_zlib`` at level 1, a zlib
stream any zlib reads). Its **entry** (:class:`LogEntry`) holds the iteration, the optimizer
step after it, the wire dtype, the raw size and sha256, the object's sha256 and size, the job's
name and a sha256 of each job-spec section that decides a replay (the learning rate, clipping
and world size come from the job spec and the step, so the gradient is all a record needs).

**Chains.** An entry names the object of the record before it (``prev``) when the same writer
wrote that one and nothing came between (no dropped record, no resync). The first record a
writer writes names instead the sha256 of the state it applies to (``base``, as
``ReplicaOrigin`` hashes a state) when it knows it. A replay crosses record ``j`` only when
``prev`` is record ``j - 1``'s object, or ``base`` equals the state replayed so far: records of
two timelines (a trainer restarted from an older checkpoint, an appliance resynchronised) are
never mixed.

**Never on the update path.** :class:`GradientLog` holds ``queue`` buffers of one gradient
each, allocated once. The update path copies each bucket into a free one and hands it over
when the iteration is applied; one thread compresses, hashes and writes. When no buffer is
free (the store is slower than the iterations) the iteration is not logged: it is counted
as dropped and said as a gap (``gradlog.gap``, then ``gradlog.resumed`` naming the iterations
missed). A failed write is counted (``gradlog.failed``) and retried with backoff.

**Retention.** Entries (first) and objects of iterations before the store's oldest READY
snapshot are deleted: nothing restores from before it.

:func:`rebuild` is ``gradtap restore --at`` and ``--start-from-store``: the newest READY
snapshot at or before the iteration, then ``Replica.apply`` of every record after it. Every
record read is checked: entry size bounded, fields typed, object size and sha256, the
decompressed length bounded by the job's gradient size, and its sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.store.object_store import SnapshotStore
from gradtap.store.uploader import NICE
from gradtap.updater.replica import WIRE_NUMPY, Replica
from gradtap.updater.replica_origin import JOB_SECTIONS, ReplicaOrigin, job_sha256
from gradtap.workload.spec import JobSpec

log = logging.getLogger(__name__)

FORMAT = "gradtap-gradlog/1"
CODEC = "shuffle-deflate"
LEVEL = 1                          # isal_zlib level: 1 compresses as well as 2-3 on gradients, 4x faster
LOG = "gradlog"
MAX_ENTRY_BYTES = 64 << 10         # an entry is a few hundred bytes; anything longer is not one
RETAIN_EVERY = 16                  # records written between retention passes

EventSink = Callable[..., object]
Progress = Callable[[int, int], None]        # (done, of the total): records replayed, or bytes of a snapshot read


def entry_key(iteration: int) -> str:
    return f"{LOG}/iterations/{iteration:06d}.json"


def objects_dir(iteration: int) -> str:
    return f"{LOG}/objects/{iteration:06d}"


def state_sha256(replica: Replica) -> str:
    """The sha256 of the replica's state as ``ReplicaOrigin`` takes it (the ``base`` of a chain)."""
    return ReplicaOrigin.of(replica).start_sha256


def encode(raw: np.ndarray, itemsize: int, scratch: np.ndarray | None = None) -> bytes:
    """``raw`` (uint8, a whole number of ``itemsize``-byte elements) shuffled by byte and deflated."""
    import isal.isal_zlib

    shuffled = raw.reshape(-1, itemsize).T
    if scratch is None:
        scratch = np.empty(raw.size, np.uint8)
    np.copyto(scratch.reshape(itemsize, -1), shuffled)
    return isal.isal_zlib.compress(scratch, LEVEL)


def decode(blob: bytes, raw_bytes: int, itemsize: int, where: str) -> np.ndarray:
    """The inverse of :func:`encode`, never producing more than ``raw_bytes`` bytes."""
    import isal.isal_zlib

    d = isal.isal_zlib.decompressobj()
    try:
        out = d.decompress(blob, raw_bytes)
    except isal.isal_zlib.error as exc:
        raise GradtapError(f"{where}: not a deflate stream ({exc})") from None
    if len(out) != raw_bytes or not d.eof or d.unused_data:
        more = "more than " if len(out) == raw_bytes else ""       # cut at raw_bytes, the stream goes on
        raise GradtapError(f"{where}: decompresses to {more}{len(out)} B, not the {raw_bytes} B its entry says")
    shuffled = np.frombuffer(out, np.uint8).reshape(itemsize, -1)
    return np.ascontiguousarray(shuffled.T).reshape(-1)


@dataclass(frozen=True)
class LogEntry:
    """One record's entry (``gradlog/iterations/NNNNNN.json``)."""

    job: str
    iteration: int
    step: int                      # the optimizer's step count after the iteration
    wire_dtype: str
    raw_bytes: int
    raw_sha256: str
    sha256: str                    # of the object
    size: int                      # of the object
    prev: str | None               # the object sha256 of the record before, in one chain
    base: str | None               # a chain's first record: the sha256 of the state it applies to
    job_sha256: dict[str, str] = field(default_factory=dict)
    codec: str = CODEC
    format: str = FORMAT

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=1) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> "LogEntry":
        """An entry read from the store, every field checked (``GradtapError`` naming it)."""
        if len(data) > MAX_ENTRY_BYTES:
            raise GradtapError(f"{where}: {len(data)} B is no log entry (at most {MAX_ENTRY_BYTES} B)")
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise GradtapError(f"{where}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("codec") != CODEC:
            raise GradtapError(f"{where}: not a {FORMAT} entry with codec {CODEC}")
        kinds = {"job": str, "iteration": int, "step": int, "wire_dtype": str, "raw_bytes": int,
                 "raw_sha256": str, "sha256": str, "size": int, "prev": (str, type(None)),
                 "base": (str, type(None)), "job_sha256": dict}
        for name, kind in kinds.items():
            value = doc.get(name)
            if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
                raise GradtapError(f"{where}: field {name} is {value!r}")
        hexes = [doc["raw_sha256"], doc["sha256"], *(v for v in (doc["prev"], doc["base"]) if v is not None)]
        if not all(len(h) == 64 and all(c in "0123456789abcdef" for c in h) for h in hexes):
            raise GradtapError(f"{where}: a sha256 that is not 64 hex digits")
        return cls(**{k: doc[k] for k in (*kinds, "codec", "format")})


# -- the store side ---------------------------------------------------------------------------


class LogStore:
    """The gradient log of one job in ``store`` (its ``fs`` and ``root``)."""

    def __init__(self, store: SnapshotStore):
        self.store = store
        self.fs, self.url = store.fs, store.url

    def _path(self, key: str) -> str:
        return f"{self.store.root}/{key}"

    def logged(self) -> list[int]:
        """The iterations with an entry, oldest first."""
        path = self._path(f"{LOG}/iterations")
        self.fs.invalidate_cache(path)
        try:
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            stem = name.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")
            if name.endswith(".json") and stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def entry(self, iteration: int) -> LogEntry | None:
        """The entry of ``iteration`` (``None``: not logged)."""
        where = f"{self.url}/{entry_key(iteration)}"
        try:
            data = self.fs.cat_file(self._path(entry_key(iteration)), start=0, end=MAX_ENTRY_BYTES + 1)
        except FileNotFoundError:
            return None
        entry = LogEntry.parse(data, where)
        if entry.iteration != iteration:
            raise GradtapError(f"{where}: holds iteration {entry.iteration}")
        return entry

    def record(self, entry: LogEntry, job: JobSpec, sections: dict[str, str], numel: int) -> np.ndarray:
        """The gradient of ``entry`` (uint8 wire bytes), refused by name when it is not the
        job's or fails a check."""
        key = f"{objects_dir(entry.iteration)}/{entry.sha256}"
        where = f"gradient log record of iteration {entry.iteration} ({self.url}/{key})"
        if entry.job != job.name:
            raise GradtapError(f"{where}: of job {entry.job!r}, not {job.name!r}")
        differ = sorted(s for s in JOB_SECTIONS if entry.job_sha256.get(s) != sections[s])
        if differ:
            raise GradtapError(f"{where}: written for a job whose {', '.join(differ)} section(s) differ from "
                               f"{job.name!r}'s; restore with the job spec the appliance ran")
        itemsize = WIRE_NUMPY[job.ddp.grad_dtype].itemsize
        if entry.wire_dtype != job.ddp.grad_dtype or entry.raw_bytes != numel * itemsize:
            raise GradtapError(f"{where}: {entry.raw_bytes} B of {entry.wire_dtype}; the job's gradient is "
                               f"{numel * itemsize} B of {job.ddp.grad_dtype}")
        limit = entry.raw_bytes + entry.raw_bytes // 100 + 4096      # deflate's worst case is far below
        if entry.size > limit:
            raise GradtapError(f"{where}: its entry says {entry.size} B, more than a {entry.raw_bytes} B gradient "
                               "compresses to")
        try:
            blob = self.fs.cat_file(self._path(key), start=0, end=entry.size + 1)
        except FileNotFoundError:
            raise GradtapError(f"{where}: the object is missing") from None
        got = hashlib.sha256(blob).hexdigest()
        if len(blob) != entry.size or got != entry.sha256:
            raise GradtapError(f"{where}: corrupt: {len(blob)} B with sha256 {got[:16]}…, its entry says "
                               f"{entry.size} B and {entry.sha256[:16]}…")
        raw = decode(blob, entry.raw_bytes, itemsize, where)
        if hashlib.sha256(raw).hexdigest() != entry.raw_sha256:
            raise GradtapError(f"{where}: corrupt: the gradient's sha256 is not the one its entry says")
        return raw

    def write(self, entry: LogEntry, blob: bytes) -> None:
        """The object, then the entry (the record is in the log from then on); an object of
        another record of the iteration (another timeline's) goes after."""
        directory = self._path(objects_dir(entry.iteration))
        self.fs.invalidate_cache(directory)
        try:
            old = [p for p in self.fs.ls(directory, detail=False) if not p.endswith(entry.sha256)]
        except FileNotFoundError:
            old = []
        self.store.put_bytes(f"{objects_dir(entry.iteration)}/{entry.sha256}", blob)
        self.store.put_bytes(entry_key(entry.iteration), entry.to_json())      # last
        for path in old:
            self.fs.rm_file(path)

    def retain(self) -> list[int]:
        """Delete the records before the oldest READY snapshot; the iterations deleted."""
        ready = self.store.ready()
        if not ready:
            return []
        doomed = [i for i in self.logged() if i < ready[0]]
        for iteration in doomed:
            self.fs.rm_file(self._path(entry_key(iteration)))       # first: out of the log
            try:
                self.fs.rm(self._path(objects_dir(iteration)), recursive=True)
            except FileNotFoundError:
                pass
        return doomed


# -- the writer --------------------------------------------------------------------------------


@dataclass
class LogCounters:
    logged: int = 0
    dropped: int = 0                     # applied iterations not logged: gaps
    failed: int = 0                      # write attempts that raised
    last_logged: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Record:
    iteration: int
    step: int
    buffer: np.ndarray
    follows: bool                        # continues the record submitted before it
    base: str | None


def _no_events(kind: str, **fields) -> None:
    del kind, fields


class GradientLog:
    """Appends each applied iteration's gradient to ``store`` from one background thread.

    Parameters
    ----------
    store:
        The job's store (the snapshots' ``SnapshotStore``).
    job:
        The job (its name and sections go into every entry).
    offsets:
        Byte offset of each bucket in the flat gradient, in launch order, and the total last.
    queue:
        Gradients held in memory (one being filled, the rest waiting for the store).
    base:
        ``(iteration, state sha256)`` of the replica's start state, for the first record's entry.
    on_event:
        ``on_event(kind, **fields)``: ``gradlog.gap``, ``gradlog.resumed``, ``gradlog.failed``,
        ``gradlog.abandoned`` (``ControlPlane.event``).
    """

    def __init__(self, store: SnapshotStore, job: JobSpec, offsets: list[int], *, queue: int = 3,
                 base: tuple[int, str] | None = None, retry_min_s: float = 0.5, retry_max_s: float = 30.0,
                 on_event: EventSink = _no_events):
        if queue < 2:
            raise ConfigError(f"appliance.store.gradient_log_queue: {queue} must be at least 2 (one gradient being "
                              "filled, one being written)")
        self.log, self.job, self.offsets = LogStore(store), job, offsets
        self.itemsize = WIRE_NUMPY[job.ddp.grad_dtype].itemsize
        self.sections = job_sha256(job)
        self.retry_min_s, self.retry_max_s, self.on_event = retry_min_s, retry_max_s, on_event
        self.counters = LogCounters()
        self._free = [np.empty(offsets[-1], np.uint8) for _ in range(queue)]
        self._scratch = np.empty(offsets[-1], np.uint8)
        self._pending: list[_Record] = []
        self._cond = threading.Condition()
        self._closing = False
        self._filling: tuple[int, np.ndarray] | None = None    # the iteration being copied, its buffer
        self._base = base
        self._last_submitted: int | None = None
        self._gap: list[int] = []                               # iterations dropped since the last record
        self._thread = threading.Thread(target=self._loop, name="gradtap-gradlog", daemon=True)
        self._thread.start()

    @classmethod
    def for_replica(cls, store: SnapshotStore, replica: Replica, origin: ReplicaOrigin | None, *, queue: int,
                    retry_min_s: float, retry_max_s: float) -> "GradientLog":
        """The log of ``replica``'s applied gradients; ``origin``: its start state, if known."""
        layout = replica.layout
        itemsize = WIRE_NUMPY[replica.wire].itemsize
        offsets = [layout.bucket(b).start * itemsize for b in range(len(layout.buckets))] + [layout.total * itemsize]
        base = None if origin is None or origin.start_iteration < 0 else (origin.start_iteration, origin.start_sha256)
        return cls(store, replica.job, offsets, queue=queue, base=base, retry_min_s=retry_min_s,
                   retry_max_s=retry_max_s)

    # -- the update path: copies and hand-overs, never I/O --

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None:
        """Bucket ``bucket`` of ``iteration`` as the replica applied it."""
        if self._filling is None or self._filling[0] != iteration:
            self._release_filling()
            with self._cond:
                buffer = self._free.pop() if self._free else None
            if buffer is None:
                return                                          # dropped: applied() counts it
            self._filling = (iteration, buffer)
        raw = data.view(np.uint8).reshape(-1)
        start = self.offsets[bucket]
        self._filling[1][start:start + raw.size] = raw

    def applied(self, iteration: int, step: int) -> None:
        """``iteration`` was applied (its optimizer step is now ``step``): its record goes."""
        filling, self._filling = self._filling, None
        follows = self._last_submitted == iteration - 1
        if filling is None or filling[0] != iteration:
            if filling is not None:
                self._give_back(filling[1])
            self._drop(iteration)
            return
        base = None
        if self._base is not None and self._last_submitted is None and self._base[0] == iteration:
            base = self._base[1]
        self._last_submitted = iteration
        with self._cond:
            self._pending.append(_Record(iteration, step, filling[1], follows, base))
            self._cond.notify()
        if self._gap:
            self.on_event("gradlog.resumed", iteration=iteration, missed=self._gap)
            self._gap = []

    def discard(self, iteration: int) -> None:
        """``iteration`` was not applied: nothing of it is logged."""
        if self._filling is not None and self._filling[0] == iteration:
            self._release_filling()

    def chain_break(self) -> None:
        """The replica's state was replaced (a resync): the next record begins a new chain."""
        self._last_submitted = None
        self._base = None

    def counts(self) -> dict:
        with self._cond:
            return self.counters.as_dict()

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    def close(self, timeout: float) -> None:
        """Write what waits within ``timeout`` seconds; what is left then is abandoned (a gap)."""
        self._release_filling()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            left = [r.iteration for r in self._pending]
        if self._thread.is_alive() or left:
            log.warning("%s: gradient log records %s not written by shutdown", self.log.url, left)
            self.on_event("gradlog.abandoned", url=self.log.url, iterations=left)

    def _release_filling(self) -> None:
        if self._filling is not None:
            self._give_back(self._filling[1])
            self._filling = None

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._cond:
            self._free.append(buffer)

    def _drop(self, iteration: int) -> None:
        with self._cond:
            self.counters.dropped += 1
        self._last_submitted = None
        if not self._gap:
            log.warning("%s: gradient of iteration %d not logged (the store is behind): a gap", self.log.url,
                        iteration)
            self.on_event("gradlog.gap", url=self.log.url, iteration=iteration, reason="no free buffer: the "
                          "store is slower than the iterations")
        self._gap.append(iteration)

    # -- the writer thread --

    def _loop(self) -> None:
        try:            # as the uploader's: the update path wins the cores it shares with us
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (OSError, AttributeError):
            pass
        last: tuple[int, str] | None = None            # (iteration, object sha256) last written
        failures, delay, since_retain = 0, self.retry_min_s, 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closing)
                if not self._pending:
                    return
                record = self._pending[0]
            try:
                prev = last[1] if record.follows and last is not None and last[0] == record.iteration - 1 else None
                last = (record.iteration, self._write(record, prev))
            except Exception as exc:          # the store's errors are many (OSError, botocore's, ...)
                failures += 1
                with self._cond:
                    self.counters.failed += 1
                    closing = self._closing
                log.warning("%s: gradient log record of iteration %d failed (%s); next attempt in %.1f s",
                            self.log.url, record.iteration, exc, delay)
                self.on_event("gradlog.failed", url=self.log.url, iteration=record.iteration,
                              error=f"{type(exc).__name__}: {exc}", attempt=failures, retry_in_s=delay)
                if closing:
                    return
                with self._cond:
                    self._cond.wait_for(lambda: self._closing, delay)
                delay = min(2 * delay, self.retry_max_s)
                continue
            failures, delay = 0, self.retry_min_s
            with self._cond:
                self._pending.pop(0)
                self._free.append(record.buffer)
                self.counters.logged += 1
                self.counters.last_logged = record.iteration
                self._cond.notify_all()
            since_retain += 1
            if since_retain >= RETAIN_EVERY:
                since_retain = 0
                try:
                    self.log.retain()
                except Exception as exc:      # the records are written; the next pass tries again
                    log.warning("%s: gradient log retention failed (%s)", self.log.url, exc)

    def _write(self, record: _Record, prev: str | None) -> str:
        raw = record.buffer
        blob = encode(raw, self.itemsize, self._scratch)
        sha = hashlib.sha256(blob).hexdigest()
        entry = LogEntry(job=self.job.name, iteration=record.iteration, step=record.step,
                         wire_dtype=self.job.ddp.grad_dtype, raw_bytes=int(raw.size),
                         raw_sha256=hashlib.sha256(raw).hexdigest(), sha256=sha, size=len(blob), prev=prev,
                         base=record.base if prev is None else None, job_sha256=self.sections)
        self.log.write(entry, blob)
        return sha


# -- the replay -------------------------------------------------------------------------------


@dataclass
class Rebuilt:
    checkpoint: dict[str, Any]           # {"model", "optimizer", "iteration"}, as a snapshot holds it
    step: int                            # the optimizer's step count in it
    snapshot: int                        # the READY snapshot it began from
    replayed: list[int]                  # the records applied after it
    stopped: str | None = None           # (as far as it goes) why it went no further


def rebuild(job: JobSpec, store: SnapshotStore, at: int | None = None,
            progress: Progress | None = None, loading: Progress | None = None) -> Rebuilt:
    """The state ready for iteration ``at`` (the snapshot convention: after iterations
    ``0 .. at - 1``): the newest READY snapshot at or before ``at`` that verifies, then the
    log's records from it to ``at - 1`` through ``Replica.apply``. A refusal names why:
    ``at`` before the oldest snapshot, past the newest logged iteration, across a gap, or a
    record that fails its checks. ``at`` None: as far as the newest snapshot and the log go
    (stopping, and saying why in :attr:`Rebuilt.stopped`, at the first gap or bad record).
    ``progress``: the records replayed; ``loading``: the bytes of the snapshot read
    (``SnapshotStore.load``), begun again for an older one when a newer fails."""
    ready = store.ready()
    if not ready:
        raise GradtapError(f"{store.url}: no READY snapshot of job {job.name!r}; the gradient log replays from one")
    if at is not None and at < ready[0]:
        raise GradtapError(f"restore --at {at}: before the oldest READY snapshot in {store.url} (iteration "
                           f"{ready[0]}); nothing before it can be rebuilt")
    logstore = LogStore(store)
    logged = set(logstore.logged())
    candidates = [k for k in ready if at is None or k <= at]
    tried = []
    for k in reversed(candidates):
        try:
            checkpoint = store.load(k, loading)
        except GradtapError as exc:
            log.warning("%s", exc)
            tried.append(str(exc))
            continue
        if at is not None:
            _check_reachable(k, at, logged, ready, store.url)
        return _replay(job, logstore, checkpoint, k, at, logged, progress)
    raise GradtapError(f"{store.url}: no READY snapshot of job {job.name!r} at or before iteration {at} verifies "
                       f"({'; '.join(tried)})")


def _check_reachable(k: int, at: int, logged: set[int], ready: list[int], url: str) -> None:
    first = k                   # the first iteration from k on without a record (``at``: none is missing)
    while first < at and first in logged:
        first += 1
    if first == at:
        return
    newest = max(logged, default=None)
    if newest is None or first > newest:
        reach = newest + 1 if newest is not None and newest >= k else k
        raise GradtapError(f"restore --at {at}: past the newest logged iteration ({newest if newest is not None else 'none'}"
                           f" in {url}); from the snapshot of iteration {k} the log rebuilds up to --at {reach}")
    end = min(i for i in logged if i > first) - 1          # the gap: first..end
    after = [r for r in ready if r > end]
    hint = f"; the first READY snapshot after it is iteration {after[0]}" if after else ""
    raise GradtapError(f"restore --at {at}: the gradient log has a gap: iteration{'s' if end > first else ''} "
                       f"{first}{f'..{end}' if end > first else ''} not logged, so from the snapshot of "
                       f"iteration {k} it rebuilds up to --at {first} only{hint}")


def _replay(job: JobSpec, logstore: LogStore, checkpoint: dict, k: int, at: int | None, logged: set[int],
            progress: Progress | None) -> Rebuilt:
    # The snapshot's tensors are this rebuild's own: each leaves the checkpoint as the replica
    # copies it, and what the rebuild returns shares the replica's memory (nothing steps it
    # after), so that the state is never held twice.
    replica = Replica(job, checkpoint, consume=True)
    sections, numel = job_sha256(job), replica.layout.total
    end = at
    if end is None:
        end = k
        while end in logged:
            end += 1
    done: list[int] = []
    stopped = None
    prev_sha: str | None = None
    for j in range(k, end):
        try:
            entry = logstore.entry(j)
            if entry is None:
                raise GradtapError(f"gradient log record of iteration {j}: missing (a gap)")
            _check_chain(entry, j, k, prev_sha, logstore, replica)
            grad = logstore.record(entry, job, sections, numel)
            replica.apply(j, grad)
            if replica.step != entry.step:
                raise GradtapError(f"gradient log record of iteration {j}: the optimizer step after it is "
                                   f"{replica.step} in the replay, {entry.step} in its entry")
        except GradtapError as exc:
            if at is not None:
                raise GradtapError(f"restore --at {at} from the snapshot of iteration {k}: {exc}") from None
            stopped = str(exc)
            break
        prev_sha = entry.sha256
        done.append(j)
        if progress is not None:
            progress(len(done), end - k)
    return Rebuilt(replica.state_dict(copy=False), replica.step, k, done, stopped)


def _check_chain(entry: LogEntry, j: int, k: int, prev_sha: str | None, logstore: LogStore,
                 replica: Replica) -> None:
    """Record ``j`` continues the state replayed so far (see the module's docstring, Chains)."""
    if entry.prev is not None:
        if j > k:
            if entry.prev == prev_sha:
                return
        else:           # the snapshot's own writer logged the iteration before it, if it still exists
            before = logstore.entry(j - 1) if j > 0 else None
            if before is None or before.sha256 == entry.prev:
                return
        raise GradtapError(f"gradient log record of iteration {j}: follows another record of iteration {j - 1} "
                           "than the state replayed (another timeline: a trainer restarted from an older "
                           "checkpoint, or a second appliance writing the store)")
    if j == k and entry.base is None:
        return          # the snapshot is the state it applies to, as far as anything can tell
    if entry.base is not None and entry.base == state_sha256(replica):
        return
    raise GradtapError(f"gradient log record of iteration {j}: begins a new chain (the appliance was restarted or "
                       f"resynchronised at iteration {j}) from another state than the one replayed; restore from a "
                       f"snapshot at or after iteration {j}")
