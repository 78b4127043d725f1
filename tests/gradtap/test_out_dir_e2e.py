"""Issue 11 end to end, through run_replay and the CLI: a wrong job replayed
into --out, then the right one; a read-only --out; the event log on a full disk; sizes: abc."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.job_file import open_job
from gradtap.replay import run_replay
from gradtap.verify import verify
from gradtap.workload.layout import job_params, job_plan
from gradtap.workload.spec import dump_job, parse_job
from tests.forked import run_cli
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate
from tests.tmpfs import fill, read_only, tmpfs

def gradtap(*args, cwd):
    return run_cli(*args, cwd=cwd, env={"COLUMNS": "200"})


@pytest.mark.slow
def test_a_wrong_job_then_the_right_one_into_one_out(tmp_path):
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=3)
    truth, out = tmp_path / "sim" / "truth", tmp_path / "replay"
    wrong = job.model_copy(update={"ddp": job.ddp.model_copy(update={"predivide": False})})
    run_replay(wrong, streams_of(tmp_path / "sim", job), out, start_of(tmp_path / "sim"))
    assert verify(out, truth, job_params(job)).differences                     # a wrong replica, snapshots and all
    events_before = (out / "events.jsonl").read_bytes()
    with pytest.raises(ConfigError) as caught:
        run_replay(job, streams_of(tmp_path / "sim", job), out, start_of(tmp_path / "sim"))
    message = str(caught.value)
    assert message.startswith(f"{out / 'snapshots'}: holds the snapshots of job {job.name!r} begun at iteration ")
    assert "(the job spec's ddp section differs)" in message and "--force" in message
    assert (out / "events.jsonl").read_bytes() == events_before                 # nothing of it touched
    run_replay(job, streams_of(tmp_path / "sim", job), out, start_of(tmp_path / "sim"), force=True)
    v = verify(out, truth, job_params(job))
    assert v.ok and v.snapshots_checked, v

    # The same through the command line: refused with the message, then --force.
    (tmp_path / "wrong.yaml").write_text(dump_job(wrong))
    (tmp_path / "job.yaml").write_text(dump_job(job))
    pcaps = [f"{n}={p}" for n, p in streams_of(tmp_path / "sim", job).items()]
    start = str(truth / "start.pt")
    cli = ("--out", str(tmp_path / "cli"), "--start", start)
    assert gradtap("replay", str(tmp_path / "wrong.yaml"), *pcaps, *cli, cwd=tmp_path).returncode == 0
    refused = gradtap("replay", str(tmp_path / "job.yaml"), *pcaps, *cli, cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith(f"error: {tmp_path / 'cli' / 'snapshots'}: holds the snapshots of job "), \
        refused.stderr
    forced = gradtap("replay", str(tmp_path / "job.yaml"), *pcaps, *cli, "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert verify(tmp_path / "cli", truth, job_params(job)).ok


@pytest.mark.privileged
def test_a_read_only_out_is_a_clear_error(tmp_path):
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=1)
    (tmp_path / "job.yaml").write_text(dump_job(job))
    pcaps = [f"{n}={p}" for n, p in streams_of(tmp_path / "sim", job).items()]
    with tmpfs(tmp_path / "fs", 1 << 20) as fs:
        (fs / "old").mkdir()
        with read_only(fs):
            for out in (fs / "new", fs / "old"):
                done = gradtap("replay", str(tmp_path / "job.yaml"), *pcaps, "--out", str(out), "--start",
                               str(tmp_path / "sim" / "truth" / "start.pt"), cwd=tmp_path)
                assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
                assert done.stderr.startswith(f"error: {out / 'snapshots'}: cannot write snapshots there "
                                              "(Read-only file system)"), done.stderr


@pytest.mark.privileged
def test_an_event_log_on_a_full_disk_keeps_whole_lines_and_the_appliance(tmp_path, caplog):
    with tmpfs(tmp_path / "fs", 1 << 20) as fs:
        control = ControlPlane(fs / "events.jsonl")
        control.event("first", n=1)
        filler = fill(fs, leave=0)
        control.event("lost", blob="x" * 8192)          # more than the page the log's tail may have
        assert "cannot append the event (No space left on device)" in caplog.text
        filler.unlink()
        control.event("again", n=2)
        kinds = [json.loads(line)["event"] for line in (fs / "events.jsonl").read_text().splitlines()]
        assert kinds == ["first", "again"]


def test_model_kwargs_a_factory_refuses_are_a_config_error():
    job = make_job(3, "Simple", 2, "fp32")
    doc = json.loads(job.model_dump_json(exclude_none=True))
    doc["model"]["kwargs"]["sizes"] = "abc"
    with pytest.raises(ConfigError, match=r"^model\.kwargs: \{'sizes': 'abc'\} do not fit "
                                          r"gradtap\.workload\.models:mlp \(invalid literal .*\); give the keyword"):
        job_plan(parse_job(doc))


def test_a_command_names_the_job_file_whose_model_kwargs_are_refused(tmp_path):
    job = make_job(3, "Simple", 2, "fp32")
    doc = json.loads(job.model_dump_json(exclude_none=True))
    doc["model"]["kwargs"]["sizes"] = "abc"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: model\.kwargs: \{{'sizes': 'abc'\}} do not fit"):
        open_job(path)
    done = run_cli("simulate", str(path), "-o", str(tmp_path / "sim"))
    assert done.returncode != 0 and f"{path}: model.kwargs" in " ".join(done.stderr.split()), done.stderr
