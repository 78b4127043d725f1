"""A mirror group's nodes, as separate processes on gloo, merge as one merger holding every stream.

Synthetic streams (the gradient of each iteration, with holes and one lying stream) are split
over 1, 2 or 3 node processes; the buckets the owners hand on and every node's reports must
equal what the local :class:`Merger` makes of all the streams, byte for byte. A node that
dies mid-iteration leaves the others reporting it, not hanging.
"""

from __future__ import annotations

import hashlib
import os
import queue

import numpy as np
import pytest

from gradtap.merger.digest import digest_key, new_secret
from gradtap.merger.group import Coverage, fetch_mask
from gradtap.merger.merger import Merger
from gradtap.merger.union import BucketBlocks, union
from gradtap.parser.stream import AssembledIteration
from gradtap.workload.layout import job_plan
from gradtap.workload.shards import Shards
from gradtap.workload.spec import parse_job
from tests.forked import fork_server
from tests.simulator.test_simulate import make_job

STREAMS = ["a", "b", "c"]
ITERATIONS = 3
SETTLE_NS = 400                       # the iteration gap: less than the scenario's 500 ns between iterations
NODE_TIMEOUT_S = 120


def group_job(**kwargs):
    """``make_job``'s job with a deeper model in 2 KiB buckets: three buckets, one per node of a
    three-node group (``Shards.balanced``)."""
    doc = make_job(**kwargs).model_dump(mode="json", exclude_none=True)
    doc["ddp"]["bucket_cap_mb"] = 0.002
    doc["model"]["kwargs"]["sizes"] = [64, 96, 64, 10]
    return parse_job(doc)


def scenario(plan, group_only: bool):
    """Per stream, its retired copy of each iteration. Each stream misses some blocks; in
    iteration 1 stream b lies about one block that a and c hold right. ``group_only``: every
    stream misses a different block of every bucket, so no stream alone completes one."""
    rng = np.random.default_rng(7)
    need = plan.blocks["need"].astype(np.int32)
    elem = plan.elem_size
    out = {s: [] for s in STREAMS}
    for k in range(ITERATIONS):
        truth = rng.integers(0, 256, plan.total_elems * elem, dtype=np.uint8)
        holes = {s: rng.random(len(need)) < 0.05 for s in STREAMS}
        if group_only:
            for b in range(len(plan.bucket_numels)):
                mine = np.flatnonzero(plan.blocks["bucket"] == b)
                for i, s in enumerate(STREAMS):
                    holes[s][mine[i % len(mine)]] = True
        for j in range(len(need)):        # every block kept by some stream
            if all(holes[s][j] for s in STREAMS):
                holes[STREAMS[j % 3]][j] = False
        for s in STREAMS:
            grad = truth.copy()
            got = np.where(holes[s], 0, need).astype(np.int32)
            if k == 1 and s == "b":
                j = int(np.flatnonzero(~holes["a"] & ~holes["b"] & ~holes["c"])[3])
                grad[plan.blocks["elem"][j] * elem] ^= 0xFF
            out[s].append(AssembledIteration(s, k, 1000 * k, grad, got, need.copy(), 1000 * k + 500))
    return out


class Recorder:
    def __init__(self, die_at: int | None = None):
        self.buckets: list[tuple[int, int, str]] = []
        self.done: list[dict] = []
        self.die_at = die_at

    def bucket(self, iteration, bucket, data):
        if iteration == self.die_at and bucket == 0:
            os._exit(3)                   # killed mid-iteration, after its first bucket
        self.buckets.append((iteration, bucket, hashlib.sha256(data.tobytes()).hexdigest()))

    def iteration_done(self, iteration, report):
        self.done.append({"iteration": iteration, "recovered": report.recovered,
                          "missing": report.missing_blocks, "coverage": report.coverage,
                          "mismatches": [(m.block, m.groups, m.resolved, m.distrusted) for m in report.mismatches],
                          "lost": sorted(report.lost_peers)})


def node(rank, world, rendezvous, streams, group_only, die_at, out, quiet_ns=None):
    """One appliance of the group: merge its streams, put what it handed and reported on ``out``,
    and the iterations it finished before :meth:`close` (the end of input). ``quiet_ns``: the
    last iteration is still in flight on every stream (not retired), and the capture's clock
    is ``quiet_ns`` past its last frame (the merger settles after ``SETTLE_NS``)."""
    from gradtap.merger.group import GroupMerger
    from gradtap.merger.group_link import GroupLink
    from gradtap.workload.spec import MirrorGroupSpec

    plan = job_plan(group_job())
    data = scenario(plan, group_only)
    sink = Recorder(die_at)
    link = GroupLink(MirrorGroupSpec(rank=rank, world_size=world, rendezvous=rendezvous, timeout_s=30))
    merger = GroupMerger(plan, streams, sink, link, Shards.balanced(plan.bucket_numels, world), STREAMS,
                         first_iteration=10, settle_ns=SETTLE_NS)
    if quiet_ns is None:
        for s in streams:
            merger.update(s, data[s], [])
        merger.advance()
    else:
        last = data[streams[0]][-1]
        for s in streams:
            a = data[s][-1]
            merger.heard(a.index, a.end_ns)
            merger.update(s, data[s][:-1], [a])
        merger.advance(last.end_ns + quiet_ns)
    before = [r.iteration for r in merger.finished]
    merger.close()
    link.close()
    out.put((rank, sink.buckets, sink.done, link.sent_bytes, before))


def run_group(tmp_path, nodes: list[list[str]], group_only=False, die=None, quiet_ns=None):
    """Run one process per node; returns rank -> (buckets, reports, bytes sent, iterations finished
    before the end of input), and each exit code."""
    ctx = fork_server()
    out = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=node, args=(r, len(nodes), rendezvous, s, group_only,
                                            die[1] if die and die[0] == r else None, out, quiet_ns), daemon=True)
             for r, s in enumerate(nodes)]
    try:
        for p in procs:
            p.start()
        results = {}
        alive = len(nodes) - (1 if die else 0)
        while len(results) < alive:
            try:
                rank, *got = out.get(timeout=NODE_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"mirror group nodes hung: {alive - len(results)} of {alive} did not finish")
            results[rank] = tuple(got)
        for p in procs:
            p.join(NODE_TIMEOUT_S)
        return results, [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def single(group_only=False):
    plan = job_plan(group_job())
    data = scenario(plan, group_only)
    sink = Recorder()
    merger = Merger(plan, STREAMS, sink, first_iteration=10)
    for s in STREAMS:
        merger.update(s, data[s], [])
    merger.advance()
    merger.close()
    return plan, sink


@pytest.mark.parametrize("nodes", [[["a"], ["b"], ["c"]], [["a", "c"], ["b"]], [["a", "b", "c"]]],
                         ids=["3-nodes", "2-nodes-uneven", "1-node"])
def test_the_group_merges_as_one_merger_with_every_stream(tmp_path, nodes):
    plan, want = single()
    results, codes = run_group(tmp_path, nodes)
    assert codes == [0] * len(nodes)
    shards = Shards.balanced(plan.bucket_numels, len(nodes))
    handed = sorted(x for buckets, *_ in results.values() for x in buckets)
    assert handed == sorted(want.buckets)
    for rank, (buckets, done, *_) in results.items():
        assert all(shards.owner[b] == rank for _, b, _ in buckets)
        assert done == want.done, rank
    assert any(d["mismatches"] for d in want.done)     # the lying stream was outvoted across nodes


def test_only_the_group_completes_a_bucket(tmp_path):
    plan, want = single(group_only=True)
    for s in STREAMS:      # no stream, so no node of one stream, completes any bucket alone
        for it in scenario(plan, True)[s]:
            for b in range(len(plan.bucket_numels)):
                assert not it.covered[plan.blocks["bucket"] == b].all()
    assert [d["recovered"] for d in want.done] == [True] * ITERATIONS
    results, codes = run_group(tmp_path, [["a"], ["b"], ["c"]], group_only=True)
    assert codes == [0, 0, 0]
    assert sorted(x for buckets, *_ in results.values() for x in buckets) == sorted(want.buckets)
    assert all(done == want.done for _, done, *_ in results.values())


@pytest.mark.parametrize("quiet", [True, False], ids=["settled", "not-settled"])
def test_a_node_joins_the_rounds_once_its_streams_settle(tmp_path, quiet):
    """The last iteration, which no node's stream completes alone and no iteration follows, is
    merged by the group once each node's streams have been quiet for the settle time (the local
    merger's rule), before the end of input; a node whose streams have not settled yet waits."""
    plan, want = single(group_only=True)
    results, codes = run_group(tmp_path, [["a"], ["b"], ["c"]], group_only=True,
                               quiet_ns=SETTLE_NS if quiet else SETTLE_NS - 1)
    assert codes == [0, 0, 0]
    assert sorted(x for buckets, *_ in results.values() for x in buckets) == sorted(want.buckets)
    for _, done, _, before in results.values():
        assert done == want.done
        assert before == ([10, 11, 12] if quiet else [10, 11])


def test_a_node_killed_mid_iteration_is_reported_by_the_survivors(tmp_path):
    plan = job_plan(group_job())
    shards = Shards.balanced(plan.bucket_numels, 3)
    victim = shards.owner[0]
    results, codes = run_group(tmp_path, [["a"], ["b"], ["c"]], die=(victim, 11))
    assert codes[victim] == 3 and [c for r, c in enumerate(codes) if r != victim] == [0, 0]
    for rank, (buckets, done, *_) in results.items():
        assert [d["iteration"] for d in done] == [10, 11]
        assert done[0]["recovered"] and not done[1]["recovered"]
        assert done[1]["lost"] == [victim], rank
        assert all(i == 10 for i, _, _ in buckets)     # nothing of iteration 11 handed on


def test_fetch_mask_takes_only_missing_and_disputed_copies():
    k = 4
    cov = np.array([[1, 0, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1]], bool)
    digests = np.zeros((3, k, 16), np.uint8)
    digests[2, 3, 0] = 1                                  # stream 2 disagrees on block 3
    fetch = fetch_mask(cov, digests, np.array([True, False, False]))
    # block 0: the owner has it; 1: missing at the owner, covered by streams 1 and 2, whose turn
    # is 1 mod 2: stream 2; 2: owner has it; 3: disputed, every remote copy.
    assert fetch.tolist() == [[False] * 4, [False, False, False, True], [False, True, False, True]]
    # blocks the owner lacks, each covered by both others: taken from them in turn
    cov = np.array([[0] * 6, [1] * 6, [1] * 6], bool)
    fetch = fetch_mask(cov, np.zeros((3, 6, 16), np.uint8), np.array([True, False, False]))
    assert fetch.tolist() == [[False] * 6, [True, False] * 3, [False, True] * 3]


def test_coverage_messages_round_trip_and_malformed_ones_are_refused():
    sizes = np.array([8, 8, 4], np.int64)
    blocks = BucketBlocks(np.arange(3), np.array([0, 8, 16]), sizes)
    data = np.arange(20, dtype=np.uint8)
    cov = Coverage.of(blocks, [("a", data, np.array([True, False, True]))], digest_key(new_secret()))
    it, b, back = Coverage.decode(cov.encode(5, 1), 3, rank=1)
    assert (it, b, back.streams) == (5, 1, ["a"])
    assert (back.covered == cov.covered).all() and (back.digests == cov.digests).all()
    from gradtap.merger.group import GroupDesync
    with pytest.raises(GroupDesync, match="rank 2"):
        Coverage.decode(cov.encode(5, 1)[:-3], 3, rank=2)
    assert union(blocks, [("a", data, np.array([True, True, True]))], 20).complete


def test_a_node_capturing_other_streams_than_its_spec_lists_is_refused():
    from gradtap.core.errors import ConfigError
    from gradtap.merger.group import GroupMerger
    from gradtap.merger.group_link import GroupLink
    from gradtap.workload.spec import MirrorGroupSpec

    plan = job_plan(group_job())
    link = GroupLink(MirrorGroupSpec(rank=0, world_size=1, rendezvous="file:///tmp/unused"))
    shards = Shards((0,) * len(plan.bucket_numels), 1, (("a",),))
    with pytest.raises(ConfigError, match=r"captures \['b'\], but mirror_group.streams\[0\] lists \['a'\]"):
        GroupMerger(plan, ["b"], Recorder(), link, shards, STREAMS)
