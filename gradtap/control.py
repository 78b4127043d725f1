"""The control plane: the event log, the trainer's fallback endpoint, and the stale flag.

When an iteration cannot be recovered (some gradient block reached no mirror stream), the
replica can no longer follow the trainer. The appliance then

1. appends a ``fallback`` event to the event log (one JSON object per line, fsynced);
2. POSTs the same JSON to the trainer's control endpoint when the job configures one,
   asking for a regular checkpoint (bounded timeout; a failure is logged, never raised),
   with the control token as ``Authorization: Bearer`` when a token file is given (the
   trainer's handler, ``gradtap.trainer.fallback``, refuses a request without it);
3. marks the replica stale: no snapshot is written until a resync from a trainer
   checkpoint (``gradtap resync`` or a POST to the appliance) clears it. The last snapshot
   written before stays valid: it is the last iteration the replica got right.

The event log exists from the start (empty until the first event), so that an operator can
follow it with ``tail -f`` as soon as the appliance runs. The appliance's own endpoint, where
a trainer checkpoint is handed back, is ``gradtap/control_server.py``; :func:`request_resync`
is its client.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from gradtap.control_token import read_token
from gradtap.core.errors import ConfigError
from gradtap.trainer.control_client import Refused, post_json

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, event_log: Path, endpoint: str | None = None, timeout_s: float = 2.0,
                 token_file: Path | None = None):
        self.event_log = Path(event_log)
        self.event_log.parent.mkdir(parents=True, exist_ok=True)
        self.event_log.touch()
        self.endpoint, self.timeout_s, self.token_file = endpoint, timeout_s, token_file
        self.stale = False
        self._lock = threading.Lock()

    def event(self, kind: str, **fields) -> dict:
        """Append one event to the log and return it. A log that cannot be appended to (a full
        disk) loses the event to the process log, never the appliance: the line is written
        whole or not at all."""
        record = {"event": kind, "time": time.time(), **fields}
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        with self._lock:
            try:
                with self.event_log.open("ab", buffering=0) as f:
                    size = f.seek(0, os.SEEK_END)
                    try:
                        if f.write(line) != len(line):
                            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                        os.fsync(f.fileno())
                    except OSError:
                        f.truncate(size)
                        raise
            except OSError as exc:
                log.error("%s: cannot append the event (%s): %s", self.event_log, exc.strerror, line.decode().strip())
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
        headers = {"Content-Type": "application/json"}
        try:
            if self.token_file is not None:     # read at each post: the server creates the file after us
                headers["Authorization"] = f"Bearer {read_token(self.token_file).decode()}"
            request = urllib.request.Request(self.endpoint, data=body, method="POST", headers=headers)
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except (OSError, ConfigError) as exc:   # URLError, HTTP errors, timeouts, refused connections, no token
            log.warning("control endpoint %s did not take the fallback event: %s", self.endpoint, exc)
            self.event("fallback_post_failed", endpoint=self.endpoint, error=str(exc))


def request_resync(appliance: str, checkpoint: Path, token_file: Path, timeout_s: float = 330.0) -> dict:
    """Ask the appliance at ``appliance`` (its control endpoint URL) to resynchronise from
    ``checkpoint`` (a path the appliance can read, under one of its ``--resync-dir``s),
    authenticated with the token in ``token_file``; its JSON answer (``gradtap/control_server.py``).
    The timeout leaves room for the appliance to read and check a large checkpoint."""
    token = read_token(token_file).decode()
    try:
        return post_json(f"{appliance.rstrip('/')}/resync", {"checkpoint": str(Path(checkpoint).resolve())},
                         token, timeout_s)
    except Refused as exc:      # the appliance answered, and refused
        status = f"HTTP {exc.code}: " if exc.code else ""
        raise ConfigError(f"{appliance} refused it: {status}{exc.reason}") from None
    except OSError as exc:
        raise ConfigError(f"--appliance {appliance}: no gradtap appliance answered ({exc})") from None
