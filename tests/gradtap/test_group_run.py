"""``gradtap run --group``: the live appliance as one node of a mirror group, over ``pcap:``
stream sources on one machine (the nodes meet on tcp://127.0.0.1 at a port the OS gave).
Three nodes with one stream each keep a group snapshot equal, bit for bit, to the
single-process appliance and to the simulator's truth; a node killed mid-run is named by
the survivors (event and fallback), which stop on their own instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
import torch

from gradtap.appliance import GROUP_BROKEN_EXIT, Appliance, RunOptions
from gradtap.capture.worker import SourceSpec
from gradtap.core.errors import ConfigError
from gradtap.metrics import ApplianceCollector
from gradtap.store.shard_snapshot import assemble
from gradtap.updater.replica import Replica
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.shards import Shards
from gradtap.workload.spec import MirrorGroupSpec, dump_job, parse_job
from tests.gradtap.test_group_cli import free_port
from tests.gradtap.test_group_replay import ITERATIONS, assert_group_snapshot, simulated  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[2]
NODE_TIMEOUT_S = 300
STREAMS = ["m-egress", "m-ingress", "m-both"]
RING = ["--ring-slots", "4096", "--slot-size", "4352", "--hugepages", "off"]

# A node that SIGKILLs itself (and its capture worker: its process group) on the first bucket
# of iteration DIE_AT that it steps: killed mid-iteration, mid-run.
DIES = """
import os, signal, sys
from gradtap.group import GroupSink
applied = GroupSink.bucket
def bucket(self, iteration, b, data):
    if iteration == int(os.environ["GRADTAP_TEST_DIE_AT"]):
        os.killpg(os.getpgid(0), signal.SIGKILL)
    applied(self, iteration, b, data)
GroupSink.bucket = bucket
from gradtap.cli import main
main()
"""


def node_command(job_path: Path, sim: Path, out: Path, stream: str, rank: int, world: int, rendezvous: str,
                 code: str = "from gradtap.cli import main; main()") -> list[str]:
    return [sys.executable, "-c", code, "run", str(job_path),
            "--stream", f"{stream}=pcap:{sim / 'streams'}/{stream}.pcap",
            "--out", str(out), "--start", str(sim / "truth" / "start.pt"), "--group", f"{rank}/{world}",
            "--rendezvous", rendezvous, "--group-timeout", "60", "--metrics-port", "0", "--control-port", "0",
            "--no-status", *RING]


def start_node(command: list[str], env: dict | None = None) -> subprocess.Popen:
    # Its own session: the test can kill the node with its capture worker, whatever happens.
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "COLUMNS": "200", **(env or {})})


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Each node's stderr once it ends by itself (bounded); every node killed afterwards."""
    try:
        return [p.communicate(timeout=NODE_TIMEOUT_S)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_three_nodes_of_gradtap_run_equal_the_single_appliance_and_the_truth(tmp_path, simulated):  # noqa: F811
    job, sim, single = simulated
    (tmp_path / "job.yaml").write_text(dump_job(job))
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    # Nodes 1 and 2 through the command line; node 0 (which hosts the rendezvous) in this
    # process, so that its status and metrics can be read as a running appliance shows them.
    procs = [start_node(node_command(tmp_path / "job.yaml", sim, tmp_path / f"node{r}", STREAMS[r], r, 3, rendezvous))
             for r in (1, 2)]
    try:
        streams = {STREAMS[0]: SourceSpec("pcap", (str(sim / "streams" / f"{STREAMS[0]}.pcap"),), {})}
        group = MirrorGroupSpec(rank=0, world_size=3, rendezvous=rendezvous, timeout_s=60)
        start = torch.load(sim / "truth" / "start.pt", weights_only=True)
        appliance = Appliance(job, streams, tmp_path / "node0", start,
                              RunOptions(ring_slots=4096, slot_size=4352, hugepages="off"), group)
        result = appliance.run()
    finally:
        errors = finish(procs)
    assert result.exit_code == 0 and result.reason == "every source ended" and result.unrecoverable == 0, result
    for p, err in zip(procs, errors):
        assert p.returncode == 0 and "every source ended" in err and "unrecoverable; replica at iteration" in err, err
    shards = Shards.balanced([b.numel for b in job_buckets(job)], 3)
    for r, err in zip((1, 2), errors):
        assert f"node {r} of 3, shard of buckets {shards.buckets_of(r)}" in err, err
    for r in range(3):
        lines = lines_of(tmp_path / f"node{r}" / "iterations.jsonl")
        assert [line["recovered"] for line in lines] == [True] * ITERATIONS, (r, lines)
    # The joined group snapshot against the single appliance (itself verified against the truth) ...
    assert_group_snapshot(tmp_path, job, sim, 3, single)
    # ... and against the trainer's state itself, every tensor, directly.
    folders = [tmp_path / f"node{r}" / "snapshots" / f"iteration-{single.iteration:06d}" for r in range(3)]
    joined = assemble(Replica(job, torch.load(sim / "truth" / "start.pt", weights_only=True)), folders)
    last = json.loads((sim / "truth" / "manifest.json").read_text())["iterations"][-1]      # state after it
    assert joined["iteration"] == last + 1
    with np.load(sim / "truth" / f"iter_{last:06d}" / "state.npz") as truth:
        for i, p in enumerate(job_params(job)):
            assert joined["model"][p.name].numpy().tobytes() == truth[f"param/{p.name}"].tobytes(), p.name
            for name in ("exp_avg", "exp_avg_sq"):
                assert joined["optimizer"]["state"][i][name].numpy().tobytes() == truth[f"{name}/{p.name}"].tobytes()
    # The group section of the status (GET /status) and the metrics, as the run left them.
    g = appliance.status().group
    assert (g["rank"], g["world_size"], g["peers"]) == (0, 3, {"1": "up", "2": "up"})
    assert g["buckets"] == shards.buckets_of(0) and g["sent_bytes"] > 0 and g["received_bytes"] > 0
    metrics = {m.name: m for m in ApplianceCollector(appliance.status).collect()}
    assert {s.labels["direction"]: s.value for s in metrics["gradtap_group_bytes"].samples} == \
        {"sent": g["sent_bytes"], "received": g["received_bytes"]}
    assert {s.labels["peer"]: s.value for s in metrics["gradtap_group_peer_up"].samples} == {"1": 1, "2": 1}
    assert metrics["gradtap_group_world_size"].samples[0].value == 3


@pytest.mark.slow
def test_a_node_killed_mid_run_is_named_by_the_survivors_which_stop(tmp_path, simulated):  # noqa: F811
    job, sim, _ = simulated
    (tmp_path / "job.yaml").write_text(dump_job(job))
    victim = Shards.balanced([b.numel for b in job_buckets(job)], 3).owner[0]
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs = [start_node(node_command(tmp_path / "job.yaml", sim, tmp_path / f"node{r}", STREAMS[r], r, 3, rendezvous,
                                     DIES if r == victim else "from gradtap.cli import main; main()"),
                        {"GRADTAP_TEST_DIE_AT": "2"}) for r in range(3)]
    errors = finish(procs)
    assert procs[victim].returncode == -signal.SIGKILL
    for r, (p, err) in enumerate(zip(procs, errors)):
        if r == victim:
            continue
        assert p.returncode == GROUP_BROKEN_EXIT, err
        assert f"mirror group broken: node rank {victim} is gone" in err and "stale" in err, err
        lines = lines_of(tmp_path / f"node{r}" / "iterations.jsonl")
        assert [line["recovered"] for line in lines] == [True, False] and list(lines[1]["lost_peers"]) == [str(victim)]
        events = lines_of(tmp_path / f"node{r}" / "events.jsonl")
        gone = [e for e in events if e["event"] == "group.peer_gone"]
        fallback = [e for e in events if e["event"] == "fallback"]
        assert [e["iteration"] for e in gone] == [2] and list(gone[0]["peers"]) == [str(victim)], events
        assert [e["iteration"] for e in fallback] == [2] and f"node rank {victim} is gone" in fallback[0]["reason"]


def test_what_a_group_node_does_not_take_is_refused_by_name(tmp_path):
    from gradtap.commands.group_options import refuse_for_group
    from gradtap.start import replica_start
    from gradtap.updater.replica import seed_checkpoint
    from tests.merger.test_group import group_job

    job = group_job()
    with pytest.raises(click.UsageError, match="--store, --resync-dir are not wired for mirror-group shards"):
        refuse_for_group({"--store": True, "--start-from-store": False, "--resync-dir": True})
    refuse_for_group({"--store": False})
    group = MirrorGroupSpec(rank=0, world_size=2, rendezvous=f"tcp://127.0.0.1:{free_port()}", timeout_s=1)
    streams = {"m-egress": SourceSpec("pcap", ("x.pcap",), {})}
    with pytest.raises(ConfigError, match="a node needs a start state"):
        Appliance(job, streams, tmp_path / "a", None, RunOptions(), group)
    with pytest.raises(ConfigError, match="digests .* not wired for shards"):
        Appliance(job, streams, tmp_path / "b", seed_checkpoint(job, 0), RunOptions(digests=True), group)
    doc = job.model_dump(mode="json", exclude_none=True)
    doc["appliance"]["store"] = {"url": f"file://{tmp_path / 'store'}"}
    with pytest.raises(ConfigError, match=r"appliance.store \(file://.*\): the durable store and its gradient log "
                                          "are not wired for mirror-group shards"):
        Appliance(parse_job(doc), streams, tmp_path / "c", replica_start(job, seed_checkpoint(job, 0), "seed"),
                  RunOptions(), group)


def test_a_group_node_refuses_offers_and_attestations_on_its_control_endpoint(tmp_path):
    """A node alone (world size 1: no rendezvous) answers POST /resync and /attest with the
    reason, and GET /status with its group section."""
    from gradtap.updater.replica import seed_checkpoint
    from tests.merger.test_group import group_job

    job = group_job()
    group = MirrorGroupSpec(rank=0, world_size=1, rendezvous="tcp://127.0.0.1:1", timeout_s=1)
    appliance = Appliance(job, {"m-egress": SourceSpec("pcap", ("x.pcap",), {})}, tmp_path, seed_checkpoint(job, 0),
                          RunOptions(), group)
    try:
        with pytest.raises(ConfigError, match=r"POST /resync .*not wired for mirror-group shards yet; node 0 of 1"):
            appliance.offer(seed_checkpoint(job, 0))
        with pytest.raises(ConfigError, match=r"POST /attest .*not wired for mirror-group shards yet"):
            appliance.attest({})
        g = appliance.status().group
        assert (g["rank"], g["world_size"], g["peers"], g["sent_bytes"]) == (0, 1, {}, 0)
        assert g["elements"] == [0, appliance.replica.layout.total]
    finally:
        appliance.group.close()
        appliance.pipeline.close()
