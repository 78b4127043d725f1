"""The trainer's one POST to the control endpoint: answers, refusals and answers that are not JSON."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from gradtap.trainer.control_client import Refused, post_json


class _Appliance(http.server.BaseHTTPRequestHandler):
    """Answers by path: /ok echoes the token and body, /refuse is a 400 with a reason,
    /bare a 502 without a JSON body, /garbled a 200 that is not JSON."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        status, answer = {
            "/ok": (200, json.dumps({"token": self.headers["Authorization"], "got": json.loads(body)}).encode()),
            "/refuse": (400, b'{"error": "the replica is past that state"}'),
            "/bare": (502, b"<html>bad gateway</html>"),
            "/garbled": (200, b"not json"),
        }[self.path]
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def appliance():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Appliance)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_answer_and_each_kind_of_refusal(appliance):
    assert post_json(f"{appliance}/ok", {"a": 1}, "t0k", 5) == {"token": "Bearer t0k", "got": {"a": 1}}
    with pytest.raises(Refused, match=r"/refuse: HTTP 400: the replica is past that state") as refused:
        post_json(f"{appliance}/refuse", {}, "t", 5)
    assert (refused.value.code, refused.value.reason) == (400, "the replica is past that state")
    with pytest.raises(Refused, match=r"/bare: HTTP 502: Bad Gateway"):
        post_json(f"{appliance}/bare", {}, "t", 5)
    with pytest.raises(Refused, match=r"/garbled: the answer is not JSON") as garbled:
        post_json(f"{appliance}/garbled", {}, "t", 5)
    assert garbled.value.code == 0


def test_nothing_answering_is_an_os_error():
    import socket

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        post_json(f"http://127.0.0.1:{port}/attest", {}, "t", 5)
