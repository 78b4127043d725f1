"""The merger hands iterations on numbered by the trainer's iteration, from ``first_iteration``."""

from pathlib import Path

import numpy as np

from gradtap.merger.merger import PROBES, Merger
from gradtap.parser.stream import AssembledIteration
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import load_job
from tests.simulator.test_simulate import make_job


class Recorder:
    def __init__(self):
        self.buckets: list[tuple[int, int]] = []
        self.done: list[tuple[int, int, bool]] = []       # sink's iteration, report's iteration, recovered

    def bucket(self, iteration, bucket, data):
        self.buckets.append((iteration, bucket))

    def iteration_done(self, iteration, report):
        self.done.append((iteration, report.iteration, report.recovered))


def retired(plan, stream, ordinal, complete=True):
    need = plan.blocks["need"].astype(np.int32)
    got = need.copy() if complete else np.zeros_like(need)
    grad = np.zeros(plan.grad_bytes, np.uint8)
    return AssembledIteration(stream, ordinal, 1000 * ordinal, grad, got, need)


def merged(first_iteration=None, holes=()):
    plan = job_plan(make_job())
    sink = Recorder()
    kwargs = {} if first_iteration is None else {"first_iteration": first_iteration}
    merger = Merger(plan, ["a"], sink, **kwargs)
    merger.update("a", [retired(plan, "a", k, complete=k not in holes) for k in range(3)], [])
    merger.advance()
    reports = merger.close()
    return plan, sink, reports


def test_iterations_are_numbered_from_the_first_iteration():
    plan, sink, reports = merged(first_iteration=5)
    n = len(plan.bucket_numels)
    assert sink.done == [(5, 5, True), (6, 6, True), (7, 7, True)]
    assert sink.buckets == [(i, b) for i in (5, 6, 7) for b in range(n)]
    assert [r.iteration for r in reports] == [5, 6, 7]


def test_without_a_first_iteration_the_ordinal_is_the_iteration():
    _, sink, _ = merged()
    assert [d[0] for d in sink.done] == [0, 1, 2]


def test_an_unrecoverable_iteration_is_reported_by_its_trainer_iteration():
    _, sink, reports = merged(first_iteration=10, holes=(1,))
    assert sink.done == [(10, 10, True), (11, 11, False), (12, 12, True)]
    assert 11 not in {i for i, _ in sink.buckets}
    assert reports[1].missing_blocks


def test_a_bucket_is_handed_exactly_when_the_streams_cover_it_whatever_blocks_they_miss():
    """The merger first looks at a few blocks of each bucket (``Merger._incomplete``); a bucket
    is still handed in the round its last block is covered by any stream, and never before:
    one block that no stream holds, anywhere in the bucket, probed or not, holds it back."""
    plan = job_plan(load_job(Path(__file__).parents[2] / "configs" / "small.yaml"))
    need = plan.blocks["need"].astype(np.int32)
    rng = np.random.default_rng(5)
    grad = np.zeros(plan.grad_bytes, np.uint8)
    for trial in range(40):
        merger = Merger(plan, ["a", "b", "c"], sink := Recorder(), first_iteration=0)
        assert min(len(bb.index) for bb in merger.buckets) > 4 * PROBES, "every bucket is probed, not read whole"
        missing = np.zeros(len(need), bool)
        missing[rng.choice(len(need), size=rng.integers(0, 4), replace=False)] = True
        owner = rng.integers(0, 3, len(need))            # the stream sure to hold each block
        for s, name in enumerate("abc"):
            got = np.where(((owner == s) | (rng.random(len(need)) < 0.3)) & ~missing, need, 0).astype(np.int32)
            merger.update(name, [], [AssembledIteration(name, 0, 0, grad, got, need)])
        merger.advance()
        whole = [b for b, bb in enumerate(merger.buckets) if not missing[bb.index].any()]
        assert sorted(b for _, b in sink.buckets) == whole, (trial, np.flatnonzero(missing))


class Keeper:
    """A sink that keeps every bucket it is handed, as the replica does until the step ends."""

    def __init__(self):
        self.data: dict[tuple[int, int], np.ndarray] = {}

    def bucket(self, iteration, bucket, data):
        self.data[(iteration, bucket)] = data

    def iteration_done(self, iteration, report):
        assert report.recovered


def halves(plan, ordinal):
    """Two streams of their own buffers covering alternate blocks: every bucket is assembled."""
    need = plan.blocks["need"].astype(np.int32)
    mine = np.arange(len(need)) % 2 == 0
    return [AssembledIteration(s, ordinal, 1000 * ordinal, np.full(plan.grad_bytes, 2 * ordinal + k, np.uint8),
                               np.where(mine if k else ~mine, need, 0), need) for k, s in enumerate("ab")]


def test_a_bucket_assembled_for_an_iteration_stays_as_handed_until_its_arena_is_given_back():
    plan = job_plan(make_job())
    sink = Keeper()
    merger = Merger(plan, ["a", "b"], sink)

    def run(ordinal):
        for a in halves(plan, ordinal):
            merger.update(a.stream, [a], [])
        merger.advance()
        return {b: sink.data[(ordinal, b)] for b in range(len(plan.bucket_numels))}

    first = run(0)
    kept = {b: d.copy() for b, d in first.items()}
    second = run(1)                                 # iteration 0's arena is not given back
    for b, d in first.items():
        assert np.array_equal(d, kept[b]) and not np.shares_memory(d, second[b])
        blocks = merger.buckets[b]
        for j, at, n in zip(blocks.index, blocks.start, blocks.nbytes):
            assert (d[at:at + n] == (1 if j % 2 == 0 else 0)).all()
            assert (second[b][at:at + n] == (3 if j % 2 == 0 else 2)).all()
    for arena in merger.arenas.finished():          # as the pipeline does once the sink is done
        merger.arenas.give_back(arena)
    third = run(2)
    assert merger.arenas.made == 2
    assert all(np.shares_memory(third[b], first[b]) or np.shares_memory(third[b], second[b]) for b in third)
