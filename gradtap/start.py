"""How a replica starts and learns which captured iteration is which (``merger/numbering.py``).

* A start state with a ``time_ns`` is **anchored**: its iteration is the first captured
  iteration that began after that time. Until the streams show one, nothing is applied;
  if they cannot (the capture began too late), the replica is stale (a ``fallback``).
* A start state without one is **declared**: it is the trainer's state when the capture
  began (the simulator's ``truth/start.pt`` describes its streams so, and carries a time
  too). Nothing can check this; the operator's word is taken.
* No start state (``gradtap run`` without ``--start``): the replica **waits**, stale, for the
  trainer to offer a checkpoint with a ``time_ns`` (``POST /resync``, ``gradtap resync``).

Once iterations are numbered, an offered checkpoint's iteration says where it belongs; a
``time_ns`` it carries is checked against the numbering. Each placement is an
``anchor.placed`` event, each refusal an ``anchor.refused`` event (an offer refused so is
dropped: the replica does not resync from it).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import NamedTuple

from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.merger.numbering import Anchor, anchor_of
from gradtap.pipeline import Pipeline
from gradtap.updater.replica import Offer, Replica, seed_checkpoint
from gradtap.workload.spec import JobSpec

log = logging.getLogger(__name__)


@dataclass
class ReplicaStart:
    checkpoint: dict | None          # what the replica is built from (waiting: the seed state, for its shapes);
    #                                  None once taken (take_checkpoint)
    first_iteration: int | None      # declared: the capture's first iteration; None: anchored or waiting
    anchor: Anchor | None            # anchored: where the start state falls
    source: str                      # where the start state came from, for messages
    fallback: tuple[int, str] | None = None   # waiting because the named start failed: (iteration, why)
    handed_over: bool = True         # nothing else keeps the checkpoint (take_checkpoint)

    @property
    def waiting(self) -> bool:
        return self.first_iteration is None and self.anchor is None

    def take_checkpoint(self) -> dict:
        """The state to build the replica from, handed over once. The start keeps no reference
        to it. When it was :attr:`handed_over` (nothing else keeps it), the replica takes each
        tensor out of it as it copies it (``Replica(..., consume=start.handed_over)``), so that
        its tensors (12 bytes per parameter, as much as the replica itself) are freed one by
        one instead of being held beside the replica's whole state."""
        if self.checkpoint is None:
            raise RuntimeError(f"{self.source}: the start state was taken already; a ReplicaStart builds one replica")
        checkpoint, self.checkpoint = self.checkpoint, None
        return checkpoint


def replica_start(job: JobSpec, checkpoint: dict | ReplicaStart | None, source: str, *,
                  handed_over: bool = True) -> ReplicaStart:
    """How a replica of ``job`` starts from ``checkpoint`` (``None``: it waits for the trainer; a
    :class:`ReplicaStart` is itself). ``handed_over``: nothing else keeps ``checkpoint``, which
    the replica then empties as it copies it (:meth:`ReplicaStart.take_checkpoint`)."""
    if isinstance(checkpoint, ReplicaStart):
        return checkpoint
    if checkpoint is None:
        return ReplicaStart(seed_checkpoint(job, 0), None, None, "the trainer's first offer")
    _check_time(checkpoint.get("time_ns"), source)
    anchor = anchor_of(checkpoint, source)
    return ReplicaStart(checkpoint, int(checkpoint["iteration"]) if anchor is None else None, anchor, source,
                        handed_over=handed_over)


def _check_time(time_ns, source: str) -> None:
    if time_ns is not None and (isinstance(time_ns, bool) or not isinstance(time_ns, int) or time_ns < 0):
        raise ConfigError(f"{source}: time_ns is {time_ns!r}; expected the CLOCK_REALTIME nanoseconds (an int >= 0) "
                          "at which the trainer's state was this checkpoint, or no time_ns")


class OfferMade(NamedTuple):
    """An offered checkpoint made ready to hold (:meth:`Numbering.make_offer`)."""

    offer: Offer
    anchor: Anchor | None       # where its time_ns places it, when it has one


class Numbering:
    """Ties a replica to the captured iterations for the appliance and replay: builds the
    pipeline's numbering from a :class:`ReplicaStart`, takes offers, and reports where each
    anchor fell (``Pipeline(on_anchor=Numbering.placed)``)."""

    def __init__(self, start: ReplicaStart, replica: Replica, control: ControlPlane):
        self.start, self.replica, self.control = start, replica, control
        # The pipeline holds ``placed``, so a reference back to it would make a cycle that
        # keeps the replica and the pipeline's buffers (gigabytes) alive until a full
        # collection, long after they are dropped.
        self._pipeline: weakref.ref[Pipeline] | None = None
        if start.waiting:
            replica.stale = True
            control.event("replica.waiting", reason="no start state: the replica waits for the trainer's checkpoint "
                                                    "with time_ns (POST /resync, gradtap resync)")
            log.warning("no start state: the replica is stale until the trainer offers a checkpoint with time_ns")
            if start.fallback is not None:      # it was to start from a state that is not there: ask for one
                control.fallback(*start.fallback)

    @property
    def pipeline(self) -> Pipeline | None:
        return None if self._pipeline is None else self._pipeline()

    def attach(self, pipeline: Pipeline) -> None:
        self._pipeline = weakref.ref(pipeline)
        if self.start.anchor is not None:
            pipeline.anchor(self.start.anchor, start=True)

    def make_offer(self, checkpoint: dict, source: str, *, handed_over: bool = False) -> OfferMade:
        """A trainer checkpoint to resync from, made ready (``Replica.make_offer``) but not held
        (:meth:`offer`): the slow part, which the appliance runs without its locks.
        ``handed_over``: nothing else keeps its tensors, which leave it as they are copied, so
        that it and the offer's state are not both held. A replica that began waiting takes,
        until its iterations are numbered, only one with ``time_ns``, which then numbers them."""
        _check_time(checkpoint.get("time_ns"), source)
        anchor = anchor_of(checkpoint, source)
        self._numbered_or_timed(anchor, source)      # before the copy; :meth:`offer` checks again
        return OfferMade(self.replica.make_offer(checkpoint, consume=handed_over), anchor)

    def offer(self, made: OfferMade, source: str) -> list[int]:
        """Hold an offer :meth:`make_offer` made, as the one pending (``Replica.hold`` with
        ``only``), and place its anchor; the iterations of the offers it replaced."""
        self._numbered_or_timed(made.anchor, source)
        replaced = self.replica.hold(made.offer, only=True)
        if made.anchor is not None:
            self.pipeline.anchor(made.anchor)
        return replaced

    def _numbered_or_timed(self, anchor: Anchor | None, source: str) -> None:
        if anchor is None and self.start.waiting and not self.pipeline.numbered:
            raise ConfigError(f"{source}: the appliance does not know yet which captured iteration is which (it "
                              f"started without a start state); offer a checkpoint with time_ns, the CLOCK_REALTIME "
                              f"nanoseconds at which the trainer's state was this checkpoint")

    def placed(self, anchor: Anchor, ordinal: int | None, refused: str | None) -> None:
        if refused is None:
            self.control.event("anchor.placed", iteration=anchor.iteration, time_ns=anchor.time_ns,
                               captured_iteration=ordinal, source=anchor.source)
            log.info("%s: iteration %d is the capture's iteration %d", anchor.source, anchor.iteration, ordinal)
            return
        self.control.event("anchor.refused", iteration=anchor.iteration, time_ns=anchor.time_ns,
                           source=anchor.source, reason=refused)
        log.error("%s", refused)
        if anchor is self.start.anchor:
            if self.replica.open_iteration is not None:
                self.replica.abort()
            self.replica.stale = True
            self.control.fallback(anchor.iteration, f"the start state cannot be placed in the capture: {refused}")
        elif self.replica.offers.get(anchor.iteration) is not None:
            del self.replica.offers[anchor.iteration]
