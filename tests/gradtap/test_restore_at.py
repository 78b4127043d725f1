"""``gradtap restore --at`` and ``--start-from-store`` with a gradient log, end to end: the
appliance replays simulated captures with a store and a gradient log; every iteration between
two snapshots is rebuilt from the store by the command and equals the simulator's ground truth
bit for bit; an appliance restarted from the store (snapshot + log) over the captures that
follow equals the truth; a store with nothing usable makes it ask the trainer (fallback)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapWriter, read_pcap
from gradtap.core.errors import GradtapError
from gradtap.replay import run_replay
from gradtap.simulator.training import make_optimizer
from gradtap.store import snapshot
from gradtap.store.gradient_log import LogStore, entry_key, rebuild
from gradtap.store.object_store import SnapshotStore
from gradtap.store_tier import store_start, with_store
from gradtap.trainer import restore
from gradtap.verify import compare_snapshot
from gradtap.workload.layout import job_params
from gradtap.workload.models import build
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate

ITERATIONS = 7            # captured iterations 1..7; snapshots ready for 3, 6 and (the clean end) 8


def logged_job(url: str):
    job = with_store(make_job(3, "LL", 2, "fp32"), url)
    # Offline, the replay runs faster than the log thread on a loaded machine: room for every record.
    store = job.appliance.store.model_copy(update={"keep_last": 10, "gradient_log": True,
                                                   "gradient_log_queue": ITERATIONS + 1})
    return job.model_copy(update={"appliance": job.appliance.model_copy(update={"snapshot_every": 3,
                                                                                "store": store})})


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    root = tmp_path_factory.mktemp("restore_at")
    job = logged_job(f"file://{root / 'store'}")
    simulate(root / "sim", job, iterations=ITERATIONS)
    run_replay(job, streams_of(root / "sim", job), root / "replay", start_of(root / "sim"))
    job_file = root / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    return job, root, job_file


def restore_cli(*args):
    from gradtap.cli import _register, app

    _register()
    return CliRunner().invoke(app, ["restore", *map(str, args)])


@pytest.mark.slow
def test_gradtap_restore_at_every_iteration_between_snapshots_equals_the_truth(replayed, tmp_path):
    job, root, job_file = replayed
    counts = json.loads((root / "replay" / "replay.json").read_text())["gradient_log"]
    assert counts == {"logged": ITERATIONS, "dropped": 0, "failed": 0, "last_logged": ITERATIONS}
    store = SnapshotStore(job.appliance.store.url, job.name)
    assert store.ready() == [3, 6, 8]
    for at in range(3, ITERATIONS + 2):
        out = tmp_path / f"at-{at}"
        done = restore_cli("--at", at, "--store", root / "store", "--job", job_file, "--out", out)
        assert done.exit_code == 0, (done.output, done.exception)
        assert f"iteration {at} of job {job.name}" in done.output
        path = snapshot.latest(out)
        assert path.name == snapshot.snapshot_name(at)
        assert compare_snapshot(path, root / "sim" / "truth", job_params(job), job.name) == (at - 1, None)
    # What a trainer does with it: gradtap.trainer.restore, then training continues at `at`.
    model = build(job.model.factory, job.model.kwargs, seed=0)
    optimizer = make_optimizer(list(model.parameters()), job.optimizer)
    assert restore(model, optimizer, tmp_path / "at-5") == 5
    with np.load(root / "sim" / "truth" / "iter_000004" / "state.npz") as truth:
        for name, p in model.named_parameters():
            assert p.detach().numpy().tobytes() == truth[f"param/{name}"].tobytes(), name


@pytest.mark.slow
def test_gradtap_restore_refuses_what_it_cannot_rebuild(replayed, tmp_path):
    job, root, job_file = replayed
    for at, says in ((2, "before the oldest READY snapshot"), (12, "past the newest logged iteration (7")):
        done = restore_cli("--at", at, "--store", root / "store", "--job", job_file, "--out", tmp_path / "x")
        assert isinstance(done.exception, GradtapError) and says in str(done.exception), done.output
        assert not (tmp_path / "x").exists()
    (tmp_path / "x").mkdir()
    done = restore_cli("--at", 4, "--store", root / "store", "--job", job_file, "--out", tmp_path / "x")
    assert "exists; give a new directory, or --force" in str(done.exception)
    done = restore_cli("--at", 4, "--store", root / "store", "--job", job_file, "--out", tmp_path / "x", "--force")
    assert done.exit_code == 0 and snapshot.latest(tmp_path / "x").name == "iteration-000004"


def captures_from(sim, job, first: int, out, until: int | None = None):
    """The streams' frames from the start of captured iteration ``first`` on (up to the start of
    ``until``): what an appliance restarted then captures."""
    spans = json.loads((sim / "truth" / "manifest.json").read_text())["span_ns"]
    begin = spans[str(first)][0]
    end = spans[str(until)][0] if until is not None else None
    out.mkdir()
    streams = {}
    for name, path in streams_of(sim, job).items():
        b = read_pcap(path)
        keep = np.flatnonzero((b.ts_ns >= begin) & ((b.ts_ns < end) if end is not None else True))
        streams[name] = out / f"{name}.pcap"
        with PcapWriter(streams[name]) as w:
            w.write_batch(FrameBatch(b.data, b.offsets[keep], b.caplens[keep], b.wirelens[keep], b.ts_ns[keep],
                                     b.linktype))
    return streams


@pytest.mark.slow
def test_an_appliance_restarted_from_the_store_and_its_log_equals_the_truth(replayed, tmp_path):
    job, root, _ = replayed
    # The appliance died after logging iteration 4: the store holds the snapshot of 3 and the log to 4.
    shutil.copytree(root / "store", tmp_path / "store")
    for k in (6, 8):
        shutil.rmtree(tmp_path / "store" / "snapshots" / f"{k:06d}")
    for i in (5, 6, 7):
        (tmp_path / "store" / entry_key(i)).unlink()
    restarted = logged_job(f"file://{tmp_path / 'store'}")
    begin = store_start(restarted)
    assert begin.first_iteration == 5 and begin.fallback is None
    sim = root / "sim"
    _, sink = run_replay(restarted, captures_from(sim, job, 5, tmp_path / "streams"), tmp_path / "out", begin)
    assert sink.applied == [5, 6, 7] and not sink.replica.stale
    final = snapshot.latest(tmp_path / "out" / "snapshots")
    assert compare_snapshot(final, sim / "truth", job_params(job), job.name) == (7, None)
    # The restarted appliance logged 5..7, its first record naming the state it began from: a
    # restore from the snapshot of 3 crosses the restart.
    store = SnapshotStore(restarted.appliance.store.url, job.name)
    assert LogStore(store).entry(5).base is not None
    assert store.ready() == [3, 6, 8]                      # 6 and 8: the restarted appliance's own
    for k in (6, 8):
        (tmp_path / "store" / "snapshots" / f"{k:06d}" / "MANIFEST").unlink()
    rebuilt = rebuild(restarted, store, 8)
    assert rebuilt.snapshot == 3 and rebuilt.replayed == [3, 4, 5, 6, 7]
    assert all(torch.equal(rebuilt.checkpoint["model"][k], v)
               for k, v in snapshot.load(final)["model"].items())


@pytest.mark.slow
def test_a_store_with_nothing_usable_asks_the_trainer_instead_of_pretending(replayed, tmp_path):
    job, root, _ = replayed
    empty = logged_job(f"file://{tmp_path / 'empty'}")
    begin = store_start(empty)
    assert begin.waiting and "nothing usable" in begin.fallback[1]
    _, sink = run_replay(empty, streams_of(root / "sim", job), tmp_path / "out", begin)
    assert sink.applied == [] and sink.replica.stale
    events = [json.loads(line) for line in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    fallback = [e for e in events if e["event"] == "fallback"][0]
    assert fallback["request"] == "regular_checkpoint" and "no READY snapshot" in fallback["reason"]
    assert not snapshot.Snapshots(tmp_path / "out" / "snapshots", job.name).snapshots()   # nothing pretended
