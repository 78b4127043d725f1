"""The pipeline's gradient arrays are made once, at start-up, and reused: one per iteration for
all the streams (``parser/shared_gradient.py``), two in all; after that no new one is made
while the merger keeps up, so no page of fresh memory is first written on the per-iteration
path, and memory does not grow with the number of streams (issue 12). With the sink on its
update thread, and slower than the parsers, they wait for its arrays rather than make more
(``gradtap/update_thread.py``). Reused arrays are not cleared. The merged gradients are
checked against the simulator's truth (each iteration's reduced gradient,
``truth/iter_N/grad.npy``), so reuse never leaks one iteration's bytes into the next."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.core.memory import CACHE_LINE
from gradtap.pipeline import Pipeline
from gradtap.simulator.truth import iteration_dir
from gradtap.wire import events as ev
from gradtap.workload.layout import job_plan
from tests.simulator.test_simulate import make_job, simulate

ITERATIONS = 6
ROUNDS = 48


class Collect:
    """A sink that keeps a copy of every bucket it is handed, and the bucket itself until its
    iteration is done, when it must be unchanged (the merger's contract: ``Sink``)."""

    def __init__(self):
        self.buckets: dict[int, dict[int, bytes]] = {}
        self.done: list[int] = []
        self._handed: list[tuple[int, np.ndarray]] = []

    def bucket(self, iteration, bucket, data):
        self.buckets.setdefault(iteration, {})[bucket] = bytes(data)
        self._handed.append((bucket, data))

    def iteration_done(self, iteration, report):
        assert report.recovered, report
        for bucket, data in self._handed:
            assert bytes(data) == self.buckets[iteration][bucket], \
                f"iteration {iteration} bucket {bucket} changed before its iteration was done"
        self._handed.clear()
        self.done.append(iteration)


class SlowCollect(Collect):
    """:class:`Collect`, a fifth of a second late with every iteration: the parsers catch up."""

    def iteration_done(self, iteration, report):
        time.sleep(0.2)
        super().iteration_done(iteration, report)


def rounds(batches: dict[str, FrameBatch], n: int):
    """Every stream's frames cut into ``n`` rounds on one time grid, as the replay reads them."""
    ts = np.concatenate([b.ts_ns for b in batches.values()])
    edges = np.quantile(ts, np.linspace(0, 1, n + 1)).astype(np.int64)
    edges[-1] += 1
    for lo, hi in zip(edges[:-1], edges[1:]):
        out = {}
        for name, b in batches.items():
            k = np.flatnonzero((b.ts_ns >= lo) & (b.ts_ns < hi))
            out[name] = FrameBatch(b.data, b.offsets[k], b.caplens[k], b.wirelens[k], b.ts_ns[k], b.linktype)
        yield out


@pytest.mark.parametrize("overlap", [False, True], ids=["sink-between-rounds", "sink-on-update-thread"])
@pytest.mark.parametrize("protocol", ["Simple", "LL"])
def test_gradient_arrays_are_made_once_and_reused(tmp_path, protocol, overlap):
    job = make_job(3, protocol, 2, "fp32")
    simulate(tmp_path, job, iterations=ITERATIONS)
    plan = job_plan(job)
    sink = SlowCollect() if overlap else Collect()
    names = [m.name for m in job.mirrors]
    pipeline = Pipeline(job, plan, names, sink, first_iteration=1, overlap=overlap)
    assert (pipeline.update is not None) == overlap
    pool = pipeline.pool
    made = {id(g.grad) for g in pool._spare}
    assert len(made) == 2, "one gradient for the iteration in the window, and one spare, for every stream together"
    for g in pool._spare:
        assert g.grad.ctypes.data % CACHE_LINE == 0 and not g.grad.any(), "a start-up array: not zeroed, not aligned"
    assert all(len(p.slots.grads[0]) == 0 for p in pipeline.parsers.values()), "a stream not locked holds a gradient"
    batches = {name: read_pcap(tmp_path / "streams" / f"{name}.pcap") for name in names}
    try:
        for r in rounds(batches, ROUNDS):
            pipeline.round(r)
            assert pool.fresh == 0, "a gradient array was made after start-up"
            held: dict[int, set[int]] = {}
            for name, p in pipeline.parsers.items():
                assert p.counters[ev.DATA_SET_ASIDE] == p.counters[ev.DATA_ASIDE_FULL] == 0, name
                if p.locked:
                    assert {id(a) for a in p.slots.grads} <= made, f"{name}: a slot holds an array not made at start"
                    for it in p.in_progress():
                        held.setdefault(it.index, set()).add(id(it.grad))
            assert all(len(ids) == 1 for ids in held.values()), f"streams hold different arrays of one iteration {held}"
        pipeline.finish()
    finally:
        pipeline.close()
    assert sink.done == list(range(1, ITERATIONS + 1))
    for it in sink.done:
        truth = np.load(iteration_dir(tmp_path / "truth", it) / "grad.npy").view(np.uint8)
        merged = b"".join(sink.buckets[it][b] for b in range(len(plan.bucket_numels)))
        assert merged == truth.tobytes(), f"iteration {it} differs from the truth"
