"""Background threads of the simulator, and the CPU and wall time of each phase of a run.

The main thread trains and reduces (the ring's values feed the next step, so that work is
the run's critical path); what only turns those values into files runs beside it, on lanes:
one builds each bucket's packets from its partial sums, one per mirror stream encodes and
writes its capture, one writes the ground truth. Each lane runs its jobs one after another in
the order they were submitted, so a file is written exactly as a single thread would write it,
and every random draw (link faults, each stream's mirror faults) happens in the same order. The heavy
parts of those jobs (Numba kernels compiled ``nogil``, NumPy copies, sha256, file writes)
release the GIL, so the lanes use the second core while the main thread computes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

#: Phases of a run: "training" (forward, backward, bucket buffers, optimizer step: the rest of
#: the process's CPU, PyTorch's own threads included), "reduction" (the ring's additions),
#: "traffic" (packet descriptors and payloads), "frames" (frames, mirror faults, capture
#: files), "truth" (ground-truth files), "waiting" (the main thread waiting for a lane).
PHASES = ("training", "reduction", "traffic", "frames", "truth", "waiting")


class PhaseClock:
    """CPU and wall seconds of each phase (``with clock("frames"): ...``), from any thread.

    ``cpu`` counts the CPU time of the thread that runs the phase (``time.thread_time``),
    ``wall`` its wall time on whichever thread, and ``main_wall`` the part of it spent on the
    main thread: the phases' share of the run's critical path.
    """

    def __init__(self):
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.main_wall = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, phase: str):
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            with self._lock:
                self.cpu[phase] += cpu
                self.wall[phase] += wall
                if threading.current_thread() is threading.main_thread():
                    self.main_wall[phase] += wall


class Lane:
    """One background thread running jobs in submission order, each timed as ``phase``.

    :meth:`submit` returns a :class:`~concurrent.futures.Future`; :meth:`wait` blocks until
    every job submitted so far has finished and raises the first error among them.
    """

    def __init__(self, name: str, clock: PhaseClock, phase: str):
        self.clock, self.phase = clock, phase
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gradtap-{name}")
        self._jobs: list[Future] = []

    def submit(self, job: Callable, *args) -> Future:
        def timed():
            with self.clock(self.phase):
                return job(*args)
        future = self._pool.submit(timed)
        self._jobs.append(future)
        return future

    def wait(self) -> None:
        jobs, self._jobs = self._jobs, []
        wait_for(self.clock, jobs)

    def close(self) -> None:
        """Finish the submitted jobs (their errors are dropped: call :meth:`wait` first to
        see them) and end the thread."""
        self._pool.shutdown(wait=True)


def wait_for(clock: PhaseClock, futures: list[Future]) -> None:
    """Wait for every one of ``futures`` (timed as "waiting"), then raise the first error
    among them."""
    with clock("waiting"):
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
