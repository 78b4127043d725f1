"""The durable store tier: uploads that become READY only whole, sha256-checked loads that restore
bit for bit, retention, a slow store that skips (counted) instead of blocking the update path, a
store that dies mid-upload and comes back, and writers killed with SIGKILL at random moments that
never leave a READY snapshot failing its checksums. S3 is moto's server on 127.0.0.1
(``tests/store/s3_server.py``); ``file://`` is a local directory."""

from __future__ import annotations

import json
import os
import random
import signal
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.simulator.training import make_optimizer
from gradtap.trainer import restore
from gradtap.store import snapshot
from gradtap.store.snapshot import Snapshots
from gradtap.store.object_store import SnapshotStore, manifest_key, object_key
from gradtap.store.uploader import Uploader
from gradtap.workload.models import build
from gradtap.workload.spec import StoreSpec
from tests.forked import Child
from tests.store.s3_server import CREDENTIALS, MotoServer, moto_bucket
from tests.store.test_snapshot import stepped
from tests.updater.test_replica import job


@pytest.fixture
def s3():
    with moto_bucket("ckpt") as server:
        yield server


def file_store(tmp_path, job_name, **kw) -> SnapshotStore:
    return SnapshotStore(f"file://{tmp_path / 'store'}", job_name, **kw)


def s3_store(server: MotoServer, job_name, **kw) -> SnapshotStore:
    return SnapshotStore("s3://ckpt/jobs/a", job_name, storage_options=server.options(), **kw)


def bits(state: dict) -> dict:
    """Every tensor of a (nested) state dict as bytes, keyed by its path."""
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = (obj.dtype, tuple(obj.shape), obj.contiguous().view(torch.uint8).numpy().tobytes()
                           if obj.dim() else obj.reshape(1).view(torch.uint8).numpy().tobytes())
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        else:
            out[prefix] = obj
    walk("", state)
    return out


def write_and_upload(tmp_path, store, iterations, *, keep=3, every=1):
    """A stepped replica snapshotted at 1..iterations into a local directory with ``store`` as
    its tier; returns the local Snapshots (still open) and the uploader, idle."""
    j = job()
    uploader = Uploader(store, retry_min_s=0.05, retry_max_s=0.2)
    snaps = Snapshots(tmp_path / "local", j.name, every=every, keep=keep, uploader=uploader)
    replica, _ = stepped(j, 0)
    import numpy as np
    from tests.updater.naive_adam import random_reduced
    rng = np.random.default_rng(0)
    for it in range(iterations):
        replica.apply(it, np.concatenate(random_reduced(j, rng)))
        snaps.write_replica(replica)
        assert uploader.wait_idle(30)
    return j, snaps, uploader


def restored(j, source, **kw):
    model = build(j.model.factory, j.model.kwargs, seed=7)
    optimizer = make_optimizer(list(model.parameters()), j.optimizer)
    iteration = restore(model, optimizer, source, **kw)
    return iteration, bits({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_upload_ready_verified_and_restored_bit_for_bit(tmp_path, kind, request):
    if kind == "s3":
        server = request.getfixturevalue("s3")
        store, url, opts = s3_store(server, "replica-test"), "s3://ckpt/jobs/a", server.options()
    else:
        store, url, opts = file_store(tmp_path, "replica-test"), f"file://{tmp_path / 'store'}", None
    j, snaps, uploader = write_and_upload(tmp_path, store, 3)
    assert store.ready() == [1, 2, 3]
    assert uploader.counts()["uploaded"] == 3 and uploader.counts()["failed"] == 0
    manifest = store.manifest(3)
    local = json.loads((snapshot.latest(snaps.directory) / "manifest.json").read_text())
    assert {n: o["sha256"] for n, o in manifest["objects"].items()} == local["sha256"]
    loaded = store.load_newest()
    assert loaded["iteration"] == 3
    assert bits(loaded) == bits(snapshot.load(snapshot.latest(snaps.directory)))
    assert restored(j, url, storage_options=opts) == restored(j, snaps.directory)
    snaps.close()
    assert not list(snaps.directory.glob(".tmp-*"))          # staging removed once uploaded


def test_a_corrupted_object_is_refused_and_the_one_before_loads(tmp_path):
    store = file_store(tmp_path, "replica-test")
    j, snaps, _ = write_and_upload(tmp_path, store, 2)
    snaps.close()
    sha = store.manifest(2)["objects"]["optimizer.pt"]["sha256"]
    path = Path(store._path(object_key(sha)))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(GradtapError, match="optimizer.pt has sha256"):
        store.load(2)
    assert store.load_newest()["iteration"] == 1
    (Path(store._path(manifest_key(1)))).unlink()
    with pytest.raises(GradtapError, match="no READY snapshot of job 'replica-test' that verifies"):
        store.load_newest()


class _Counting:
    """A file that counts the bytes read from it."""

    def __init__(self, f):
        self.f, self.bytes = f, 0

    def seek(self, *args):
        return self.f.seek(*args)

    def read(self, n=-1):
        data = self.f.read(n)
        self.bytes += len(data)
        return data

    def readinto(self, buffer):
        n = self.f.readinto(buffer)
        self.bytes += n
        return n


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_an_object_is_hashed_as_it_loads_and_read_about_once(tmp_path, kind, request):
    """``torch.load`` reads a store object through its hash: the sha256 and size are
    hashlib's of its bytes, the tensors those ``torch.load`` makes of them, and the object is
    read once and a little (the zip directory at its end, which the reader reads first)."""
    import hashlib

    from gradtap.store.object_store import _HashedRead

    store = s3_store(request.getfixturevalue("s3"), "replica-test") if kind == "s3" else file_store(tmp_path, "x")
    model = build("gradtap.workload.models:gpt2", {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512,
                                                    "block_size": 32}, seed=1)
    optimizer = make_optimizer(list(model.parameters()), job().optimizer)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    store.fs.makedirs(store._path("objects"), exist_ok=True)
    store.fs.pipe(store._path("objects/ckpt"), data)
    with store.fs.open(store._path("objects/ckpt"), "rb") as f:
        counted = _Counting(f)
        reader = _HashedRead(counted)
        loaded = torch.load(reader, weights_only=True)
        assert reader.digest() == (hashlib.sha256(data).hexdigest(), len(data))
    assert bits(loaded) == bits(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert len(data) <= counted.bytes < 1.05 * len(data), (counted.bytes, len(data))


def test_a_load_tells_the_bytes_read_of_the_snapshots_objects(tmp_path):
    store = file_store(tmp_path, "replica-test")
    _, snaps, _ = write_and_upload(tmp_path, store, 1)
    snaps.close()
    heard = []
    loaded = store.load(1, lambda done, total: heard.append((done, total)))
    objects = store.manifest(1)["objects"]
    total = sum(o["size"] for o in objects.values())
    assert loaded["iteration"] == 1 and {t for _, t in heard} == {total}
    done = [d for d, _ in heard]
    first = objects[snapshot.FILES[0]]["size"]
    assert done == sorted(done) and first in done and done[-1] == total        # the first object, then all


def test_a_truncated_object_is_refused_by_its_size(tmp_path):
    store = file_store(tmp_path, "replica-test")
    _, snaps, _ = write_and_upload(tmp_path, store, 1)
    snaps.close()
    path = Path(store._path(object_key(store.manifest(1)["objects"]["model.pt"]["sha256"])))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])       # torch.load fails on it: the check says why
    with pytest.raises(GradtapError, match=rf"model.pt has sha256 \S+ and {len(data) // 2} B, the manifest says "
                                           rf"\S+ and {len(data)} B"):
        store.load(1)


def test_a_snapshot_without_its_manifest_is_not_ready(tmp_path):
    store = file_store(tmp_path, "replica-test")
    _, snaps, _ = write_and_upload(tmp_path, store, 2)
    snaps.close()
    Path(store._path(manifest_key(2))).unlink()             # as a writer killed before the manifest
    assert store.ready() == [1]
    assert store.load_newest()["iteration"] == 1


def test_retention_keeps_the_last_k_and_every_nth(tmp_path):
    store = file_store(tmp_path, "replica-test", keep_last=2, keep_every=3)
    _, snaps, _ = write_and_upload(tmp_path, store, 8, keep=1)
    snaps.close()
    assert store.ready() == [3, 6, 7, 8]
    named = {o["sha256"] for i in store.ready() for o in store.manifest(i)["objects"].values()}
    held = {Path(p).name for p in store.fs.find(store._path("objects"))}
    assert held == named                                     # unreferenced objects are gone
    for i in store.ready():
        assert store.load(i)["iteration"] == i


class BlockedStore(SnapshotStore):
    """A store whose uploads wait until released: slower than any snapshot rate."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = threading.Event()
        self.entered = threading.Event()

    def put_snapshot(self, directory):
        self.entered.set()
        assert self.release.wait(30)
        return super().put_snapshot(directory)


def test_a_slow_store_skips_snapshots_and_never_blocks_the_update_path(tmp_path):
    import numpy as np
    from tests.updater.naive_adam import random_reduced
    j = job()
    store = BlockedStore(f"file://{tmp_path / 'store'}", j.name)
    uploader = Uploader(store)
    snaps = Snapshots(tmp_path / "local", j.name, every=1, keep=2, uploader=uploader)
    replica, _ = stepped(j, 0)
    rng = np.random.default_rng(1)
    replica.apply(0, np.concatenate(random_reduced(j, rng)))
    snaps.write_replica(replica)
    assert store.entered.wait(10)                            # the first upload is stuck in the store
    for it in range(1, 12):                                  # the update path goes on regardless
        replica.apply(it, np.concatenate(random_reduced(j, rng)))
        snaps.write_replica(replica)
    assert replica.iteration == 12
    counts = uploader.counts()
    assert counts["submitted"] == 12 and counts["uploaded"] == 0
    assert counts["skipped"] == 10                           # 1 in flight, 1 waiting (the newest), 10 replaced
    assert len(list(snaps.directory.glob(".tmp-upload-*"))) == 2     # staged: bounded, not queued
    store.release.set()
    assert uploader.wait_idle(30)
    assert store.ready() == [1, 12]
    assert bits(store.load(12)) == bits(snapshot.load(snapshot.latest(snaps.directory)))
    snaps.close()


def test_the_store_dies_mid_upload_and_comes_back(tmp_path, s3):
    import numpy as np
    from tests.updater.naive_adam import random_reduced
    j = job(factory=("gradtap.workload.models:mlp", {"sizes": [512, 1024, 1024, 16]}))   # ~6 MiB per snapshot
    events = []
    store = s3_store(s3, j.name)
    uploader = Uploader(store, retry_min_s=0.1, retry_max_s=0.4, on_event=lambda k, **f: events.append(k))
    snaps = Snapshots(tmp_path / "local", j.name, every=1, keep=2, uploader=uploader)
    replica, _ = stepped(j, 0)
    rng = np.random.default_rng(2)

    def step():
        replica.apply(replica.iteration, np.concatenate(random_reduced(j, rng)))
        snaps.write_replica(replica)

    step()
    assert uploader.wait_idle(30) and store.ready() == [1]
    step()                                                   # iteration 2 uploads...
    deadline = time.monotonic() + 10
    while uploader._idle and time.monotonic() < deadline:
        time.sleep(0.001)
    s3.kill()                                                # ...and the server dies under it
    for _ in range(3):                                       # the replica keeps updating
        step()
    assert replica.iteration == 5
    deadline = time.monotonic() + 20
    while uploader.counts()["failed"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uploader.counts()["failed"] >= 2 and "store.failed" in events
    assert uploader.counts()["uploaded"] in (1, 2)           # 2 only if it finished before the kill
    s3.start()                                               # back, empty (moto keeps buckets in memory)
    s3.make_bucket("ckpt")
    assert uploader.wait_idle(30)
    # The newest went, READY and whole. The one being retried when the server came back may
    # have gone before it: which one that is (2, 3 or 4) depends on the machine's timing.
    ready = store.ready()
    assert ready[-1] == 5 and set(ready) <= {2, 3, 4, 5} and len(ready) <= 2, ready
    assert store.load(5)["iteration"] == 5
    assert "store.resumed" in events
    snaps.close()


# A writer without the replica's kernels (no Numba start-up): a torch model stepped by Adam,
# each state snapshotted locally and handed to the uploader, as fast as it goes.
WRITER = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from gradtap.store.snapshot import Snapshots
    from gradtap.store.object_store import SnapshotStore
    from gradtap.store.uploader import Uploader
    url, local, seed, options = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters())
    store = SnapshotStore(url, "kill-test", keep_last=2, storage_options=options or None)
    uploader = Uploader(store, retry_min_s=0.05, retry_max_s=0.1)
    snaps = Snapshots(local, "kill-test", every=1, keep=2, uploader=uploader)
    print("ready", flush=True)
    for iteration in range(1, 10**6):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        snaps.write({"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": iteration},
                    step=iteration)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_sigkill_while_uploading_never_leaves_a_ready_snapshot_that_fails(tmp_path, kind, request):
    if kind == "s3":
        server = request.getfixturevalue("s3")
        url, options = "s3://ckpt/kill", server.options()
        opts_arg = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    else:
        url, options, opts_arg = f"file://{tmp_path / 'store'}", None, {}
    rng = random.Random(13)
    ready_seen = set()
    for trial in range(3):
        log = tmp_path / f"writer{trial}.log"
        with Child(WRITER, url, str(tmp_path / f"local{trial}"), str(trial), json.dumps(opts_arg), env=CREDENTIALS,
                   stderr=log) as proc:
            assert proc.stdout.readline().strip() == "ready", log.read_text()[-2000:]
            time.sleep(rng.uniform(0.3, 2.0))
            store = SnapshotStore(url, "kill-test", storage_options=options)
            deadline = time.monotonic() + 20
            while trial == 2 and not ready_seen and not store.ready() and time.monotonic() < deadline:
                time.sleep(0.05)                             # a loaded machine: let one upload complete
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(60)
        for iteration in store.ready():                      # every READY one verifies whole
            assert store.load(iteration)["iteration"] == iteration
            ready_seen.add((trial, iteration))
    assert ready_seen                                        # some uploads did complete


def test_store_spec_and_errors(tmp_path):
    spec = StoreSpec(url="s3://bucket/prefix/", endpoint_url="http://127.0.0.1:9000", keep_last=2, keep_every=10)
    assert spec.url == "s3://bucket/prefix"
    for bad in ({"url": "/not/a/url"}, {"url": "s3://b", "endpoint_url": "ftp://x"},
                {"url": "s3://b", "keep_last": 0}, {"url": "s3://b", "retry_min_s": 5, "retry_max_s": 1}):
        with pytest.raises(ValueError):
            StoreSpec(**bad)
    with pytest.raises(ConfigError, match="keep_last"):
        SnapshotStore(f"file://{tmp_path}", "j", keep_last=0)
    with pytest.raises(GradtapError, match="no READY snapshot"):
        SnapshotStore(f"file://{tmp_path / 'empty'}", "j").load_newest()


def test_multipart_uploads_a_killed_writer_left_are_aborted(tmp_path, s3):
    """Parts of an upload whose writer died are billed until aborted: the uploader aborts the
    ones under its prefix that began over a minute before it opened the store, and nothing
    else. (moto reports one fixed ``Initiated`` time; the store's opening time is set around it.)"""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url, region_name="us-east-1")
    dead = client.create_multipart_upload(Bucket="ckpt", Key="jobs/a/objects/ab/dead")
    client.upload_part(Bucket="ckpt", Key="jobs/a/objects/ab/dead", UploadId=dead["UploadId"], PartNumber=1,
                       Body=b"x" * 1024)
    other = client.create_multipart_upload(Bucket="ckpt", Key="jobs/b/objects/cd/other")
    began = {u["Key"]: u["Initiated"] for u in client.list_multipart_uploads(Bucket="ckpt")["Uploads"]}

    def uploads_after(opened):
        store = s3_store(s3, "j")
        store.opened = opened
        events = []
        uploader = Uploader(store, on_event=lambda kind, **f: events.append((kind, f)))
        try:
            assert uploader.wait_idle(30)
        finally:
            uploader.close(30)
        return {u["Key"] for u in client.list_multipart_uploads(Bucket="ckpt").get("Uploads", [])}, events

    died = began["jobs/a/objects/ab/dead"]
    left, events = uploads_after(died + timedelta(seconds=30))      # may be this process's own: kept
    assert left == {"jobs/a/objects/ab/dead", "jobs/b/objects/cd/other"} and events == []
    left, events = uploads_after(died + timedelta(minutes=2))
    assert left == {"jobs/b/objects/cd/other"}
    assert events == [("store.aborted", {"url": "s3://ckpt/jobs/a", "uploads": 1,
                                         "keys": ["jobs/a/objects/ab/dead"]})]
    client.abort_multipart_upload(Bucket="ckpt", Key="jobs/b/objects/cd/other", UploadId=other["UploadId"])
    assert file_store(tmp_path, "j").abort_dead_uploads() == []      # nothing to abort off S3
