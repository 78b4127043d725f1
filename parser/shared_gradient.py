"""One gradient buffer per iteration, written by every stream of the job.

The mirror streams of a job carry the same allgather data, forwarded by different ranks. So
that each byte is stored once, every stream's parser places its packets into the same
buffer for an iteration (:class:`IterationGradient`): the first stream to claim a unit (a
packet; an LL128 line) writes it, and every later copy, from any stream, is compared with it
in place (``parser/assemble.py``): by the payload's CRC where both copies came with one (a
Simple packet of a path MTU, its ICRC checked), else byte by byte. Each stream keeps its own
bitmap of the units it holds a copy equal to the buffer's of; a copy that differs is kept
aside, per stream, for the merger's vote (``parser/aside.py``).

:class:`GradientPool` hands the buffers out by iteration ordinal (the streams of one capture
share the ordinals): a parser takes the iteration's buffer as the iteration enters its window
(:meth:`GradientPool.enter`), leaves it as the iteration leaves (:meth:`GradientPool.leave`),
and whoever consumes the retired iterations (the merger, through the pipeline) gives the
buffer back once it is done with it (:meth:`GradientPool.done`). A buffer that no parser
holds any more and whose consumer is done is reused for a later iteration: only its claim
and written bitmaps are cleared, since a unit's bytes mean something only once written.

The buffers are made and faulted in with the pool (``core.memory.prefaulted``); one made
later (:attr:`GradientPool.fresh`) means the consumer is behind, or the streams are far
apart. A consumer on a thread of its own (the pipeline's update thread) says which buffers it
will give back (:meth:`GradientPool.returning`): a parser short of a buffer waits for those
rather than make one, so that the pool holds no more buffers than when the consumer gives
each back before the parsers go on. Parsers run in threads: the pool's bookkeeping is under
a lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from gradtap.core.memory import prefaulted

log = logging.getLogger(__name__)


@dataclass(eq=False)
class IterationGradient:
    """The shared buffers of one iteration."""

    grad: np.ndarray        # uint8[grad_bytes]: the gradient in the wire dtype, meaningful where written
    claim: np.ndarray       # int32[blocks]: units of each coverage block some stream has claimed
    written: np.ndarray     # int32[blocks]: units whose bytes the claiming stream has written
    disputed: np.ndarray    # int32[blocks]: units a stream's differing copy could not be kept aside for
    crc: np.ndarray         # int64[blocks]: the CRC-32 of a written Simple packet's payload (-1: none)
    holders: int = 0        # parsers whose window holds it
    consumed: bool = False  # its consumer is done with it (it is reused once no parser holds it)
    ordinal: int = -1

    @classmethod
    def over(cls, grad: np.ndarray, blocks: int) -> IterationGradient:
        """The buffers of an iteration whose gradient is ``grad``, of ``blocks`` coverage blocks,
        nothing claimed yet."""
        return cls(grad, *(np.zeros(blocks, np.int32) for _ in range(3)), np.full(blocks, -1, np.int64))

    def clear(self) -> None:
        self.claim.fill(0)
        self.written.fill(0)
        self.disputed.fill(0)
        self.crc.fill(-1)


@dataclass(eq=False)
class GradientPool:
    """The iterations' shared buffers of one job's streams: ``grad_bytes`` of gradient and
    ``blocks`` coverage blocks each, ``buffers`` of them made at start-up."""

    grad_bytes: int
    blocks: int
    buffers: int
    fresh: int = 0                  # buffers made after start-up
    _spare: list[IterationGradient] = field(default_factory=list)
    _live: dict[int, IterationGradient] = field(default_factory=dict)
    _returning: list[IterationGradient] = field(default_factory=list)   # given back later (returning())
    _lock: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self._spare = [self._make() for _ in range(self.buffers)]

    def _make(self, later: bool = False) -> IterationGradient:
        # One made later is faulted in only where written (it may serve one iteration only).
        grad = np.zeros(self.grad_bytes, np.uint8) if later else prefaulted(self.grad_bytes)
        return IterationGradient.over(grad, self.blocks)

    def enter(self, ordinal: int) -> IterationGradient:
        """The buffer of iteration ``ordinal`` for a parser whose window it enters."""
        with self._lock:
            it = self._live.get(ordinal)
            # The consumer's thread never waits for a parser, so this wait ends; meanwhile
            # another stream's parser may enter the iteration first.
            while it is None and not self._spare and self._returning:
                self._lock.wait()
                it = self._live.get(ordinal)
            if it is None:
                if self._spare:
                    it = self._spare.pop()
                    it.clear()
                else:
                    self.fresh += 1
                    log.debug("gradient buffer %d made after start-up (iteration %d)", self.fresh, ordinal)
                    it = self._make(later=True)
                it.ordinal, it.consumed, it.holders = ordinal, False, 0
                self._live[ordinal] = it
            it.holders += 1
            return it

    def leave(self, it: IterationGradient) -> None:
        """A parser's window no longer holds ``it``."""
        with self._lock:
            it.holders -= 1
            if it.holders == 0:
                # No parser writes it any more; a parser that reaches the iteration later
                # gets a buffer of its own (its copies are then compared, not shared).
                if self._live.get(it.ordinal) is it:
                    del self._live[it.ordinal]
                if it.consumed:
                    self._reuse(it)

    def returning(self, it: IterationGradient) -> None:
        """The consumer, on another thread, will be :meth:`done` with ``it``: until then a
        parser that needs a buffer and finds none spare waits for it."""
        with self._lock:
            self._returning.append(it)

    def done(self, it: IterationGradient, ordinal: int) -> None:
        """The consumer of iteration ``ordinal`` (every retired copy of it) is done with its
        gradient ``it`` (nothing happens when ``it`` serves another iteration by now)."""
        with self._lock:
            if any(r is it for r in self._returning):
                self._returning = [r for r in self._returning if r is not it]
                self._lock.notify_all()
            if it.consumed or it.ordinal != ordinal:
                return
            it.consumed = True
            if it.holders == 0:
                self._reuse(it)

    def _reuse(self, it: IterationGradient) -> None:
        if len(self._spare) < self.buffers and all(s is not it for s in self._spare):
            self._spare.append(it)
