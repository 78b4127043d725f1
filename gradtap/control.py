"""The control plane: the event log, the trainer's fallback endpoint, and the stale flag.

When an iteration cannot be recovered (some gradient block reached no mirror stream), the
replica can no longer follow the trainer. The appliance then

1. appends a ``fallback`` event to the event log (one JSON object per line, fsynced);
2. POSTs the same JSON to the trainer's control endpoint when the job configures one,
   asking for a regular checkpoint (bounded timeout; a failure is logged, never raised);
3. marks the replica stale: no snapshot is written until a resync from a trainer
   checkpoint (``gradtap resync`` or a POST to the appliance) clears it. The last snapshot
   written before stays valid: it is the last iteration the replica got right.

The event log exists from the start (empty until the first event), so that an operator can
follow it with ``tail -f`` as soon as the appliance runs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gradtap.core.errors import ConfigError, GradtapError

if TYPE_CHECKING:
    from gradtap.status import ApplianceStatus

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, event_log: Path, endpoint: str | None = None, timeout_s: float = 2.0):
        self.event_log = Path(event_log)
        self.event_log.parent.mkdir(parents=True, exist_ok=True)
        self.event_log.touch()
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


class ControlServer:
    """The appliance's own control endpoint (on 127.0.0.1 unless told otherwise).

    ``POST /resync`` with ``{"checkpoint": "/path/to/trainer-checkpoint.pt"}`` hands a trainer
    checkpoint (``{"model", "optimizer", "iteration"}``, as ``torch.save``d by the trainer, or
    a gradtap snapshot directory) to ``offer``: a stale replica resynchronises from it when
    the streams reach its iteration. ``GET /status`` returns ``status()`` as JSON.
    :func:`request_resync` (``gradtap resync``) is the client.
    """

    def __init__(self, offer: Callable[[dict], None], status: Callable[[], "ApplianceStatus"], port: int,
                 address: str = "127.0.0.1"):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from gradtap.checkpoints import load_checkpoint

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path != "/status":
                    return self._reply(404, {"error": f"no {self.path}; try GET /status or POST /resync"})
                self._reply(200, asdict(status()))

            def do_POST(self):  # noqa: N802
                if self.path != "/resync":
                    return self._reply(404, {"error": f"no {self.path}; try POST /resync"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    checkpoint = load_checkpoint(Path(body["checkpoint"]))
                except (ValueError, KeyError, TypeError, GradtapError) as exc:
                    return self._reply(400, {"error": f"cannot use that checkpoint: {exc}"})
                offer(checkpoint)
                self._reply(202, {"accepted": True, "iteration": int(checkpoint["iteration"])})

            def _reply(self, code: int, payload: dict) -> None:
                data = json.dumps(payload, default=str).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((address, port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="gradtap-control", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def request_resync(appliance: str, checkpoint: Path, timeout_s: float = 30.0) -> dict:
    """Ask the appliance at ``appliance`` (its control endpoint URL) to resynchronise from
    ``checkpoint`` (a path the appliance can read); its JSON answer."""
    request = urllib.request.Request(f"{appliance.rstrip('/')}/resync", method="POST",
                                     data=json.dumps({"checkpoint": str(checkpoint.resolve())}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:      # the appliance answered, and refused
        raise ConfigError(f"{appliance} refused it: HTTP {exc.code} {exc.read().decode(errors='replace')}") from None
    except OSError as exc:
        raise ConfigError(f"--appliance {appliance}: no gradtap appliance answered ({exc})") from None
