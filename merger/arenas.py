"""Where the merger assembles the buckets it cannot hand as a view of a stream's gradient.

Nearly every bucket is handed as a view of the gradient the streams share. A bucket is
assembled only where some copies disagree and the vote goes against the shared bytes (the
shared bytes with the winning blocks laid over, ``merger/union.py``), or where the streams do
not share one buffer (their whole copies merged). Such a bucket must stay unchanged until the
sink is done with its iteration (:class:`~gradtap.merger.merger.Sink`), so each iteration
assembles into a buffer of its own, an *arena* the size of the gradient in which bucket b
lies at its own byte range: the buckets of one iteration never share bytes, and nothing is
allocated per bucket.

Arenas are reused. A bucket assembled in fresh memory paid for faulting its pages in: in the
3-stream GPT-2-small replay with 39 frames of one stream flipped (``benchmarks.replay
--disagree 39``; Xeon family 6 model 167, KVM), a 27 MB bucket took 53-63 ms to assemble and
the 168 MB token embedding 339-398 ms, against 3-4 and 24-25 ms into pages already mapped.
An iteration takes an arena only when one of its buckets must be assembled, and a new arena
is mapped, not faulted in (``np.empty``), so memory is taken only where buckets are
assembled, and kept where they were: a stream that keeps disagreeing in the same buckets
costs their bytes once, not once per iteration. The pipeline gives an iteration's
arena back (:meth:`Arenas.give_back`) when the sink is done with the iteration, on the update
thread when there is one; an arena nobody gives back is dropped with its last view.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

KEEP = 2            # arenas kept for reuse: the iteration being merged, and the one being applied
FINISHED = 8        # finished iterations' arenas awaiting give-back; older ones are dropped


class Arenas:
    """Per iteration in flight, a ``uint8[nbytes]`` arena (``nbytes``: the gradient's bytes)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.made = 0                                  # arenas made (not reused)
        self._of: dict[int, np.ndarray] = {}           # ordinal -> its arena
        self._finished: deque[np.ndarray] = deque(maxlen=FINISHED)
        self._spare: list[np.ndarray] = []
        self._lock = threading.Lock()                  # give_back runs on the update thread

    def of(self, ordinal: int) -> np.ndarray:
        """The arena of iteration ``ordinal``: a spare one, else a new one."""
        arena = self._of.get(ordinal)
        if arena is None:
            with self._lock:
                arena = self._spare.pop() if self._spare else None
            if arena is None:
                arena = np.empty(self.nbytes, np.uint8)
                self.made += 1
            self._of[ordinal] = arena
        return arena

    def finish(self, ordinal: int) -> None:
        """Iteration ``ordinal`` is finished: its arena waits to be given back (:meth:`finished`)."""
        arena = self._of.pop(ordinal, None)
        if arena is not None:
            self._finished.append(arena)

    def finished(self) -> list[np.ndarray]:
        """The arenas of the iterations finished since the last call, to give back once the
        sink is done with those iterations."""
        out = list(self._finished)
        self._finished.clear()
        return out

    def give_back(self, arena: np.ndarray) -> None:
        """The sink is done with the iteration ``arena`` served: it may serve a later one."""
        with self._lock:
            if len(self._spare) < KEEP:
                self._spare.append(arena)
