"""The gradient log against the simulator's ground truth: a replica fed the true reduced
gradients (``truth/iter_N/grad.npy``) logs them to the store; every iteration between two
snapshots is then rebuilt from the store alone (snapshot + Adam replay of the log) and must
equal the trainer's state (``truth/iter_N/state.npz``) bit for bit, on ``file://`` and on
moto's S3 server. A corrupted record is refused by name, a missing one is a gap, a record of
another timeline is never replayed, a store slower than the iterations makes counted gaps
without blocking the update path, and retention follows the oldest READY snapshot."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from gradtap.core.errors import ConfigError, GradtapError
from gradtap.simulator.truth import iteration_dir
from gradtap.store.gradient_log import (MAX_ENTRY_BYTES, GradientLog, LogEntry, LogStore, decode, encode,
                                        entry_key, objects_dir, rebuild)
from gradtap.store.object_store import SnapshotStore
from gradtap.store.snapshot import Snapshots
from gradtap.store.uploader import Uploader
from gradtap.updater.replica import Replica
from gradtap.updater.replica_origin import ReplicaOrigin
from gradtap.verify import compare_state
from gradtap.workload.layout import job_params
from gradtap.workload.spec import parse_job
from tests.simulator.test_simulate import make_job, simulate
from tests.store.s3_server import moto_bucket

ITERATIONS = 7            # captured iterations 1..7: states ready for 2..8
EVERY = 3                 # snapshots ready for 3 and 6


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    root = tmp_path_factory.mktemp("gradlog")
    job = make_job(3, "LL", 2, "fp32")
    simulate(root / "sim", job, iterations=ITERATIONS)
    return job, root / "sim" / "truth"


@pytest.fixture
def s3():
    with moto_bucket("ckpt") as server:
        yield server


def store_of(kind, tmp_path, request, job) -> SnapshotStore:
    if kind == "file":
        return SnapshotStore(f"file://{tmp_path / 'store'}", job.name, keep_last=10)
    server = request.getfixturevalue("s3")
    return SnapshotStore("s3://ckpt/jobs/a", job.name, keep_last=10, storage_options=server.options())


def start_of(truth) -> dict:
    return torch.load(truth / "start.pt", weights_only=True)


def truth_grad(truth, iteration) -> np.ndarray:
    return np.load(iteration_dir(truth, iteration) / "grad.npy").view(np.uint8).reshape(-1)


def feed(job, truth, store, local, *, queue=ITERATIONS + 1, until=ITERATIONS) -> tuple[Replica, GradientLog]:
    """A replica started from the truth's start state steps through the true gradients of
    iterations 1..``until``, logging each and snapshotting every ``EVERY`` (uploaded). The log
    holds every gradient (``queue``) so that a loaded machine makes no gap here."""
    replica = Replica(job, start_of(truth))
    origin = ReplicaOrigin.of(replica)
    uploader = Uploader(store)
    snapshots = Snapshots(local, job.name, every=EVERY, keep=10, uploader=uploader)
    gradlog = GradientLog.for_replica(store, replica, origin, queue=queue, retry_min_s=0.05, retry_max_s=0.2)
    for i in range(replica.iteration, until + 1):
        apply(replica, gradlog, i, truth_grad(truth, i))
        if snapshots.due(replica.iteration):
            snapshots.write_replica(replica)
            assert uploader.wait_idle(30)
    assert gradlog.wait_idle(30)
    gradlog.close(10)
    snapshots.close()
    return replica, gradlog


def apply(replica, gradlog, i, grad) -> None:
    """What ``ReplicaSink`` does for one recovered iteration."""
    replica.begin(i)
    for b in range(len(replica.layout.buckets)):
        lo, hi = gradlog.offsets[b], gradlog.offsets[b + 1]
        replica.apply_bucket(b, grad[lo:hi])
        gradlog.bucket(i, b, grad[lo:hi])
    replica.end()
    gradlog.applied(i, replica.step)


def state_arrays(job, checkpoint) -> dict[str, np.ndarray]:
    """A checkpoint's tensors keyed as the truth keys them."""
    out = {}
    opt = checkpoint["optimizer"]["state"]
    for i, p in enumerate(job_params(job)):
        out[f"param/{p.name}"] = checkpoint["model"][p.name].numpy()
        out[f"exp_avg/{p.name}"] = opt[i]["exp_avg"].numpy()
        out[f"exp_avg_sq/{p.name}"] = opt[i]["exp_avg_sq"].numpy()
        out["step"] = np.array(int(opt[i]["step"]))
    return out


def assert_truth(job, truth, checkpoint, at) -> None:
    assert checkpoint["iteration"] == at
    with np.load(iteration_dir(truth, at - 1) / "state.npz") as t:
        difference = compare_state(at - 1, state_arrays(job, checkpoint), {k: t[k] for k in t.files})
    assert difference is None, str(difference)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_restore_at_every_iteration_between_snapshots_equals_the_truth(sim, tmp_path, request, kind):
    job, truth = sim
    store = store_of(kind, tmp_path, request, job)
    _, gradlog = feed(job, truth, store, tmp_path / "local")
    assert gradlog.counts() == {"logged": ITERATIONS, "dropped": 0, "failed": 0, "last_logged": ITERATIONS}
    assert store.ready() == [3, 6]
    assert LogStore(store).logged() == list(range(1, ITERATIONS + 1))
    for at in range(3, ITERATIONS + 2):          # from the snapshot of 3 (and of 6) to the newest logged
        rebuilt = rebuild(job, store, at)
        assert rebuilt.snapshot == (6 if at >= 6 else 3) and rebuilt.replayed == list(range(rebuilt.snapshot, at))
        assert_truth(job, truth, rebuilt.checkpoint, at)
    records, loaded = [], []                     # as far as it goes: a restarted appliance's start
    newest = rebuild(job, store, progress=lambda *a: records.append(a), loading=lambda *a: loaded.append(a))
    assert newest.stopped is None and newest.checkpoint["iteration"] == ITERATIONS + 1
    size = sum(o["size"] for o in store.manifest(6)["objects"].values())
    assert loaded[-1] == (size, size) and loaded == sorted(loaded), loaded     # the snapshot's bytes, then
    assert records == [(k, ITERATIONS + 1 - 6) for k in range(1, ITERATIONS + 2 - 6)]   # each record
    with pytest.raises(GradtapError, match=r"--at 2: before the oldest READY snapshot .* \(iteration 3\)"):
        rebuild(job, store, 2)
    with pytest.raises(GradtapError, match=r"--at 10: past the newest logged iteration \(7 .* up to --at 8"):
        rebuild(job, store, 10)
    with pytest.raises(GradtapError, match=r"past the newest logged iteration \(7 .* up to --at 8"):
        rebuild(job, store, 10 ** 15)                # answered at once, nothing sized by it


@pytest.mark.slow
def test_a_corrupted_record_is_refused_by_name_and_a_missing_one_is_a_gap(sim, tmp_path):
    job, truth = sim
    store = store_of("file", tmp_path, None, job)
    feed(job, truth, store, tmp_path / "local")
    logstore = LogStore(store)
    entry = logstore.entry(4)
    obj = tmp_path / "store" / objects_dir(4) / entry.sha256
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    with pytest.raises(GradtapError, match=r"record of iteration 4 .*: corrupt: .* sha256"):
        rebuild(job, store, 5)
    assert_truth(job, truth, rebuild(job, store, 4).checkpoint, 4)      # before it: whole
    stopped = rebuild(job, store)                # a restart goes as far as the newest snapshot and the log
    assert stopped.checkpoint["iteration"] == ITERATIONS + 1             # (from 6: the bad record is before it)
    (tmp_path / "store" / entry_key(4)).unlink()
    with pytest.raises(GradtapError, match=r"gap: iteration 4 not logged, so from the snapshot of iteration 3 it "
                                           r"rebuilds up to --at 4 only; the first READY snapshot after it is "
                                           r"iteration 6"):
        rebuild(job, store, 5)
    assert_truth(job, truth, rebuild(job, store, 7).checkpoint, 7)      # from the snapshot after the gap


@pytest.mark.slow
def test_records_of_another_timeline_are_never_replayed(sim, tmp_path):
    job, truth = sim
    store = store_of("file", tmp_path, None, job)
    feed(job, truth, store, tmp_path / "local")
    # A second writer starts from the snapshot of 3 and takes other gradients (a trainer restarted
    # from that state, on other data): its records of 3 and 4 replace the first writer's.
    other = Replica(job, rebuild(job, store, 3).checkpoint)
    gradlog = GradientLog.for_replica(store, other, ReplicaOrigin.of(other), queue=2, retry_min_s=0.05,
                                      retry_max_s=0.2)
    apply(other, gradlog, 3, truth_grad(truth, 5))
    apply(other, gradlog, 4, truth_grad(truth, 6))
    assert gradlog.wait_idle(30)
    gradlog.close(10)
    assert LogStore(store).entry(3).base is not None and LogStore(store).entry(4).prev is not None
    # Its own timeline rebuilds (its first record names the snapshot's state as its base) ...
    rebuilt = rebuild(job, store, 5).checkpoint
    assert all(torch.equal(rebuilt["model"][k], v) for k, v in other.state_dict()["model"].items())
    # ... and the first writer's record of 5, which follows another record of 4, is refused (the
    # snapshot of 6 gone, the replay crosses it).
    (tmp_path / "store" / "snapshots" / "000006" / "MANIFEST").unlink()
    with pytest.raises(GradtapError, match="record of iteration 5: follows another record of iteration 4"):
        rebuild(job, store, 6)
    # A writer that cannot name the state its first record applies to begins a chain no replay crosses.
    third = Replica(job, rebuild(job, store, 4).checkpoint)
    gradlog = GradientLog.for_replica(store, third, None, queue=2, retry_min_s=0.05, retry_max_s=0.2)
    apply(third, gradlog, 4, truth_grad(truth, 4))
    assert gradlog.wait_idle(30)
    gradlog.close(10)
    with pytest.raises(GradtapError, match="record of iteration 4: begins a new chain"):
        rebuild(job, store, 5)


@pytest.mark.slow
def test_a_slow_store_drops_records_as_counted_gaps_and_never_blocks_the_update_path(sim, tmp_path, monkeypatch):
    job, truth = sim
    store = store_of("file", tmp_path, None, job)
    release, writing = threading.Event(), threading.Event()
    write = LogStore.write

    def blocked(self, entry, blob):
        writing.set()
        release.wait(30)
        write(self, entry, blob)

    monkeypatch.setattr(LogStore, "write", blocked)
    replica = Replica(job, start_of(truth))
    gradlog = GradientLog.for_replica(store, replica, ReplicaOrigin.of(replica), queue=2, retry_min_s=0.05,
                                      retry_max_s=0.2)
    events = []
    gradlog.on_event = lambda kind, **fields: events.append((kind, fields))
    took = []
    for i in range(1, 6):
        started = time.perf_counter()
        apply(replica, gradlog, i, truth_grad(truth, i))
        took.append(time.perf_counter() - started)
        if i == 1:
            assert writing.wait(10)
    assert max(took) < 5                          # the store is blocked; the replica stepped on
    # Iteration 1 is being written and 2 waits (2 buffers): 3, 4, 5 are dropped.
    assert gradlog.counts()["dropped"] == 3
    assert [k for k, _ in events] == ["gradlog.gap"] and events[0][1]["iteration"] == 3
    release.set()
    assert gradlog.wait_idle(30)
    apply(replica, gradlog, 6, truth_grad(truth, 6))
    assert gradlog.wait_idle(30)
    gradlog.close(10)
    assert events[-1] == ("gradlog.resumed", {"iteration": 6, "missed": [3, 4, 5]})
    assert LogStore(store).logged() == [1, 2, 6]
    assert LogStore(store).entry(6).prev is None          # after a gap: no chain to iteration 5


@pytest.mark.slow
def test_a_failing_store_is_retried_and_a_resync_begins_a_new_chain(sim, tmp_path, monkeypatch):
    job, truth = sim
    store = store_of("file", tmp_path, None, job)
    write, failures = LogStore.write, [OSError("store down"), OSError("store down")]

    def flaky(self, entry, blob):
        if entry.iteration == 2 and failures:
            raise failures.pop()
        write(self, entry, blob)

    monkeypatch.setattr(LogStore, "write", flaky)
    replica = Replica(job, start_of(truth))
    gradlog = GradientLog.for_replica(store, replica, ReplicaOrigin.of(replica), queue=4, retry_min_s=0.01,
                                      retry_max_s=0.02)
    events = []
    gradlog.on_event = lambda kind, **fields: events.append((kind, fields.get("attempt")))
    for i in (1, 2, 3):
        apply(replica, gradlog, i, truth_grad(truth, i))
    gradlog.chain_break()                        # what ReplicaSink does when the replica resyncs
    apply(replica, gradlog, 4, truth_grad(truth, 4))
    assert gradlog.wait_idle(30)
    gradlog.close(10)
    assert gradlog.counts() == {"logged": 4, "dropped": 0, "failed": 2, "last_logged": 4}
    assert events == [("gradlog.failed", 1), ("gradlog.failed", 2)]
    log = LogStore(store)
    assert log.entry(1).base is not None and log.entry(2).prev == log.entry(1).sha256   # retried, still chained
    assert log.entry(4).prev is None and log.entry(4).base is None
    with pytest.raises(GradtapError, match="no READY snapshot of job"):
        rebuild(job, store, 3)
    store.put_bytes("snapshots/000001/MANIFEST", b"")           # a manifest that is none: nothing verifies
    with pytest.raises(GradtapError, match="no READY snapshot .* at or before iteration 3 verifies"):
        rebuild(job, store, 3)


@pytest.mark.slow
def test_retention_deletes_records_before_the_oldest_ready_snapshot(sim, tmp_path):
    job, truth = sim
    store = store_of("file", tmp_path, None, job)
    feed(job, truth, store, tmp_path / "local")
    store.keep_last = 1
    store.retain()
    assert store.ready() == [6]
    assert LogStore(store).retain() == [1, 2, 3, 4, 5]
    assert LogStore(store).logged() == [6, 7]
    assert sorted(p.name for p in (tmp_path / "store" / "gradlog" / "objects").iterdir()) == ["000006", "000007"]
    assert_truth(job, truth, rebuild(job, store, 8).checkpoint, 8)


def test_codec_round_trips_and_refuses_what_is_not_its_size():
    raw = np.random.default_rng(0).standard_normal(1000).astype(np.float32).view(np.uint8)
    blob = encode(raw, 4)
    assert decode(blob, raw.size, 4, "x").tobytes() == raw.tobytes()
    with pytest.raises(GradtapError, match="x: decompresses to more than 3996 B, not the 3996 B"):
        decode(blob, raw.size - 4, 4, "x")
    with pytest.raises(GradtapError, match="x: not a deflate stream"):
        decode(b"\x00" * 64, raw.size, 4, "x")


@pytest.mark.parametrize("data,says", [
    (b"x" * (MAX_ENTRY_BYTES + 1), "is no log entry"),
    (b"{", "not JSON"),
    (b"[]", "not a gradtap-gradlog/1 entry"),
    (b'{"format": "gradtap-gradlog/1", "codec": "shuffle-deflate", "iteration": -1}', "field job is None"),
])
def test_hostile_entries_are_refused(data, says):
    with pytest.raises(GradtapError, match=says):
        LogEntry.parse(data, "e")


def test_an_entry_with_a_negative_or_non_hex_field_is_refused():
    good = LogEntry(job="j", iteration=1, step=1, wire_dtype="fp32", raw_bytes=8, raw_sha256="a" * 64,
                    sha256="b" * 64, size=8, prev=None, base=None, job_sha256={})
    assert LogEntry.parse(good.to_json(), "e") == good
    for field, value in (("size", -1), ("raw_sha256", "z" * 64), ("iteration", True)):
        bad = good.to_json().replace(f'"{field}": {good.__dict__[field]!r}'.replace("'", '"').encode(),
                                     f'"{field}": {value!r}'.replace("'", '"').replace("True", "true").encode())
        with pytest.raises(GradtapError, match="e: "):
            LogEntry.parse(bad, "e")


def test_the_job_spec_field_is_checked():
    doc = make_job(3, "LL", 2, "fp32").model_dump(mode="json")
    doc["appliance"]["store"] = {"url": "file:///tmp/s", "gradient_log": "always"}
    with pytest.raises(ConfigError, match=r"appliance.store.gradient_log: gradient_log is 'always'; give true"):
        parse_job(doc)
    doc["appliance"]["store"] = {"url": "file:///tmp/s", "gradient_log": True, "gradient_log_queue": 1}
    with pytest.raises(ConfigError, match=r"appliance.store.gradient_log_queue: gradient_log_queue is 1; give a "
                                          r"whole number of gradients from 2"):
        parse_job(doc)
    doc["appliance"]["store"] = {"url": "file:///tmp/s", "gradient_log": True}
    assert parse_job(doc).appliance.store.gradient_log_queue == 3
