"""The appliance's status: one typed record, read by metrics, the live view and ``GET /status``."""

from __future__ import annotations

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
