"""Numbering captured iterations by the trainer's: where a trainer checkpoint's time falls.

Streams number iterations by their ordinal since the capture began; the replica needs the
trainer's iteration. Nothing on the wire carries it. Three ways give the link:

* **Declared**: the start state is the trainer's state when the capture began (offline
  replay of the simulator's streams from its ``truth/start.pt``; ``--start`` without a
  time): ordinal 0 is the start state's iteration.
* **Anchored**: a trainer checkpoint that also says *when* it was the trainer's state
  (``"time_ns"``: ``CLOCK_REALTIME`` nanoseconds, taken after the optimizer step that made
  it and before the next iteration's forward pass). Its iteration's gradients are the
  first the trainer sends after that moment, so its iteration is the first captured
  iteration that *began* after ``time_ns``: an :class:`Anchor`. The capture must have been
  listening by then: the trainer pauses at least ``appliance.iteration_gap_ns`` between
  the state and its next gradient (the pause lock-on relies on), so a capture that began
  less than that pause after ``time_ns`` cannot have missed an iteration's start.
* **Waiting**: neither. The replica is stale until the trainer offers an anchored
  checkpoint (``POST /resync``), and iterations before it are not applied.

The clocks of the trainer and the mirror node must agree to well within that pause (PTP
or NTP on both hosts does: a training cluster's pause is tens of milliseconds or more).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Anchor:
    iteration: int       # the trainer's iteration of the checkpoint
    time_ns: int         # when the trainer's state was that checkpoint (CLOCK_REALTIME ns)
    source: str          # where the checkpoint came from, for messages: "--start PATH", "POST /resync PATH"


class AnchorRefused(Exception):
    """The anchor cannot be placed in the capture; the message says why."""


@dataclass(frozen=True)
class StreamStarts:
    """What one stream knows of the capture's timeline (``StreamParser.starts``)."""

    capture_ns: int | None            # when the stream began listening (None: nothing seen yet)
    starts: Mapping[int, int]         # ordinal -> time its first job frame was seen


def anchor_of(checkpoint: Mapping, source: str) -> Anchor | None:
    """The anchor a trainer checkpoint carries (its ``time_ns``), or None."""
    t = checkpoint.get("time_ns")
    return None if t is None else Anchor(int(checkpoint["iteration"]), int(t), source)


def anchor_ordinal(anchor: Anchor, streams: Mapping[str, StreamStarts], pause_ns: int) -> int | None:
    """The ordinal of the captured iteration that is ``anchor.iteration``: the first that
    began after ``anchor.time_ns``. ``None`` while no stream has seen one begin after it
    (the trainer has not sent it yet); :class:`AnchorRefused` when no stream can tell or the
    streams disagree. A stream can tell when it was listening by then (less than
    ``pause_ns`` after it) and knows the start of the iteration before the first that began
    after it (or that one is the capture's first): a stream keeps only its recent starts, and
    an iteration it kept no start of may have begun after ``time_ns`` too."""
    found: dict[int, list[str]] = {}
    waiting, unknown = [], []
    for name, s in streams.items():
        if s.capture_ns is None:
            waiting.append(name)
        elif anchor.time_ns < s.capture_ns - pause_ns:
            unknown.append(f"{name} listens since {s.capture_ns} ns, more than the {pause_ns / 1e6:g} ms pause later")
        else:
            after = [o for o, t in s.starts.items() if t > anchor.time_ns]
            if not after:
                waiting.append(name)
            elif min(after) == 0 or min(after) - 1 in s.starts:
                found.setdefault(min(after), []).append(name)
            else:
                unknown.append(f"{name} keeps no start of its iteration {min(after) - 1}")
    if len(found) > 1:
        votes = "; ".join(f"{o} by {', '.join(names)}" for o, names in sorted(found.items()))
        raise AnchorRefused(f"{anchor.source}: the streams disagree on which captured iteration began first after "
                            f"time_ns {anchor.time_ns} ({votes})")
    if found:
        return next(iter(found))
    if unknown and not waiting:
        raise AnchorRefused(f"{anchor.source}: no stream can tell which captured iteration began first after time_ns "
                            f"{anchor.time_ns} of iteration {anchor.iteration} ({'; '.join(unknown)}): iterations may "
                            f"have begun unseen; offer a checkpoint the trainer takes after the appliance started, "
                            f"and ahead of its iteration")
    return None
