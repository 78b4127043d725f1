"""The trainer's fallback handler against the appliance's real control plane: the fallback
event ``ControlPlane`` POSTs, and ``ControlServer``'s ``POST /resync`` that takes the
checkpoint back (token, resync directory and file checks included; the appliance behind it
is a recorder)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from gradtap.checkpoints import load_checkpoint
from gradtap.control import ControlPlane
from gradtap.control_server import ControlServer, ControlSettings
from gradtap.control_token import ensure_token
from gradtap.core.errors import ConfigError
from gradtap.status import ApplianceStatus
from gradtap.trainer import FallbackHandler, FallbackSettings


class Appliance:
    """What the control server hands offers to: it keeps them, or refuses with ``refuse``."""

    def __init__(self):
        self.offers: list[dict] = []
        self.refuse: str | None = None
        self.meanwhile = lambda: None        # what happens while an offer is read

    def offer(self, checkpoint: dict, source: str) -> list[int]:
        del source
        self.meanwhile()
        if self.refuse:
            raise ConfigError(self.refuse)
        self.offers.append(checkpoint)
        return []


@pytest.fixture
def plane(tmp_path):
    """(appliance, its control server, the trainer's handler, the appliance's control plane)."""
    (tmp_path / "resync").mkdir()
    token = tmp_path / "control.token"
    ensure_token(token)
    appliance = Appliance()
    server = ControlServer(appliance.offer, ApplianceStatus, ControlSettings(token, 1 << 24, port=0,
                                                                             resync_dirs=(tmp_path / "resync",)))
    handler = FallbackHandler(FallbackSettings(f"http://127.0.0.1:{server.port}", token, tmp_path / "resync"))
    control = ControlPlane(tmp_path / "events.jsonl", handler.endpoint, token_file=token)
    yield appliance, server, handler, control
    handler.close()
    server.close()


def trained():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def events(control: ControlPlane) -> list[str]:
    return [json.loads(line)["event"] for line in control.event_log.read_text().splitlines()]


def test_a_fallback_is_answered_with_a_checkpoint_at_the_next_step_boundary(plane, tmp_path):
    appliance, _, handler, control = plane
    model, optimizer = trained()
    assert handler.step_boundary(model, optimizer, 5) is None          # nothing asked: nothing saved
    assert not list((tmp_path / "resync").iterdir())
    control.fallback(5, "iteration 5 has a hole")
    assert handler.pending["iteration"] == 5 and handler.pending["request"] == "regular_checkpoint"
    path = handler.step_boundary(model, optimizer, 6)
    assert path == (tmp_path / "resync" / "fallback-00000006.pt").resolve() and handler.pending is None
    (offered,) = appliance.offers
    assert offered["iteration"] == 6 and isinstance(offered["time_ns"], int)
    assert all(torch.equal(offered["model"][k], v) for k, v in model.state_dict().items())
    assert load_checkpoint(path)["iteration"] == 6          # what `gradtap resync` would send
    assert (handler.counts.requests, handler.counts.handed_back, handler.counts.failed) == (1, 1, 0)
    assert events(control) == ["fallback"]                 # posted, with the token: no fallback_post_failed
    assert handler.step_boundary(model, optimizer, 7) is None


def test_repeated_requests_coalesce_into_one_checkpoint(plane):
    appliance, _, handler, control = plane
    model, optimizer = trained()
    control.fallback(5, "a hole")
    control.fallback(6, "another")
    assert handler.pending["iteration"] == 6
    assert (handler.counts.requests, handler.counts.coalesced) == (2, 1)
    handler.step_boundary(model, optimizer, 7)
    assert len(appliance.offers) == 1 and handler.step_boundary(model, optimizer, 8) is None


def test_a_request_that_comes_during_the_hand_back_stays_pending(plane):
    appliance, _, handler, control = plane
    model, optimizer = trained()
    control.fallback(5, "a hole")
    appliance.meanwhile = lambda: control.fallback(6, "another hole, found while the checkpoint was read")
    assert handler.step_boundary(model, optimizer, 6) is not None
    assert handler.pending["iteration"] == 6          # answered at the next boundary, not lost
    appliance.meanwhile = lambda: None
    assert handler.step_boundary(model, optimizer, 7) is not None and handler.pending is None
    assert handler.counts.handed_back == 2


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_requests_without_the_token_or_not_a_fallback_are_refused(plane, tmp_path):
    _, _, handler, _ = plane
    token = (tmp_path / "control.token").read_text().strip()
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    event = json.dumps({"event": "fallback", "request": "regular_checkpoint", "iteration": 3}).encode()
    cases = [(handler.endpoint, event, {}, 401, "missing or wrong token"),
             (handler.endpoint, event, {"Authorization": "Bearer " + "x" * 43}, 401, "missing or wrong token"),
             (handler.endpoint.replace("/fallback", "/other"), event, auth, 404, "the appliance posts to /fallback"),
             (handler.endpoint, b"{not json", auth, 400, "expected the appliance's fallback event"),
             (handler.endpoint, json.dumps({"event": "fallback", "iteration": -1}).encode(), auth, 400, "fallback"),
             (handler.endpoint, b"x" * (handler.settings.max_body_bytes + 1), auth, 413, "larger than")]
    for url, body, headers, status, said in cases:
        got, answer = _post(url, body, headers)
        assert got == status and said in answer["error"], (url, body[:20], answer)
    assert handler.pending is None and handler.counts.refused == len(cases)
    # An appliance without the token file: the event is logged and its POST refused, never raised.
    control = ControlPlane(tmp_path / "other.jsonl", handler.endpoint)
    control.fallback(4, "a hole")
    assert events(control) == ["fallback", "fallback_post_failed"] and handler.pending is None
    assert _post(handler.endpoint, event, auth)[0] == 202 and handler.pending["iteration"] == 3


def test_an_appliance_that_refuses_or_is_gone_does_not_stop_training(plane, caplog):
    appliance, server, handler, control = plane
    model, optimizer = trained()
    appliance.refuse = "checkpoint optimizer: lr is 0.001 but the job's schedule gives 0.01"
    control.fallback(5, "attestation mismatch")
    for it in range(6, 6 + handler.settings.attempts):
        assert handler.step_boundary(model, optimizer, it) is None
        assert (handler.pending is None) == (it == 5 + handler.settings.attempts)
    assert (handler.counts.failed, handler.counts.abandoned, handler.counts.handed_back) == (3, 1, 0)
    assert "HTTP 400: cannot use that checkpoint: checkpoint optimizer: lr is 0.001" in caplog.text
    assert "no checkpoint handed back after 3 attempts" in caplog.text
    # Kept: the newest `keep` of the checkpoints written.
    assert [p.name for p in sorted(handler.settings.checkpoint_dir.glob("fallback-*.pt"))] == \
        ["fallback-00000007.pt", "fallback-00000008.pt"]
    server.close()                                    # the appliance is gone
    control.fallback(9, "a hole")
    assert handler.step_boundary(model, optimizer, 10) is None
    assert handler.counts.failed == 4 and handler.pending["iteration"] == 9


@pytest.mark.parametrize("change, said", [
    ({"appliance": "mirror-node:9465"}, "fallback appliance: 'mirror-node:9465' is not an http"),
    ({"checkpoint_dir": "/nonexistent"}, "fallback checkpoint_dir: /nonexistent is not a directory"),
    ({"attempts": 0}, "fallback attempts: 0; must be at least 1"),
    ({"path": "fallback"}, "fallback path: 'fallback' must start with '/'"),
])
def test_settings_name_what_is_wrong(tmp_path, change, said):
    base = {"appliance": "http://mirror-node:9465", "token_file": tmp_path / "t", "checkpoint_dir": tmp_path}
    with pytest.raises(ConfigError, match=said):
        FallbackSettings(**{**base, **change})


def test_a_token_file_that_holds_no_token_is_refused(tmp_path):
    (tmp_path / "t").write_text("short\n")
    with pytest.raises(ConfigError, match="control token file .*: not a token"):
        FallbackHandler(FallbackSettings("http://127.0.0.1:9", tmp_path / "t", tmp_path))


def test_a_port_in_use_is_refused_by_name(plane, tmp_path):
    _, _, handler, _ = plane
    port = int(handler.endpoint.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(ConfigError, match=f"fallback endpoint 127.0.0.1:{port}: cannot listen"):
        FallbackHandler(FallbackSettings("http://127.0.0.1:9", tmp_path / "control.token", tmp_path, port=port))
