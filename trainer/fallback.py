"""The trainer's answer to the appliance's fallback: a regular checkpoint, handed back.

When the replica can no longer follow the trainer (an unrecoverable iteration, an attestation
mismatch), the appliance POSTs a ``fallback`` event to the trainer's control endpoint
(``appliance.control_endpoint``; ``gradtap/control.py``) and marks its replica stale. The
:class:`FallbackHandler` is that endpoint: a small HTTP listener in a thread of rank 0 that
records the request, and a :meth:`~FallbackHandler.step_boundary` call the training loop
makes after ``optimizer.step()``. At the first boundary after a request it saves a regular
checkpoint into a directory the appliance takes checkpoints from (one of its
``--resync-dir``) and hands it back with ``POST /resync``, as ``gradtap resync`` does:

    handler = FallbackHandler(FallbackSettings("http://mirror-node:9465", token_file, ckpt_dir))
    # the job's appliance.control_endpoint: handler.endpoint
    for it in range(start, iterations):
        ...; optimizer.step()
        handler.step_boundary(model, optimizer, it + 1)   # the state whose forward pass comes next

The checkpoint is ``{"model", "optimizer", "iteration", "time_ns"}`` (``time_ns``: the
CLOCK_REALTIME nanoseconds at the boundary, which a waiting appliance numbers its captured
iterations by: ``gradtap/start.py``), written atomically (temporary file, fsync, rename).

Bounded and never in the way of training: one request is pending at a time (a repeated one
coalesces into it); the listener takes one connection at a time, reads at most
``max_body_bytes`` within ``request_timeout_s``, and refuses a request without the control
token (the appliance's token file, ``Authorization: Bearer``) before reading its body. An
appliance that cannot be reached or refuses the checkpoint is logged and counted, and the
request stays pending for the next boundary, up to ``attempts`` boundaries.
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradtap.core.errors import ConfigError
from gradtap.trainer.control_client import post_json

log = logging.getLogger(__name__)

PREFIX = "fallback-"      # the checkpoints this handler writes: fallback-<iteration>.pt


@dataclass(frozen=True)
class FallbackSettings:
    """Where the checkpoint goes and how the listener listens.

    ``appliance``: the appliance's control endpoint URL (``gradtap run --control-port``).
    ``token_file``: its control token file. ``checkpoint_dir``: a directory both the trainer
    writes and the appliance reads (one of its ``--resync-dir``). ``port`` 0: any free port
    (:attr:`FallbackHandler.endpoint` says which). ``keep``: fallback checkpoints kept in
    ``checkpoint_dir``, newest first. ``attempts``: boundaries at which one request is tried.
    """

    appliance: str
    token_file: Path
    checkpoint_dir: Path
    address: str = "127.0.0.1"
    port: int = 0
    path: str = "/fallback"
    max_body_bytes: int = 64 << 10
    request_timeout_s: float = 10.0
    resync_timeout_s: float = 330.0       # the appliance reads and checks the whole checkpoint
    keep: int = 2
    attempts: int = 3

    def __post_init__(self):
        if not self.appliance.startswith(("http://", "https://")):
            raise ConfigError(f"fallback appliance: {self.appliance!r} is not an http(s) URL; give the appliance's "
                              "control endpoint, e.g. http://mirror-node:9465")
        if not Path(self.checkpoint_dir).is_dir():
            raise ConfigError(f"fallback checkpoint_dir: {self.checkpoint_dir} is not a directory; give one the "
                              "appliance takes checkpoints from (gradtap run --resync-dir)")
        if not self.path.startswith("/"):
            raise ConfigError(f"fallback path: {self.path!r} must start with '/'")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"fallback port: {self.port} is not a TCP port (0-65535)")
        for name in ("max_body_bytes", "keep", "attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"fallback {name}: {getattr(self, name)}; must be at least 1")
        for name in ("request_timeout_s", "resync_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fallback {name}: {getattr(self, name)}; must be more than 0 seconds")


@dataclass
class FallbackCounts:
    """What the handler has seen and done since it started."""

    requests: int = 0        # fallback events taken
    coalesced: int = 0       # ... of which arrived while one was pending
    refused: int = 0         # requests answered 4xx (no token, not a fallback event, too large)
    handed_back: int = 0     # checkpoints the appliance accepted
    failed: int = 0          # hand-backs that failed (saved or not): retried at the next boundary
    abandoned: int = 0       # requests given up after ``attempts`` failures
    checkpoints: list[Path] = field(default_factory=list)    # those handed back, oldest first


class FallbackHandler:
    """The trainer's control endpoint (``POST settings.path``) and the step-boundary hook.

    Serves from construction to :meth:`close`; the training loop calls
    :meth:`step_boundary` after every optimizer step (on the rank that holds the full state,
    rank 0 for DDP).
    """

    def __init__(self, settings: FallbackSettings):
        self.settings = settings
        self._token = read_token(settings.token_file)
        self.counts = FallbackCounts()
        self._lock = threading.Lock()
        self._pending: dict | None = None      # the request waiting for a boundary
        self._tries = 0                        # boundaries the pending request failed at
        family = socket.AF_INET6 if ":" in settings.address else socket.AF_INET
        server_class = type("FallbackServer", (http.server.HTTPServer,), {"address_family": family})
        try:
            self._server = server_class((settings.address, settings.port), _handler_class(self))
        except (OSError, OverflowError) as exc:
            raise ConfigError(f"fallback endpoint {settings.address}:{settings.port}: cannot listen "
                              f"({getattr(exc, 'strerror', None) or exc}); choose another port or address") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="gradtap-fallback", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The URL the appliance POSTs to: the job's ``appliance.control_endpoint``."""
        host, port = self._server.server_address[:2]
        if host in ("0.0.0.0", "::"):         # every interface: the name other hosts reach this one by
            host = socket.getfqdn()
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{self.settings.path}"

    @property
    def pending(self) -> dict | None:
        """The fallback event waiting for the next step boundary, if any."""
        with self._lock:
            return None if self._pending is None else dict(self._pending)

    def step_boundary(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int) -> Path | None:
        """After ``optimizer.step()``: when a fallback is pending, save the state of
        ``iteration`` (the one whose forward pass comes next) and hand it to the appliance.
        The checkpoint handed back, or ``None`` (nothing pending, or the hand-back failed:
        logged, counted, tried again at the next boundary). ``model`` may be the DDP wrapper."""
        with self._lock:
            request = self._pending      # a request that comes while this one is handled stays pending
        if request is None:
            return None
        time_ns = time.time_ns()         # the state is the trainer's from here until the next step
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        path = Path(self.settings.checkpoint_dir).resolve() / f"{PREFIX}{iteration:08d}.pt"
        try:
            _save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "iteration": int(iteration),
                   "time_ns": time_ns}, path)
            answer = self._resync(path)
        except (OSError, RuntimeError) as exc:
            return self._failed(request, iteration, exc)
        finally:
            self._prune()
        log.info("fallback of iteration %s (%s): checkpoint of iteration %d handed back, %s", request["iteration"],
                 request.get("reason"), iteration, answer.get("note", "accepted"))
        with self._lock:
            if self._pending is request:
                self._pending, self._tries = None, 0
            self.counts.handed_back += 1
            self.counts.checkpoints.append(path)
        return path

    def close(self) -> None:
        """Stop listening and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> "FallbackHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the listener's thread ----------------------------------------------------------------

    def take(self, event: dict) -> bool:
        """Record a fallback event; whether it coalesced into one already pending."""
        with self._lock:
            coalesced = self._pending is not None
            self._pending, self._tries = event, 0
            self.counts.requests += 1
            self.counts.coalesced += coalesced
        log.warning("the appliance asks for a checkpoint (fallback of iteration %s: %s); saved at the next step "
                    "boundary", event["iteration"], event.get("reason"))
        return coalesced

    def refused(self) -> None:
        with self._lock:
            self.counts.refused += 1

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)

    # -- the training loop's thread -----------------------------------------------------------

    def _resync(self, path: Path) -> dict:
        """``POST /resync`` of ``path``; the appliance's answer (``Refused``, a ``RuntimeError``,
        when it refuses)."""
        s = self.settings
        return post_json(f"{s.appliance.rstrip('/')}/resync", {"checkpoint": str(path)}, self._token.decode(),
                         s.resync_timeout_s)

    def _failed(self, request: dict, iteration: int, exc: Exception) -> None:
        with self._lock:
            self.counts.failed += 1
            self._tries += 1
            give_up = self._tries >= self.settings.attempts and self._pending is request
            if give_up:
                self._pending, self._tries = None, 0
                self.counts.abandoned += 1
        if give_up:
            log.error("fallback of iteration %s: no checkpoint handed back after %d attempts (last, at iteration "
                      "%d: %s); the replica stays stale until a checkpoint is offered (gradtap resync)",
                      request["iteration"], self.settings.attempts, iteration, exc)
        else:
            log.warning("fallback of iteration %s: the checkpoint of iteration %d was not handed back (%s); trying "
                        "again at the next step boundary", request["iteration"], iteration, exc)
        return None

    def _prune(self) -> None:
        """Keep the newest ``keep`` fallback checkpoints in the directory (handed back or not)."""
        mine = sorted(p for p in Path(self.settings.checkpoint_dir).glob(f"{PREFIX}*.pt"))
        for old in mine[:-self.settings.keep]:
            old.unlink(missing_ok=True)


def read_token(path: Path) -> bytes:
    """The control token in ``path`` (surrounding whitespace removed), as the appliance reads it."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"control token file {path}: {exc.strerror}; give the appliance's (gradtap run "
                          "--control-token-file, default OUT/control.token)") from None
    if len(token) < 16 or not all(0x21 <= b <= 0x7E for b in token):
        raise ConfigError(f"control token file {path}: not a token (one word of at least 16 printable ASCII "
                          "characters); give the appliance's control token file")
    return token


def _save(checkpoint: dict, path: Path) -> None:
    """``torch.save`` to ``path`` atomically: a temporary file, fsynced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _handler_class(handler: FallbackHandler) -> type[http.server.BaseHTTPRequestHandler]:
    settings = handler.settings

    class Request(http.server.BaseHTTPRequestHandler):
        timeout = settings.request_timeout_s        # per socket operation: a silent client is dropped
        protocol_version = "HTTP/1.0"

        def do_POST(self) -> None:
            if self.path != settings.path:
                return self._answer(404, {"error": f"no POST {self.path}; the appliance posts to {settings.path}"})
            if not handler.authorized(self.headers.get("Authorization")):
                return self._answer(401, {"error": "missing or wrong token: the appliance sends its control token "
                                                   "(appliance.control_token_file) as 'Authorization: Bearer'"})
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._answer(411, {"error": "a Content-Length is required"})
            if not 0 <= length <= settings.max_body_bytes:
                return self._answer(413, {"error": f"the body is larger than {settings.max_body_bytes} bytes"})
            try:
                event = json.loads(self.rfile.read(length))
            except (ValueError, RecursionError):
                event = None
            iteration = event.get("iteration") if isinstance(event, dict) else None
            if not isinstance(event, dict) or event.get("event") != "fallback" \
                    or event.get("request") != "regular_checkpoint" \
                    or isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
                return self._answer(400, {"error": 'expected the appliance\'s fallback event {"event": "fallback", '
                                                   '"request": "regular_checkpoint", "iteration": k, ...}'})
            coalesced = handler.take(event)
            self._answer(202, {"accepted": True, "iteration": iteration, "coalesced": coalesced})

        def _answer(self, status: int, body: dict) -> None:
            if status >= 400:
                handler.refused()
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:
            log.debug("fallback endpoint: " + format, *args)

    return Request
