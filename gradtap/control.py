"""The control plane: the event log, the trainer's fallback endpoint, and the stale flag.

When an iteration cannot be recovered (some gradient block reached no mirror stream), the
replica can no longer follow the trainer. The appliance then

1. appends a ``fallback`` event to the event log (one JSON object per line, fsynced);
2. POSTs the same JSON to the trainer's control endpoint when the job configures one,
   asking for a regular checkpoint (bounded timeout; a failure is logged, never raised);
3. marks the replica stale: no snapshot is written until a resync from a trainer
   checkpoint (``gradtap resync`` or a POST to the appliance) clears it. The last snapshot
   written before stays valid: it is the last iteration the replica got right.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, event_log: Path, endpoint: str | None = None, timeout_s: float = 2.0):
        self.event_log = Path(event_log)
        self.event_log.parent.mkdir(parents=True, exist_ok=True)
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.stale = False
        self._lock = threading.Lock()

    def event(self, kind: str, **fields) -> dict:
        """Append one event to the log and return it."""
        record = {"event": kind, "time": time.time(), **fields}
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock, self.event_log.open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        return record

    def fallback(self, iteration: int, reason: str, **fields) -> dict:
        """An unrecoverable iteration: log it, tell the trainer, mark the replica stale."""
        self.stale = True
        record = self.event("fallback", iteration=iteration, reason=reason,
                            request="regular_checkpoint", **fields)
        log.error("iteration %d is unrecoverable (%s): replica marked stale, trainer asked for a checkpoint",
                  iteration, reason)
        if self.endpoint:
            self._post(record)
        return record

    def resynced(self, iteration: int, source: str) -> dict:
        self.stale = False
        return self.event("resync", iteration=iteration, source=source)

    def _post(self, record: dict) -> None:
        body = json.dumps(record).encode()
        request = urllib.request.Request(self.endpoint, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except OSError as exc:   # URLError, timeouts, refused connections
            log.warning("control endpoint %s did not take the fallback event: %s", self.endpoint, exc)
            self.event("fallback_post_failed", endpoint=self.endpoint, error=str(exc))
