"""The updater on a thread of its own: the sink's calls, queued and made in order.

Without it a pipeline round stops while the sink steps the replica: with clipping, the
whole Adam pass follows an iteration's last bucket (0.06 s for GPT-2 small on 2 cores, some
seconds for a model of billions of parameters), and a live capture's rings fill meanwhile.
With it, the round thread queues the merger's calls (:class:`UpdateThread` is the merger's
:class:`~gradtap.merger.merger.Sink`) and goes on parsing the next iteration, while this
thread makes the calls one after another, in the order they were queued. The pipeline
starts one only where the host has cores its parsers leave free
(``gradtap.pipeline.overlapping``).

- **Locking.** Each sink call is made under ``lock``. Whatever else reads or changes the
  replica and its sink (the appliance's status, the trainer's offers and attestations) takes
  the same lock, and never waits for a round while it holds it. The round thread never
  takes it: what it has for the replica (an anchor's outcome) it queues here too
  (:meth:`call`), after the buckets handed before it.
- **What a call hands over stays as it is until the call has run.** The merger's buckets
  are views of the iterations' shared gradients. The pipeline queues each gradient's return
  to the pool after its iteration's ``iteration_done`` (:meth:`release`), and a parser short
  of a buffer waits for those returns (``GradientPool.returning``) rather than make a
  buffer. So the pool holds as many buffers as it would if the round had waited, and the
  parsers are held up only when they would otherwise have overtaken the updater.
- **Failure.** A call that raises stops the sink: the error is logged at once and raised
  by the round thread's next :meth:`check` (a round, or the end of input). Sink calls queued
  after it are dropped: nothing is applied past a failure. Releases still run, so no parser
  waits for a buffer forever.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.core.jit import fit_threads
from gradtap.merger.merger import IterationReport, Sink

log = logging.getLogger(__name__)


class UpdateThread:
    """``sink``'s calls, made on a thread of its own (on ``cpus``, when given: the threads its
    Numba kernels start inherit them, and are as many as the cores) in the order they are
    queued, each under ``lock``. A :class:`~gradtap.merger.merger.Sink` itself."""

    def __init__(self, sink: Sink, lock: threading.Lock, cpus: frozenset[int] = frozenset(),
                 name: str = "gradtap-update"):
        self.sink, self.lock = sink, lock
        self.failure: BaseException | None = None     # the first call that raised
        self.queued = 0                                # calls queued so far
        self.made = 0                                  # of those, made (or dropped after a failure)
        self._queue: deque[tuple[bool, Callable[..., Any], tuple]] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._pinned = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        try:
            if cpus:
                os.sched_setaffinity(self._thread.native_id, cpus)
        except OSError as exc:
            self._pinned.set()
            self.close()
            raise ConfigError(f"update cores {sorted(cpus)}: {exc.strerror}; give cores this process may run "
                              f"on ({sorted(os.sched_getaffinity(0))})") from None
        self._pinned.set()

    def bucket(self, iteration: int, bucket: int, data: np.ndarray) -> None:
        self.call(self.sink.bucket, iteration, bucket, data)

    def iteration_done(self, iteration: int, report: IterationReport) -> None:
        self.call(self.sink.iteration_done, iteration, report)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` under the lock, after every call queued before it; dropped once a
        call has failed."""
        self._put(False, fn, args)

    def release(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` after every call queued before it, without the lock, even after a
        failure: it gives back what those calls were reading."""
        self._put(True, fn, args)

    @property
    def backlog(self) -> int:
        """Calls queued and not yet made."""
        return self.queued - self.made

    def check(self) -> None:
        """Raise the error of the call that failed, if one did."""
        if self.failure is not None:
            raise self.failure

    def drain(self) -> None:
        """Wait until every call queued so far is made, then :meth:`check`."""
        with self._changed:
            mark = self.queued
            while self.made < mark:
                self._changed.wait()
        self.check()

    def close(self) -> None:
        """Make what is queued, then end the thread (errors are left to :meth:`check`)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    def _put(self, always: bool, fn: Callable[..., Any], args: tuple) -> None:
        with self._changed:
            if self._closing:
                raise GradtapError(f"{self._thread.name}: closed; nothing more can be queued")
            self._queue.append((always, fn, args))
            self.queued += 1
            self._changed.notify_all()

    def _run(self) -> None:
        self._pinned.wait()
        try:
            fit_threads()
        except (OSError, ValueError) as exc:      # the kernels then run on Numba's own count
            log.warning("%s: Numba's thread count left as it is (%s)", self._thread.name, exc)
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return
                always, fn, args = self._queue.popleft()
            if always or self.failure is None:
                try:
                    with nullcontext() if always else self.lock:
                        fn(*args)
                except BaseException as exc:       # raised by the round thread (check)
                    if self.failure is None:
                        self.failure = exc
                        log.error("%s: %s failed (%s: %s); the sink stops here", self._thread.name,
                                  getattr(fn, "__qualname__", fn), type(exc).__name__, exc)
            with self._changed:
                self.made += 1
                self._changed.notify_all()
