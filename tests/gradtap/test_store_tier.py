"""The appliance with a durable store: replay uploads its snapshots (file:// store), the store's
newest READY snapshot is what a restarted appliance starts from and what a trainer resumes
from, bit for bit; --store and --start-from-store are checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradtap.core.errors import ConfigError
from gradtap.replay import run_replay
from gradtap.simulator.run import resume
from gradtap.simulator.truth import optimizer_arrays
from gradtap.store_tier import store_checkpoint, with_store
from gradtap.store import snapshot
from gradtap.store.object_store import SnapshotStore
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate
from tests.store.test_object_store import bits


@pytest.mark.slow
def test_replay_uploads_and_a_restart_starts_from_the_store(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=4)
    url = f"file://{tmp_path / 'store'}"
    stored = with_store(job, url)
    stored = stored.model_copy(update={"appliance": stored.appliance.model_copy(
        update={"store": stored.appliance.store.model_copy(update={"keep_last": 10})})})
    run_replay(stored, streams_of(tmp_path / "sim", job), tmp_path / "replay", start_of(tmp_path / "sim"))
    counts = json.loads((tmp_path / "replay" / "replay.json").read_text())["store"]
    assert counts["uploaded"] >= 1 and counts["failed"] == 0
    local = snapshot.load(snapshot.latest(tmp_path / "replay" / "snapshots"))
    # The local directory is lost: a restarted appliance takes the store's newest READY snapshot.
    assert bits(store_checkpoint(stored)) == bits(local)
    # A trainer resumed from an older READY snapshot in the store continues bit for bit.
    store = SnapshotStore(url, job.name)
    k = [i for i in store.ready() if i < 5][0]
    trainer = resume(job, store.load(k), seed=7, until=5)
    resumed = optimizer_arrays(trainer.model, trainer.optimizer)
    with np.load(tmp_path / "sim" / "truth" / "iter_000004" / "state.npz") as truth:
        for key in truth.files:
            assert resumed[key].tobytes() == truth[key].tobytes(), key


def test_store_flags_are_checked():
    job = make_job(3, "LL", 2, "fp32")
    with pytest.raises(ConfigError, match="no store"):
        store_checkpoint(job)
    with pytest.raises(ConfigError, match="--store /tmp/x"):
        with_store(job, "/tmp/x")
    assert with_store(job, None) is job
    assert with_store(job, "s3://b/p/").appliance.store.url == "s3://b/p"


def test_store_counters_are_metrics():
    from gradtap.metrics import ApplianceCollector
    from gradtap.status import ApplianceStatus

    def families(store):
        status = ApplianceStatus({}, {}, 0, 0, 0, False, 0.0, 0.0, 0.0, 0.0, {}, store=store)
        return {f.name: f for f in ApplianceCollector(lambda: status).collect()}

    assert "gradtap_store_snapshots" not in families(None)
    counts = {"submitted": 9, "uploaded": 5, "skipped": 3, "failed": 2, "last_uploaded": 12}
    samples = {s.labels["result"]: s.value for s in families(counts)["gradtap_store_snapshots"].samples
               if s.name.endswith("_total")}
    assert samples == {"uploaded": 5, "skipped": 3, "failed": 2}


def test_gradient_log_counters_are_metrics():
    from gradtap.metrics import ApplianceCollector
    from gradtap.status import ApplianceStatus
    from gradtap.store.gradient_log import LogCounters

    def families(log):
        status = ApplianceStatus({}, {}, 0, 0, 0, False, 0.0, 0.0, 0.0, 0.0, {}, gradient_log=log)
        return {f.name: f for f in ApplianceCollector(lambda: status).collect()}

    assert "gradtap_gradient_log_records" not in families(None)
    counts = LogCounters(logged=7, dropped=2, failed=1, last_logged=9).as_dict()
    samples = {s.labels["result"]: s.value for s in families(counts)["gradtap_gradient_log_records"].samples
               if s.name.endswith("_total")}
    assert samples == {"logged": 7, "dropped": 2, "failed": 1}


@pytest.mark.slow
def test_gradtap_replay_store_flags(tmp_path):
    import yaml
    from click.testing import CliRunner

    from gradtap.cli import _register, app

    _register()
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=2)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    pcaps = [f"{n}={p}" for n, p in streams_of(tmp_path / "sim", job).items()]
    start = tmp_path / "sim" / "truth" / "start.pt"
    url = f"file://{tmp_path / 'store'}"
    runner = CliRunner()
    done = runner.invoke(app, ["replay", str(job_file), *pcaps, "--out", str(tmp_path / "a"), "--start", str(start),
                               "--store", url])
    assert done.exit_code == 0, done.output
    assert SnapshotStore(url, job.name).ready()[-1] == 3
    both = runner.invoke(app, ["replay", str(job_file), *pcaps, "--out", str(tmp_path / "b"), "--start", str(start),
                               "--store", url, "--start-from-store"])
    assert both.exit_code == 2 and "not both" in both.output
    none = runner.invoke(app, ["replay", str(job_file), *pcaps, "--out", str(tmp_path / "c"), "--start-from-store"])
    assert none.exit_code != 0 and "no store" in str(none.exception or none.output)
