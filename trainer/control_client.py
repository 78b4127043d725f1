"""The trainer's requests to an appliance's control endpoint (``gradtap/control_server.py``).

One JSON POST with the control token as ``Authorization: Bearer``, which ``Attestor``
(``POST /attest``), ``FallbackHandler`` and ``gradtap resync`` (``POST /resync``) all make.
The endpoint answers JSON, and a refusal carries ``{"error": reason}``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class Refused(RuntimeError):
    """The appliance answered and refused (``code``: its HTTP status, ``reason``: why), or
    answered something that is not JSON (``code`` 0)."""

    def __init__(self, url: str, code: int, reason: str):
        super().__init__(f"{url}: HTTP {code}: {reason}" if code else f"{url}: {reason}")
        self.url, self.code, self.reason = url, code, reason


def post_json(url: str, body: dict, token: str, timeout_s: float) -> dict:
    """POST ``body`` to ``url``; the appliance's JSON answer. :class:`Refused` when it refuses;
    ``OSError`` (``urllib.error.URLError``, a timeout) when nothing answers."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read())["error"]
        except (ValueError, KeyError, TypeError):
            reason = exc.reason
        raise Refused(url, exc.code, str(reason)) from None
    except ValueError as exc:        # an answer that is not JSON
        raise Refused(url, 0, f"the answer is not JSON ({exc})") from None
