"""``gradtap replay --group RANK/SIZE --rendezvous URL``: the flags, the job spec's
``appliance.mirror_group`` beneath them, and two node processes meeting over tcp://."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import click
import pytest

from gradtap.commands.replay import mirror_group
from gradtap.core.errors import ConfigError
from gradtap.workload.spec import dump_job, parse_job
from tests.forked import run_clis
from tests.gradtap.test_group_replay import ITERATIONS, simulated  # noqa: F401 (the fixture)
from tests.merger.test_group import group_job

ROOT = Path(__file__).resolve().parents[2]


def with_group(job, **group):
    doc = job.model_dump(mode="json", exclude_none=True)
    doc.setdefault("appliance", {})["mirror_group"] = group
    return parse_job(doc)


def test_flags_and_the_job_spec_make_the_group():
    job = group_job()
    assert mirror_group(job, None, None, None) is None
    g = mirror_group(job, "1/3", "tcp://10.0.0.1:29500", 5.0)
    assert (g.rank, g.world_size, g.rendezvous, g.timeout_s) == (1, 3, "tcp://10.0.0.1:29500", 5.0)
    spec = with_group(job, rank=2, world_size=3, rendezvous="file:///shared/group", interface="gt0")
    g = mirror_group(spec, None, None, None)
    assert (g.rank, g.world_size, g.interface) == (2, 3, "gt0")
    g = mirror_group(spec, "0/3", "tcp://[fd00::1]:29500", None)      # flags over the spec
    assert (g.rank, g.rendezvous, g.interface) == (0, "tcp://[fd00::1]:29500", "gt0")
    with pytest.raises(ConfigError, match="rank 3 is outside the group"):
        mirror_group(job, "3/3", "tcp://a:1", None)
    with pytest.raises(ConfigError, match="rendezvous: 'http://a' is neither"):
        mirror_group(job, "0/2", "http://a", None)
    with pytest.raises(ConfigError, match="rendezvous: Field required"):
        mirror_group(job, "0/2", None, None)
    with pytest.raises(ConfigError, match="timeout_s"):
        mirror_group(job, "0/2", "tcp://a:1", 0.0)
    with pytest.raises(click.BadParameter, match="not RANK/SIZE"):
        mirror_group(job, "two", "tcp://a:1", None)
    with pytest.raises(click.UsageError, match="need --group"):
        mirror_group(job, None, "tcp://a:1", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_replay_through_the_command_line(tmp_path, simulated):  # noqa: F811 (the fixture)
    job, sim, _ = simulated
    (tmp_path / "job.yaml").write_text(dump_job(job))
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    nodes = [["m-egress", "m-both"], ["m-ingress"]]
    done = run_clis([("replay", str(tmp_path / "job.yaml"), *(f"{s}={sim / 'streams' / f'{s}.pcap'}" for s in streams),
                      "--start", str(sim / "truth" / "start.pt"), "--out", str(tmp_path / f"node{r}"),
                      "--group", f"{r}/2", "--rendezvous", rendezvous, "--group-timeout", "60")
                     for r, streams in enumerate(nodes)], cwd=ROOT, env={"COLUMNS": "120"})
    for r, node in enumerate(done):
        text = node.stdout + node.stderr
        assert node.returncode == 0, text
        assert f"node {r} of 2" in text and "current" in text, text
        report = json.loads((tmp_path / f"node{r}" / "replay.json").read_text())
        assert [line["recovered"] for line in report["iterations"]] == [True] * ITERATIONS
        assert not report["stale"] and report["group"]["rank"] == r and report["group"]["sent_bytes"] > 0
