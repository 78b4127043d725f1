"""The appliance's status: one typed record, read by metrics, the live view and ``GET /status``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ApplianceStatus:
    """What a running appliance shows: metrics (``gradtap/metrics.py``), the live status view
    and ``GET /status`` read this."""

    capture: dict[str, dict[str, int]]   # stream -> the ring's and the source's counters (frames, bytes,
                                         # ring_drops, truncated, and e.g. kernel_drops), and the capture
                                         # worker's CPU time, cpu_us (capture/worker.py)
    events: dict[str, dict[str, int]]    # stream -> decode event (``wire/events.py``) -> frames
    recovered: int                       # iterations merged whole
    unrecoverable: int                   # iterations with blocks no stream delivered
    replica_iteration: int               # the next iteration the replica expects
    stale: bool                          # waiting for a resync
    lag_s: float                         # last iteration: its last frame to its update
    parse_s: float                       # seconds spent per stage
    merge_s: float
    update_s: float
    locked: dict[str, bool]              # stream -> locked on to the job's traffic
    numbered: bool = True                # False while it is not known which captured iteration is which
                                         # (waiting for the trainer's checkpoint with time_ns)
    skipped: int = 0                     # captured iterations before the replica's start: not applied
    attested: int = 0                    # the trainer's fingerprints the replica matched
    diverged: int = 0                    # ... and those it did not (each a fallback)
    snapshots: dict[str, int] | None = None  # local snapshots (store/snapshot.py): written, failed, skipped
                                             # (due while the background writer was busy), last_written;
                                             # None: not written by this appliance (a group node's shards)
    store: dict[str, int] | None = None  # the durable tier's upload counters (store/uploader.py):
                                         # submitted, uploaded, skipped, failed, last_uploaded; None: no store
    gradient_log: dict[str, int] | None = None   # the gradient log's counters (store/gradient_log.py):
                                                 # logged, dropped (gaps), failed, last_logged; None: no log
    listening: bool = False              # every capture worker has its source open (frames from now on
                                         # are captured; before, a live port's are not)
    update_backlog: int | None = None    # calls the update thread has queued and not yet made (buckets,
                                         # iterations' ends; the parsers wait once it holds a gradient they
                                         # need); None: the updater runs between rounds, with no thread
    gradients_made_late: int = 0         # iterations' shared gradients made after start-up
                                         # (parser/shared_gradient.py): grad_bytes more memory while each
                                         # serves; the updater was behind, or the streams far apart
    cpu_s: float = 0.0                   # the appliance process's CPU time, user and system: parsers,
                                         # merger, updater and the rest, the capture workers' not included
    group: dict | None = None            # a mirror-group node (gradtap/group.py, GroupNode.report): rank,
                                         # world_size, rendezvous, buckets and elements of its shard, peers
                                         # (rank -> "up" or why it is gone), sent_bytes (and sent_by_kind:
                                         # blocks, protocol), received_bytes; None: not in a group


@dataclass(frozen=True)
class Rates:
    """What a running appliance did a second between two of its statuses: what the live view
    shows, and what a CPU node is sized by (cores per Mpps)."""

    seconds: float                       # between the two statuses
    pps: dict[str, float]                # stream -> frames captured a second
    bps: dict[str, float]                # stream -> bits captured a second
    capture_cores: dict[str, float]      # stream -> its capture worker's CPU time a second (1.0: a whole core)
    appliance_cores: float               # the appliance process's (parsers, merger, updater)

    @property
    def cores(self) -> float:
        """Every process of the appliance: its own and its capture workers'."""
        return self.appliance_cores + sum(self.capture_cores.values())

    @property
    def core_s_per_mframe(self) -> float | None:
        """Core-seconds spent per million frames captured (None: no frame came)."""
        mpps = sum(self.pps.values()) / 1e6
        return self.cores / mpps if mpps > 0 else None


class RateWindow:
    """Rates over the time between successive statuses: call it with each status as it is
    taken; it returns None for the first, and for a status taken no later than the one before."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: tuple[float, ApplianceStatus] | None = None

    def __call__(self, status: ApplianceStatus) -> Rates | None:
        now, last = self._clock(), self._last
        self._last = now, status
        if last is None or now <= last[0]:
            return None
        dt, before = now - last[0], last[1]
        pps, bps, cores = {}, {}, {}
        for name, c in status.capture.items():
            b = before.capture.get(name, {})
            pps[name] = max(0, c.get("frames", 0) - b.get("frames", 0)) / dt
            bps[name] = 8 * max(0, c.get("bytes", 0) - b.get("bytes", 0)) / dt
            if "cpu_us" in c and "cpu_us" in b:
                cores[name] = max(0, c["cpu_us"] - b["cpu_us"]) / 1e6 / dt
        return Rates(dt, pps, bps, cores, max(0.0, status.cpu_s - before.cpu_s) / dt)
