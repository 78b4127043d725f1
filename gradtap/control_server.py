"""The appliance's control endpoint: ``GET /status`` and ``POST /resync``, served by aiohttp.

``POST /resync`` with ``{"checkpoint": "/path/to/trainer-checkpoint.pt"}`` hands a trainer
checkpoint (``{"model", "optimizer", "iteration"}`` as ``torch.save``d by the trainer, or a
gradtap snapshot directory) to ``offer``: a stale replica resynchronises from it when the
streams reach its iteration. The answer is 202 ``{"accepted": true, "iteration": k,
"replaced": [...]}`` (the one pending offer replaces any earlier one), or 400 ``{"error":
reason}``. ``GET /status`` answers ``status()`` as JSON. ``gradtap.control.request_resync``
(``gradtap resync``) is the client. ``POST /attest`` takes the trainer's fingerprint of its
state (``gradtap.trainer.attest``; ``gradtap/attestation.py`` checks it): 202, or 400 with
the reason it cannot be checked.

What keeps the endpoint from being abused:

- every request carries ``Authorization: Bearer <token>`` from the token file
  (``gradtap/control_token.py``); without it the answer is 401, before anything else;
- it listens on 127.0.0.1 unless told otherwise;
- a checkpoint is read only from the directories allowed, only if it is a regular file
  (or a snapshot directory), never more than ``max_checkpoint_bytes``, within
  ``checkpoint_timeout_s``, and checked completely before it is offered
  (``gradtap/checkpoints.py`` for the file, ``Replica.check_offer`` for the job);
- aiohttp bounds the body (``client_max_size``: 413), header lines and count, and closes a
  connection that sends no complete request within ``request_timeout_s``;
- at most ``max_requests`` requests are handled at once and one checkpoint is read at a
  time (503 with ``Retry-After`` otherwise), in one worker thread, so memory stays bounded.

The server runs in its own thread with its own event loop; :meth:`ControlServer.close`
stops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading
from dataclasses import asdict, dataclass, field
from ipaddress import ip_address
from pathlib import Path
from typing import Any, Callable, Sequence

from aiohttp import web

from gradtap.checkpoints import offered_checkpoint
from gradtap.control_token import bearer_matches, ensure_token
from gradtap.core.errors import ConfigError, GradtapError

log = logging.getLogger(__name__)

AUTH_HINT = ("send the token of the appliance's control token file as 'Authorization: Bearer <token>' "
             "(gradtap resync --token-file FILE; gradtap run --control-token-file names the file)")


@dataclass(frozen=True)
class ControlSettings:
    """How the control endpoint listens and what it accepts.

    ``token_file``: the shared secret (created, mode 0600, when missing). ``resync_dirs``:
    the directories offered checkpoints must lie in (none: every offer is refused).
    ``max_checkpoint_bytes``: the largest checkpoint read (``checkpoints.offer_size_limit(job)``).
    """

    token_file: Path
    max_checkpoint_bytes: int
    resync_dirs: tuple[Path, ...] = ()
    address: str = "127.0.0.1"
    port: int = 9465                      # 0: any free port (``ControlServer.port`` says which)
    max_body_bytes: int = 1 << 20       # a fingerprint (POST /attest) of a model of thousands of parameters
    request_timeout_s: float = 10.0       # headers and body of one request
    checkpoint_timeout_s: float = 300.0   # reading and parsing one offered checkpoint
    max_requests: int = 8                 # handled at once
    resolved_dirs: tuple[Path, ...] = field(init=False)

    def __post_init__(self):
        for name in ("max_checkpoint_bytes", "max_body_bytes", "max_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"control {name}: {getattr(self, name)}; must be at least 1")
        for name in ("request_timeout_s", "checkpoint_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"control {name}: {getattr(self, name)}; must be more than 0 seconds")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"control port: {self.port} is not a TCP port (0-65535)")
        resolved = []
        for d in self.resync_dirs:
            path = Path(d).resolve()
            if not path.is_dir():
                raise ConfigError(f"resync directory {d} (--resync-dir, appliance.resync_dirs): not a directory")
            resolved.append(path)
        object.__setattr__(self, "resolved_dirs", tuple(resolved))


class ControlServer:
    """The control endpoint of one appliance, serving in a thread from construction to :meth:`close`.

    ``offer(checkpoint, source)`` takes a checked checkpoint dict (and where it came from,
    for messages) and returns the iterations of the pending offers it replaced
    (``Appliance.offer``: ``Replica.offer(checkpoint, only=True)``; ``ConfigError``
    when the job refuses it); ``status()`` returns a dataclass (``ApplianceStatus``). Both
    are called from worker threads, never from the event loop.
    """

    def __init__(self, offer: Callable[[dict, str], Sequence[int]], status: Callable[[], Any],
                 settings: ControlSettings, attest: Callable[[object], dict] | None = None):
        self.settings = settings
        self._token = ensure_token(settings.token_file)
        self._offer, self._status, self._attest = offer, status, attest
        self._checkpoints = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradtap-control-offer")
        self._statuses = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradtap-control-status")
        self._reading: asyncio.Future | None = None     # the last checkpoint read (still running after a timeout)
        self._offering = False                          # a POST /resync is reading or offering
        self._status_call: asyncio.Future | None = None
        self._inflight = 0
        family = socket.AF_INET6 if ":" in settings.address else socket.AF_INET
        try:
            sock = socket.create_server((settings.address, settings.port), family=family)
        except (OSError, OverflowError) as exc:
            raise ConfigError(f"control endpoint {settings.address}:{settings.port}: cannot listen "
                              f"({getattr(exc, 'strerror', None) or exc}); choose another --control-port or "
                              "--control-address") from None
        self.port = sock.getsockname()[1]
        if not _loopback(settings.address):
            log.warning("control endpoint on %s:%d: anyone who reaches it and holds the token can hand the "
                        "appliance checkpoints (and the token travels in clear HTTP)", settings.address, self.port)
        self._loop = asyncio.new_event_loop()
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(sock, started), name="gradtap-control",
                                        daemon=True)
        self._thread.start()
        started.result()

    def close(self) -> None:
        """Stop serving (requests in progress get a few seconds) and free the port."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        # A read stuck in the kernel (a hung network filesystem) cannot be interrupted: do not wait for it.
        self._checkpoints.shutdown(wait=False, cancel_futures=True)
        self._statuses.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the event loop's thread ------------------------------------------------------------------

    def _serve(self, sock: socket.socket, started: concurrent.futures.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        s = self.settings
        app = web.Application(client_max_size=s.max_body_bytes, middlewares=[self._guard])
        app.router.add_get("/status", self._get_status)
        app.router.add_post("/resync", self._post_resync)
        if self._attest is not None:
            app.router.add_post("/attest", self._post_attest)
        # keepalive_timeout also closes a connection that has not sent a whole request in time
        # (aiohttp arms it when the connection opens); lingering_time drains a refused body so
        # that the client reads the answer.
        runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                               keepalive_timeout=s.request_timeout_s, lingering_time=s.request_timeout_s,
                               max_line_size=8190, max_field_size=8190, max_headers=64, shutdown_timeout=2.0)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
        except BaseException as exc:
            sock.close()
            started.set_exception(exc)
            loop.close()
            return
        started.set_result(None)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Authentication first, then the bound on requests in progress; every error as JSON."""
        if not bearer_matches(request.headers.get("Authorization"), self._token):
            return web.json_response({"error": f"missing or wrong token: {AUTH_HINT}"}, status=401,
                                     headers={"WWW-Authenticate": 'Bearer realm="gradtap"'})
        if self._inflight >= self.settings.max_requests:
            return _busy(f"{self._inflight} requests are in progress")
        self._inflight += 1
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 413:
                message = f"the body is larger than {self.settings.max_body_bytes} bytes"
            elif exc.status in (404, 405):
                message = f"no {request.method} {request.path}; try GET /status or POST /resync"
            else:
                message = exc.text or exc.reason
            return web.json_response({"error": message}, status=exc.status)
        except Exception:
            log.exception("control endpoint: %s %s failed", request.method, request.path)
            return web.json_response({"error": "internal error; the appliance's log says more"}, status=500)
        finally:
            self._inflight -= 1

    async def _get_status(self, request: web.Request) -> web.Response:
        del request
        if self._status_call is None or self._status_call.done():     # one call at a time, shared
            self._status_call = self._loop.run_in_executor(self._statuses, self._status)
        try:
            status = await asyncio.wait_for(asyncio.shield(self._status_call), self.settings.request_timeout_s)
        except TimeoutError:
            return _busy("the appliance did not report its status in time")
        return web.json_response(asdict(status), dumps=lambda x: json.dumps(x, default=str))

    async def _json_body(self, request: web.Request) -> object:
        """The request's body as JSON (None when it is not JSON, or nested too deeply to parse);
        408 when it does not arrive in time."""
        try:
            return json.loads(await asyncio.wait_for(request.read(), self.settings.request_timeout_s))
        except TimeoutError:
            raise web.HTTPRequestTimeout(text="the body did not arrive in time") from None
        except (ValueError, RecursionError):
            return None

    async def _post_attest(self, request: web.Request) -> web.Response:
        """The trainer's fingerprint (``trainer/attest.py``): 202 when held or checked."""
        body = await self._json_body(request)
        if body is None:
            return _refused("expected a JSON fingerprint (gradtap.trainer.attest.fingerprint)")
        call = self._loop.run_in_executor(self._statuses, self._attest, body)
        try:
            answer = await asyncio.wait_for(asyncio.shield(call), self.settings.request_timeout_s)
        except TimeoutError:
            return _busy("the appliance did not take the fingerprint in time")
        except GradtapError as exc:
            return _refused(str(exc))
        return web.json_response(answer, status=202)

    async def _post_resync(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict) or set(body) != {"checkpoint"} or not isinstance(body["checkpoint"], str):
            return _refused('expected the JSON object {"checkpoint": "/absolute/path"}')
        if self._offering or (self._reading is not None and not self._reading.done()):
            return _busy("another checkpoint is being read")
        self._offering = True
        try:
            return await self._take(body["checkpoint"])
        finally:
            self._offering = False

    async def _take(self, path: str) -> web.Response:
        """Read ``path`` in the worker thread (abandoned, never offered, after the timeout), then offer it."""
        s = self.settings
        self._reading = self._loop.run_in_executor(self._checkpoints, offered_checkpoint, path, s.resolved_dirs,
                                                   s.max_checkpoint_bytes)
        try:
            checkpoint = await asyncio.wait_for(asyncio.shield(self._reading), s.checkpoint_timeout_s)
            # Checked against the job and held; the work is bounded by the size read, so no timeout.
            replaced = list(await self._loop.run_in_executor(self._checkpoints, self._offer, checkpoint,
                                                             f"POST /resync {path}"))
        except TimeoutError:
            return _busy(f"the checkpoint was not read within {s.checkpoint_timeout_s:g} s; nothing was offered")
        except GradtapError as exc:
            return _refused(f"cannot use that checkpoint: {exc}")
        note = "held as the one pending offer"
        if replaced:
            note += f"; it replaces the offer of iteration {', '.join(map(str, replaced))}"
        return web.json_response({"accepted": True, "iteration": int(checkpoint["iteration"]),
                                  "replaced": replaced, "note": note}, status=202)


def _refused(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def _busy(why: str) -> web.Response:
    return web.json_response({"error": f"busy: {why}; try again shortly"}, status=503,
                             headers={"Retry-After": "1"})


def _loopback(address: str) -> bool:
    try:
        return ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"
