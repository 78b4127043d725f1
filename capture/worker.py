"""CaptureWorker: one process that runs one capture source into one frame ring.

The pipeline owner makes the ring (:meth:`FrameRing.create`), starts a worker per mirror
stream, and hands the same ring to the parser process, which calls ``ring.read()``::

    ring = FrameRing.create(slots, slot_size)
    worker = CaptureWorker(SourceSpec("af_xdp", ("eth2",), {"netns": None}), ring, cpu=2)
    worker.start()                 # returns once the source is open, or raises its CaptureError
    ...                            # parser: batch = ring.read(); parser.feed(batch)
    final = worker.stop()          # stop flag, join, final counters

The worker process (started with ``spawn`` by default: no inherited threads or locks):

- pins itself to ``cpu`` if given, opens the source (entering its network namespace),
  and reports ready or the error over a pipe;
- runs the source until the stop flag is set (SIGTERM sets it too; SIGINT is left to the
  parent, which stops workers in order) or the source is exhausted;
- publishes the source's counters, and its own CPU time (``cpu_us``: user and system, every
  thread), into the ring header every ``stats_every`` seconds, so :meth:`CaptureWorker.stats`
  (any process holding the ring) sees them live;
- closes the source (detaching XDP programs), marks the ring's stream finished, and sends
  its final counters.

A worker that dies is never waited on forever: every wait has a timeout, and
:meth:`CaptureWorker.stop` raises :class:`CaptureError` with the worker's own error. Nor can
one leave the parent a lock to wait on: the stop flag is a byte of shared memory
(:class:`StopFlag`), not a ``multiprocessing.Event``.
"""

from __future__ import annotations

import ctypes
import inspect
import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass, field

from gradtap.capture.registry import make_source, source_class
from gradtap.capture.ring import FrameRing
from gradtap.core.errors import CaptureError, ConfigError


@dataclass(frozen=True)
class SourceSpec:
    """A registered source name and the arguments to build it with
    (``make_source(source, *args, **options)``)."""

    source: str
    args: tuple = ()
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        """An unknown name, an option the source does not take, or a value it refuses fails
        here, in the parent, as a ConfigError: building a source opens nothing, and in the
        worker the same mistake would surface in a process of its own, after the others
        started."""
        cls = source_class(self.source)
        accepted = {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
                    if p.kind == p.KEYWORD_ONLY}
        unknown = sorted(set(self.options) - set(accepted))
        if unknown:
            raise ConfigError(f"capture source {self.source}: no option {unknown[0]}; it takes "
                              f"{', '.join(accepted)} (docs/capture.md, 'Source parameters')")
        for key, value in self.options.items():
            if isinstance(accepted[key], int) and not isinstance(value, int):
                raise ConfigError(f"capture source {self.source}: {key}={value!r} is not a number "
                                  f"(default {accepted[key]})")
        try:
            cls(*self.args, **self.options)
        except ValueError as exc:
            raise ConfigError(f"capture source {self.source}: {exc}") from None

    def locate(self) -> None:
        """The source's target is there (:meth:`CaptureSource.locate`), checked from the
        parent: a mistyped interface stops a command before its start-up work, not after."""
        make_source(self.source, *self.args, **self.options).locate()

    @classmethod
    def parse(cls, target: str, default: str = "af_xdp", **options) -> SourceSpec:
        """A command-line capture target: ``[SOURCE:]IFACE[@NETNS]`` for live sources
        (``eth2``, ``af_packet:eth2``, ``af_xdp:c0@cpu0``) or ``pcap:PATH`` for a file;
        ``default`` is the source when none is named. ``options`` go to the source."""
        source, sep, rest = target.partition(":")
        if not sep:
            source, rest = default, target
        if source == "pcap":
            if not rest:
                raise ConfigError(f"capture target {target!r}: pcap needs a file (pcap:PATH)")
            return cls("pcap", (rest,), options)
        iface, _, namespace = rest.partition("@")
        if not iface or "/" in iface or len(iface) > 15:
            raise ConfigError(f"capture target {target!r}: {iface!r} is not an interface name "
                              f"(expected [SOURCE:]IFACE[@NETNS], e.g. af_xdp:eth2 or af_packet:c0@cpu0)")
        return cls(source, (iface,), {"netns": namespace or None, **options})


class _Throttle:
    def __init__(self, every: float, action):
        self.every, self.action, self.last = every, action, 0.0

    def __call__(self):
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.action()


#: The worker's own counters, published after the source's.
WORKER_COUNTERS = ("cpu_us",)


def _worker_counters() -> dict[str, int]:
    return {"cpu_us": int(time.process_time() * 1e6)}


def _publish(source, ring: FrameRing) -> None:
    counters = {**source.counters(), **_worker_counters()}
    ring.publish([counters[name] for name in source.counter_names() + WORKER_COUNTERS])


class StopFlag:
    """A stop flag that a worker process and its parent share, and that nothing can leave
    locked: one byte of shared memory, written by :meth:`set` and read by :meth:`is_set`.
    A ``multiprocessing.Event`` takes a lock in every ``is_set()``, which a capture loop calls
    between its polls: a worker killed while holding it (SIGKILL, the OOM killer) left its
    parent's ``set()`` blocked for good, and the appliance hung after its capture worker died
    (``tests/gradtap/test_run.py``, once under the suite's load); SIGTERM's handler, calling
    ``set()`` in the middle of the worker's own ``is_set()``, could block the worker. A stop
    seen one poll late costs nothing: nothing here waits on the flag."""

    def __init__(self, ctx: multiprocessing.context.BaseContext):
        self._byte = ctx.RawValue(ctypes.c_uint8, 0)

    def set(self) -> None:
        self._byte.value = 1

    def is_set(self) -> bool:
        return self._byte.value != 0


def _worker_main(spec: SourceSpec, ring: FrameRing, cpu: int | None, stop, conn, stats_every: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    source = None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        source = make_source(spec.source, *spec.args, **spec.options)
        source.open()
        # The first pass loads the compiled kernels (tens of milliseconds from Numba's
        # cache): do it before reporting ready, not while the first frames pile up.
        source.receive(ring, 0.0)
        conn.send(("ready", {"pid": os.getpid(), **source.info()}))
        source.run(ring, stop, on_tick=_Throttle(stats_every, lambda: _publish(source, ring)))
        source.close()
        _publish(source, ring)
        conn.send(("done", {**source.stats(), **_worker_counters()}))
    except CaptureError as exc:
        conn.send(("error", str(exc)))
        raise SystemExit(2) from None
    except BaseException:
        conn.send(("error", f"capture worker for {spec.source} crashed:\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if source is not None:
            source.close()
        ring.close_producer()
        conn.close()


class CaptureWorker:
    """Run ``spec`` into ``ring`` in a separate process.

    Parameters
    ----------
    spec:
        The source to open (:class:`SourceSpec`).
    ring:
        The frame ring it writes (the worker is its only producer).
    cpu:
        CPU to pin the worker to (None: let the scheduler choose).
    name:
        Process name (shown by ``ps``), e.g. the mirror stream's name.
    start_method:
        ``multiprocessing`` start method; ``spawn`` by default.
    stats_every:
        Seconds between counter publications to the ring.
    """

    def __init__(self, spec: SourceSpec, ring: FrameRing, *, cpu: int | None = None, name: str = "gradtap-capture",
                 start_method: str = "spawn", stats_every: float = 0.2):
        if cpu is not None and cpu not in os.sched_getaffinity(0):
            raise CaptureError(f"cpu {cpu} is not one this process may run on "
                               f"({sorted(os.sched_getaffinity(0))})")
        self.spec, self.ring, self.cpu, self.name = spec, ring, cpu, name
        self._ctx = multiprocessing.get_context(start_method)
        self._stop = StopFlag(self._ctx)
        self._conn, child = self._ctx.Pipe(duplex=False)
        self._process = self._ctx.Process(target=_worker_main, name=name, daemon=True,
                                          args=(spec, ring, cpu, self._stop, child, stats_every))
        self._child_conn = child
        self.info: dict[str, object] = {}
        self.final: dict[str, int] | None = None
        self.error: str | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def start(self, timeout: float = 120.0) -> dict[str, object]:
        """Start the process and wait until the source is open; returns its ``info()``.
        Raises CaptureError with the worker's message if opening failed or took longer
        than ``timeout`` seconds (the first start may compile the capture kernels)."""
        self._process.start()
        self._child_conn.close()
        message = self._receive(timeout)
        if message is None or message[0] != "ready":
            self._kill()
            raise CaptureError(self.error or f"capture worker {self.name} did not open its source "
                                             f"within {timeout} s")
        self.info = message[1]
        return self.info

    def _receive(self, timeout: float):
        """The next message from the worker, or None on timeout or if it died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._conn.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
                try:
                    message = self._conn.recv()
                except EOFError:
                    return None
                if message[0] == "error":
                    self.error = message[1]
                elif message[0] == "done":
                    self.final = message[1]
                return message
            if not self._process.is_alive() and not self._conn.poll():
                return None
        return None

    def stats(self) -> dict[str, int]:
        """Live counters: the source's and the worker's (``WORKER_COUNTERS``), as last
        published, and the ring's."""
        names = source_class(self.spec.source).counter_names() + WORKER_COUNTERS
        out = dict(zip(names, (int(v) for v in self.ring.source_counters(len(names)))))
        out.update(self.ring.stats())
        return out

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """Set the stop flag and wait for the worker to close its source; its final
        counters. CaptureError if the worker failed or did not stop within ``timeout``."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self.final is None and self.error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._receive(remaining) is None:
                break
        self._process.join(max(0.0, deadline - time.monotonic()))
        if self._process.is_alive():
            self._kill()
            raise CaptureError(f"capture worker {self.name} (pid {self.pid}) did not stop within {timeout} s; "
                               f"killed")
        if self.error is not None:
            raise CaptureError(self.error)
        if self.final is None:
            raise CaptureError(f"capture worker {self.name} exited with code {self.exitcode} without "
                               f"reporting its counters")
        return self.final

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(2.0)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(2.0)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        if self._process.is_alive():
            try:
                self.stop()
            except CaptureError:
                if exc[0] is None:
                    raise
