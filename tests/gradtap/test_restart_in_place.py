"""An appliance restarted into its own ``--out`` from one of its own snapshots (``--start
OUT/snapshots/iteration-…`` after a crash) continues the replica the directory records, and equals the
simulator's truth; any other start state into that directory is still refused."""

from __future__ import annotations

import shutil

import pytest

from gradtap.checkpoints import load_checkpoint
from gradtap.core.errors import ConfigError
from gradtap.replay import run_replay
from gradtap.store import snapshot
from gradtap.verify import compare_snapshot
from gradtap.workload.layout import job_params
from tests.gradtap.test_replay import start_of
from tests.gradtap.test_restore_at import captures_from
from tests.simulator.test_simulate import make_job, simulate


@pytest.mark.slow
def test_a_restart_from_its_own_snapshot_continues_the_replica(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    sim, out = tmp_path / "sim", tmp_path / "out"
    simulate(sim, job, iterations=6)
    _, sink = run_replay(job, captures_from(sim, job, 1, tmp_path / "before", until=4), out, start_of(sim))
    assert sink.applied == [1, 2, 3]                          # then the appliance died
    origin = (out / "snapshots" / "ORIGIN.json").read_text()
    latest = snapshot.latest(out / "snapshots")
    start = load_checkpoint(latest, what="--start")
    assert start["iteration"] == 4
    after = captures_from(sim, job, 4, tmp_path / "after")
    with pytest.raises(ConfigError, match=r"holds the snapshots of .*the start state differs.*to continue that replica after a restart: --start .*iteration-000004, its newest"):
        run_replay(job, after, out, start)                    # not said to come from here
    elsewhere = tmp_path / "copy" / latest.name
    shutil.copytree(latest, elsewhere)
    with pytest.raises(ConfigError, match="the start state differs"):
        run_replay(job, after, out, load_checkpoint(elsewhere), continues=elsewhere)   # equal, but not its own
    _, sink = run_replay(job, after, out, start, continues=latest)
    assert sink.applied == [4, 5, 6] and not sink.replica.stale
    assert (out / "snapshots" / "ORIGIN.json").read_text() == origin                  # the same replica
    final = snapshot.latest(out / "snapshots")
    assert compare_snapshot(final, sim / "truth", job_params(job), job.name)[1] is None
    assert snapshot.load(final)["iteration"] == 7
