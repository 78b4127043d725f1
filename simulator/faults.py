"""Faults the simulator injects, and what each stream ended up with.

Two kinds, matching where they happen on a real fabric:

- **training-link faults** (``link_loss``, ``corrupt``) happen on the link between GPU
  nodes. The sender retransmits (go-back-N), so every mirror of that link sees the original
  frame (corrupted: with a bad ICRC) and the resent ones. They never change the gradient.
- **mirror faults** (``mirror_loss``, ``reorder``, ``duplicate``, ``truncate``) happen on
  the mirror path to one CPU node; nothing is ever resent for them. Each stream draws its own.

The specification is ``name=value`` pairs separated by commas; a pair may be prefixed by a
stream name (``r0-egress.mirror_loss=0.01``) to apply to that stream only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from gradtap.core.errors import ConfigError
from gradtap.simulator.traffic import LinkFaults

MIN_TRUNCATED = 14  # a truncated frame keeps at least its Ethernet header


@dataclass(frozen=True)
class MirrorFaults:
    mirror_loss: float = 0.0
    reorder: float = 0.0
    duplicate: float = 0.0
    truncate: float = 0.0


@dataclass(frozen=True)
class FaultSpec:
    link_loss: float = 0.0
    corrupt: float = 0.0
    mirrors: MirrorFaults = MirrorFaults()
    per_stream: dict[str, MirrorFaults] = field(default_factory=dict)

    def link(self) -> LinkFaults:
        return LinkFaults(loss=self.link_loss, corrupt=self.corrupt)

    def for_stream(self, name: str) -> MirrorFaults:
        return self.per_stream.get(name, self.mirrors)


_MIRROR_NAMES = {f.name for f in fields(MirrorFaults)}
_LINK_NAMES = {"link_loss", "corrupt"}


def parse_faults(text: str, streams: tuple[str, ...]) -> FaultSpec:
    """Parse ``--faults``; errors name the pair, the value and what is allowed."""
    spec = FaultSpec()
    overrides: dict[str, dict[str, float]] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError(f"--faults: {pair!r} is not name=value")
        stream, dot, key = name.strip().rpartition(".")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--faults: {name}={raw!r} is not a number") from None
        if not 0.0 <= value <= 0.5:
            raise ConfigError(f"--faults: {name}={value} must be a probability between 0 and 0.5")
        if key in _LINK_NAMES and not dot:
            spec = replace(spec, **{key: value})
        elif key in _MIRROR_NAMES and not dot:
            spec = replace(spec, mirrors=replace(spec.mirrors, **{key: value}))
        elif key in _MIRROR_NAMES:
            if stream not in streams:
                raise ConfigError(f"--faults: stream {stream!r} is not in the job; streams: {', '.join(streams)}")
            overrides.setdefault(stream, {})[key] = value
        else:
            allowed = sorted(_LINK_NAMES | _MIRROR_NAMES)
            raise ConfigError(f"--faults: unknown fault {key!r}; allowed: {', '.join(allowed)} "
                              f"(mirror faults may be prefixed by a stream name)")
    per_stream = {s: replace(spec.mirrors, **o) for s, o in overrides.items()}
    return replace(spec, per_stream=per_stream)


@dataclass
class MirrorOutcome:
    """Which input frames a mirror delivers, in what order, and how much of each."""

    index: np.ndarray     # int64: input frame of each delivered frame
    caplen: np.ndarray    # int32: bytes captured of each delivered frame (< length if truncated)
    counts: dict[str, int]


def apply_mirror_faults(lengths: np.ndarray, faults: MirrorFaults, rng: np.random.Generator) -> MirrorOutcome:
    """Decide the fate of ``len(lengths)`` frames on one mirror path."""
    n = len(lengths)
    kept = np.flatnonzero(rng.random(n) >= faults.mirror_loss)
    dup = rng.random(len(kept)) < faults.duplicate
    index = np.repeat(kept, 1 + dup)
    swap = np.flatnonzero(rng.random(max(len(index) - 1, 0)) < faults.reorder)
    swap = swap[np.r_[True, np.diff(swap) > 1]] if len(swap) else swap  # non-overlapping pairs
    index[swap], index[swap + 1] = index[swap + 1], index[swap].copy()
    caplen = lengths[index].astype(np.int32)
    cut = np.flatnonzero((rng.random(len(index)) < faults.truncate) & (caplen > MIN_TRUNCATED + 1))
    caplen[cut] = rng.integers(MIN_TRUNCATED, caplen[cut])
    counts = {"mirror_loss": n - len(kept), "duplicate": int(dup.sum()), "reorder": len(swap), "truncate": len(cut)}
    return MirrorOutcome(index.astype(np.int64), caplen, counts)
