"""A real S3-compatible HTTP server for the store tests: moto's ``moto_server`` as a child
process on 127.0.0.1 and a free port, which a test can kill (SIGKILL, mid-upload) and start
again on the same port. moto keeps its buckets in memory: a restarted server is empty, as a
store that lost its disk, and the test creates the bucket again."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_server() -> str:
    found = Path(sys.executable).with_name("moto_server")
    if found.exists():
        return str(found)
    which = shutil.which("moto_server")
    if which is None:
        pytest.skip("moto_server is not installed (moto[server], pinned in requirements.lock)")
    return which


class MotoServer:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> "MotoServer":
        self.proc = subprocess.Popen([_moto_server(), "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **CREDENTIALS})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited {self.proc.returncode}")
                time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"moto_server did not answer on {self.url} within {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def options(self) -> dict:
        """s3fs options for this server: its endpoint, the test credentials, and one attempt
        per request with short timeouts (a dead server fails fast; the uploader retries)."""
        return {"key": CREDENTIALS["AWS_ACCESS_KEY_ID"], "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"},
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5},
                "skip_instance_cache": True}

    def make_bucket(self, name: str) -> None:
        # A plain PUT: moto takes it unsigned, and s3fs's mkdir would send us-east-1 as a
        # LocationConstraint, which S3 refuses for that region.
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=5).close()


@contextmanager
def moto_bucket(name: str) -> Iterator[MotoServer]:
    """A started server holding the bucket ``name``, with the test credentials in the
    environment (restored after) and the server killed at the end."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = MotoServer().start()
    try:
        server.make_bucket(name)
        yield server
    finally:
        server.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
