"""``gradtap replay --group`` end to end: node processes on one machine, each replaying its own
streams of one simulated job, merge over gloo and step their shards; together they equal the
single-process appliance (itself checked against the simulator's truth), bit for bit."""

from __future__ import annotations

import json
import os
import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapWriter, read_pcap
from gradtap.replay import run_replay
from gradtap.simulator.training import make_optimizer
from gradtap.store.shard_snapshot import assemble
from gradtap.updater.replica import Replica
from gradtap.verify import verify
from gradtap.workload.layout import job_buckets, job_params
from gradtap.workload.models import build
from gradtap.workload.shards import Shards
from gradtap.workload.spec import parse_job
from tests.forked import fork_server
from tests.gradtap.test_replay import allgather_frames, start_of, streams_of
from tests.merger.test_group import group_job
from tests.simulator.test_simulate import make_job, simulate

FAULTS = "link_loss=1e-3,corrupt=1e-3,reorder=1e-3,duplicate=1e-3"
ITERATIONS = 3
NODE_TIMEOUT_S = 240


def clipped_job(job=None):
    doc = (job or group_job()).model_dump(mode="json", exclude_none=True)
    doc["optimizer"] = {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.01, "clip_grad_norm": 0.05}
    return parse_job(doc)


def node(rank, world, rendezvous, job_doc, pcaps, out, start, die_at, results):
    """One appliance of the group: ``run_group_replay`` over its captures; its shard's state and
    report lines go on ``results``, and the iterations it finished before the end of its input
    in ``out/before-close.json``. ``die_at``: exit abruptly on the first bucket of that iteration."""
    from gradtap.group import GroupSink, run_group_replay
    from gradtap.merger.group import GroupMerger
    from gradtap.workload.spec import MirrorGroupSpec

    closing = GroupMerger.close

    def close(self):
        (out / "before-close.json").write_text(json.dumps([r.iteration for r in self.finished]))
        return closing(self)
    GroupMerger.close = close

    if die_at is not None:
        applied = GroupSink.bucket

        def bucket(self, iteration, b, data):
            if iteration == die_at:
                os._exit(3)
            applied(self, iteration, b, data)
        GroupSink.bucket = bucket
    group = MirrorGroupSpec(rank=rank, world_size=world, rendezvous=rendezvous, timeout_s=60)
    _, sink = run_group_replay(parse_job(job_doc), pcaps, out, torch.load(start, weights_only=True), group,
                               batch_frames=512)
    results.put((rank, sink.replica.shard_state(), sink.lines, sink.replica.stale))


def run_group(tmp_path: Path, job, sim: Path, nodes: list[list[str]], die: tuple[int, int] | None = None):
    """One process per node; rank -> (shard state, report lines, stale), and the exit codes."""
    ctx = fork_server()
    results = ctx.Queue()
    paths = streams_of(sim, job)
    doc = job.model_dump(mode="json", exclude_none=True)
    procs = [ctx.Process(target=node, daemon=True, args=(
        r, len(nodes), f"file://{tmp_path / 'rendezvous'}", doc, {s: paths[s] for s in streams}, tmp_path / f"node{r}",
        sim / "truth" / "start.pt", die[1] if die and die[0] == r else None, results))
        for r, streams in enumerate(nodes)]
    try:
        for p in procs:
            p.start()
        got = {}
        while len(got) < len(nodes) - (1 if die else 0):
            try:
                rank, *rest = results.get(timeout=NODE_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"mirror group nodes hung: {sorted(set(range(len(nodes))) - set(got))} did not finish")
            got[rank] = rest
        for p in procs:
            p.join(NODE_TIMEOUT_S)
        return got, [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    """One simulated job, and the single-process appliance's replica of it (checked against the truth)."""
    root = tmp_path_factory.mktemp("group")
    job = clipped_job()
    simulate(root / "sim", job, iterations=ITERATIONS, faults=FAULTS)
    _, sink = run_replay(job, streams_of(root / "sim", job), root / "single", start_of(root / "sim"), batch_frames=512)
    v = verify(root / "single", root / "sim" / "truth", job_params(job))
    assert v.ok and v.digests_checked == list(range(1, ITERATIONS + 1))
    return job, root / "sim", sink.replica


def assert_shards_equal(job, got: dict, single) -> None:
    shards = Shards.balanced([b.numel for b in job_buckets(job)], len(got))
    for rank, (state, lines, stale) in got.items():
        assert not stale and [line["recovered"] for line in lines] == [True] * ITERATIONS, (rank, lines)
        assert state["buckets"].tolist() == shards.buckets_of(rank)
        lo, hi = state["elements"]
        for name in ("param", "exp_avg", "exp_avg_sq"):
            assert np.array_equal(state[name].view(np.uint32), getattr(single.state, name)[lo:hi].view(np.uint32)), \
                (rank, name)
    assert sum(int(s["elements"][1] - s["elements"][0]) for s, _, _ in got.values()) == single.layout.total


def assert_group_snapshot(tmp_path: Path, job, sim: Path, world: int, single) -> None:
    """The nodes' newest group snapshot, its shards joined, is the single appliance's replica,
    and a torch model and optimizer load it."""
    folders = [tmp_path / f"node{r}" / "snapshots" / f"iteration-{single.iteration:06d}" for r in range(world)]
    checkpoint = assemble(Replica(job, torch.load(sim / "truth" / "start.pt", weights_only=True)), folders)
    want = single.state_dict()
    assert checkpoint["iteration"] == want["iteration"]
    for key, tensor in want["model"].items():
        assert torch.equal(checkpoint["model"][key].view(torch.int32), tensor.view(torch.int32)), key
    for i, entry in want["optimizer"]["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(checkpoint["optimizer"]["state"][i][name], entry[name]), (i, name)
    model = build(job.model.factory, job.model.kwargs, seed=0)
    model.load_state_dict(checkpoint["model"])
    make_optimizer(list(model.parameters()), job.optimizer).load_state_dict(checkpoint["optimizer"])


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [[["m-egress"], ["m-ingress"], ["m-both"]], [["m-egress", "m-both"], ["m-ingress"]],
                                   [["m-egress", "m-ingress", "m-both"]]], ids=["3-nodes", "2-nodes-uneven", "1-node"])
def test_the_group_equals_the_single_appliance(tmp_path, simulated, nodes):
    job, sim, single = simulated
    got, codes = run_group(tmp_path, job, sim, nodes)
    assert codes == [0] * len(nodes)
    assert_shards_equal(job, got, single)
    assert_group_snapshot(tmp_path, job, sim, len(nodes), single)
    report = json.loads((tmp_path / "node0" / "replay.json").read_text())["group"]
    assert report["world_size"] == len(nodes) and (report["sent_bytes"] > 0) == (len(nodes) > 1)


def starve(sim: Path, job, ordinal: int) -> None:
    """Mirror loss of one iteration on the stream of both directions, every other allgather
    frame of each bucket: the egress and ingress streams alone never hold a whole bucket (each
    sees one ring link), and now neither does it."""
    path = sim / "streams" / "m-both.pcap"
    doomed = set()
    for b in range(len(job_buckets(job))):
        doomed |= {f for k, f in enumerate(allgather_frames(path, job, ordinal, b)) if k % 2 == 1}
    batch = read_pcap(path)
    keep = np.asarray([i for i in range(len(batch.offsets)) if i not in doomed], np.int64)
    with PcapWriter(path) as w:
        w.write_batch(FrameBatch(batch.data, batch.offsets[keep], batch.caplens[keep], batch.wirelens[keep],
                                 batch.ts_ns[keep], batch.linktype))


@pytest.mark.slow
def test_only_the_group_completes_the_buckets(tmp_path, simulated):
    job, sim, single = simulated
    lossy = copy_sim(sim, tmp_path / "sim", job)
    starve(lossy, job, ordinal=1)
    buckets = len(job_buckets(job))
    for m in job.mirrors:          # no node of one stream could complete any bucket of iteration 2 alone
        _, alone = run_replay(job, {m.name: lossy / "streams" / f"{m.name}.pcap"}, tmp_path / f"alone-{m.name}",
                              start_of(lossy), batch_frames=512, digests=False)
        (lost,) = [line for line in alone.lines if line["iteration"] == 2]
        assert not lost["recovered"] and sorted(lost["missing_blocks"]) == list(range(buckets)), lost
    got, codes = run_group(tmp_path, job, lossy, [["m-egress"], ["m-ingress"], ["m-both"]])
    assert codes == [0, 0, 0]
    assert_shards_equal(job, got, single)
    for _, lines, _ in got.values():
        assert all(c < 1 for c in lines[1]["coverage"].values()), lines[1]


def copy_sim(sim: Path, into: Path, job) -> Path:
    (into / "streams").mkdir(parents=True)
    (into / "truth").mkdir()
    for m in job.mirrors:
        (into / "streams" / f"{m.name}.pcap").write_bytes((sim / "streams" / f"{m.name}.pcap").read_bytes())
    (into / "truth" / "start.pt").write_bytes((sim / "truth" / "start.pt").read_bytes())
    return into


def quiet_tail(path: Path, after_ns: int) -> None:
    """Append to the capture one frame no parser takes (ARP), ``after_ns`` after its last frame:
    the capture's clock runs on past the last iteration, as a live capture's does in a pause."""
    batch = read_pcap(path)
    end = int(batch.offsets[-1] + batch.caplens[-1])
    arp = bytes(6) + bytes.fromhex("020000000001") + b"\x08\x06" + bytes(46)
    data = np.concatenate([np.asarray(batch.data[:end]), np.frombuffer(arp, np.uint8)])
    with PcapWriter(path) as w:
        w.write_batch(FrameBatch(data, np.append(batch.offsets, end).astype(np.int64),
                                 np.append(batch.caplens, len(arp)).astype(np.int32),
                                 np.append(batch.wirelens, len(arp)).astype(np.int32),
                                 np.append(batch.ts_ns, batch.ts_ns[-1] + after_ns).astype(np.int64),
                                 batch.linktype))


@pytest.mark.slow
def test_the_last_iteration_is_merged_once_settled(tmp_path, simulated):
    """The capture's last iteration, which no node's stream completes alone, is merged as soon
    as the nodes' streams have been quiet for the iteration gap: before the end of input (which
    makes every iteration due), with no following iteration to reach its deadline."""
    job, sim, single = simulated
    lossy = copy_sim(sim, tmp_path / "sim", job)
    starve(lossy, job, ordinal=ITERATIONS - 1)
    buckets = len(job_buckets(job))
    for m in job.mirrors:          # no node of one stream could complete any bucket of the last iteration alone
        _, alone = run_replay(job, {m.name: lossy / "streams" / f"{m.name}.pcap"}, tmp_path / f"alone-{m.name}",
                              start_of(lossy), batch_frames=512, digests=False)
        (lost,) = [line for line in alone.lines if line["iteration"] == ITERATIONS]
        assert not lost["recovered"] and sorted(lost["missing_blocks"]) == list(range(buckets)), lost
    for m in job.mirrors:
        quiet_tail(lossy / "streams" / f"{m.name}.pcap", 2 * job.appliance.iteration_gap_ns)
    got, codes = run_group(tmp_path, job, lossy, [["m-egress"], ["m-ingress"], ["m-both"]])
    assert codes == [0, 0, 0]
    assert_shards_equal(job, got, single)
    assert_group_snapshot(tmp_path, job, lossy, 3, single)
    for rank, (_, lines, _) in got.items():
        assert all(c < 1 for c in lines[-1]["coverage"].values()), lines[-1]
        before = json.loads((tmp_path / f"node{rank}" / "before-close.json").read_text())
        assert before == list(range(1, ITERATIONS + 1)), (rank, before)


@pytest.mark.slow
def test_a_node_killed_mid_iteration_is_named_by_the_survivors(tmp_path, simulated):
    job, sim, _ = simulated
    shards = Shards.balanced([b.numel for b in job_buckets(job)], 3)
    victim = shards.owner[0]
    got, codes = run_group(tmp_path, job, sim, [["m-egress"], ["m-ingress"], ["m-both"]], die=(victim, 2))
    assert codes[victim] == 3 and all(c == 0 for r, c in enumerate(codes) if r != victim)
    for rank, (_, lines, stale) in got.items():
        assert stale and [line["recovered"] for line in lines] == [True, False], (rank, lines)
        assert list(lines[1]["lost_peers"]) == [str(victim)]
        events = [json.loads(x) for x in (tmp_path / f"node{rank}" / "events.jsonl").read_text().splitlines()]
        gone = [e for e in events if e["event"] == "group.peer_gone"]
        fallback = [e for e in events if e["event"] == "fallback"]
        assert [e["iteration"] for e in gone] == [2] and list(gone[0]["peers"]) == [str(victim)]
        assert [e["iteration"] for e in fallback] == [2] and f"node rank {victim} is gone" in fallback[0]["reason"]


@pytest.mark.slow
def test_a_node_that_owns_no_bucket_keeps_in_step(tmp_path):
    """One bucket, two nodes: node 1 steps nothing, yet takes part in every round (its clip
    norms, none, included), and the group equals the single appliance."""
    job = clipped_job(make_job())
    assert Shards.balanced([b.numel for b in job_buckets(job)], 2).buckets_of(1) == []
    simulate(tmp_path / "sim", job, iterations=ITERATIONS, faults=FAULTS)
    _, single = run_replay(job, streams_of(tmp_path / "sim", job), tmp_path / "single", start_of(tmp_path / "sim"),
                           batch_frames=512)
    got, codes = run_group(tmp_path, job, tmp_path / "sim", [["m-egress", "m-both"], ["m-ingress"]])
    assert codes == [0, 0]
    assert_shards_equal(job, got, single.replica)
    assert_group_snapshot(tmp_path, job, tmp_path / "sim", 2, single.replica)
