"""The updater on a thread of its own (``gradtap/update_thread.py``): calls made in order,
under the lock, failures raised by the round thread and never past, releases that always
run; and a replay whose sink steps the replica beside the parsers gives the replica it
gives between rounds, the trainer's."""

from __future__ import annotations

import os
import threading
import time

import numba
import numpy as np
import pytest

import gradtap.pipeline
from gradtap.core.errors import ConfigError, GradtapError
from gradtap.parser.shared_gradient import GradientPool
from gradtap.pipeline import Cores, Pipeline
from gradtap.replay import run_replay
from gradtap.simulator.truth import iteration_dir
from gradtap.update_thread import UpdateThread
from gradtap.verify import verify
from gradtap.workload.layout import job_params, job_plan
from tests.gradtap.test_buffers import Collect
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate


class Record:
    """A sink that notes each call, the thread it came on and whether the lock was held."""

    def __init__(self, lock: threading.Lock, fail_at: int | None = None):
        self.lock, self.fail_at = lock, fail_at
        self.calls: list[tuple] = []

    def bucket(self, iteration, bucket, data):
        self._note("bucket", iteration, bucket)
        if bucket == self.fail_at:
            raise GradtapError(f"bucket {bucket} refused")

    def iteration_done(self, iteration, report):
        self._note("done", iteration)

    def _note(self, *call):
        time.sleep(0.001)     # the caller goes on meanwhile
        self.calls.append((*call, threading.current_thread().name, self.lock.locked()))


def test_calls_are_made_in_order_on_their_own_thread_under_the_lock():
    lock = threading.Lock()
    sink = Record(lock)
    update = UpdateThread(sink, lock)
    try:
        for it in range(3):
            for b in range(4):
                update.bucket(it, b, np.zeros(1))
            update.iteration_done(it, None)
        update.call(sink._note, "anchor")
        update.drain()
    finally:
        update.close()
    want = [c for it in range(3) for c in [("bucket", it, b) for b in range(4)] + [("done", it)]] + [("anchor",)]
    assert [c[:-2] for c in sink.calls] == want
    assert {c[-2:] for c in sink.calls} == {("gradtap-update", True)}
    assert update.queued == update.made == len(want)


def test_a_failed_call_stops_the_sink_but_not_the_releases():
    lock = threading.Lock()
    sink = Record(lock, fail_at=1)
    released = []
    update = UpdateThread(sink, lock)
    try:
        for b in range(3):
            update.bucket(0, b, np.zeros(1))
        update.release(released.append, "gradient 0")
        update.iteration_done(0, None)
        with pytest.raises(GradtapError, match="bucket 1 refused"):
            update.drain()
        with pytest.raises(GradtapError, match="bucket 1 refused"):
            update.check()      # every later round says so too
    finally:
        update.close()
    assert [c[:3] for c in sink.calls] == [("bucket", 0, 0), ("bucket", 0, 1)], "a call was made past the failure"
    assert released == ["gradient 0"], "a release was dropped with the failed sink's calls: a parser would wait"


def test_close_makes_what_is_queued_then_refuses_more():
    lock = threading.Lock()
    sink = Record(lock)
    update = UpdateThread(sink, lock)
    for b in range(5):
        update.bucket(0, b, np.zeros(1))
    update.close()
    assert len(sink.calls) == 5
    with pytest.raises(GradtapError, match="closed"):
        update.bucket(0, 5, np.zeros(1))


def test_an_update_thread_runs_on_the_cores_it_is_given():
    lock, last = threading.Lock(), max(os.sched_getaffinity(0))
    seen = []
    update = UpdateThread(Record(lock), lock, frozenset({last}))
    try:
        update.call(lambda: seen.append((os.sched_getaffinity(0), numba.get_num_threads())))
        update.drain()
    finally:
        update.close()
    assert seen == [({last}, 1)], "not on its core, or its kernels would start threads for cores it has not"
    foreign = frozenset({max(os.sched_getaffinity(0)) + 1})
    with pytest.raises(ConfigError, match=rf"update cores \[{max(foreign)}\]: .*give cores this process may run on"):
        UpdateThread(Record(lock), lock, foreign)


def test_an_update_thread_is_started_only_where_the_parsers_leave_it_a_core():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"this process may run on one core ({cores}): every case but one needs two")
    job = make_job(3, "Simple", 2, "fp32")
    plan, names = job_plan(job), [m.name for m in job.mirrors]
    one, rest, every = frozenset(cores[:1]), frozenset(cores[1:]), frozenset(cores)
    cases = [(names, Cores(one, rest), True),            # the parsers on one core, the updater on the others
             (names, Cores(one, one), False),            # on the same core: between rounds
             (names[:1], Cores(every, every), False),    # a stream alone copies with every core it has
             (names[:1], Cores(one, frozenset()), True)]  # ... which is one here, and the updater may go anywhere
    for streams, where, beside in cases:
        pipeline = Pipeline(job, plan, streams, Collect(), cores=where)
        try:
            assert (pipeline.update is not None) == beside, (len(streams), where)
        finally:
            pipeline.close()


def test_a_parser_short_of_a_buffer_waits_for_the_one_the_updater_returns():
    pool = GradientPool(64, 1, 1)
    first = pool.enter(0)
    pool.leave(first)
    pool.returning(first)
    got = []
    parser = threading.Thread(target=lambda: got.append(pool.enter(1)))
    parser.start()
    parser.join(0.2)
    assert parser.is_alive() and not got, "the parser did not wait for the returning buffer"
    pool.done(first, 0)
    parser.join(5)
    assert got == [first] and pool.fresh == 0


def test_a_buffer_not_returning_is_not_waited_for():
    pool = GradientPool(64, 1, 1)
    pool.enter(0)                   # held by a parser's window: made afresh for the next
    assert pool.enter(1) is not None and pool.fresh == 1


@pytest.mark.slow
def test_a_replica_stepped_beside_the_parsers_is_the_one_stepped_between_rounds(tmp_path, monkeypatch):
    """Both ways on any host (which one the pipeline takes depends on the host's cores): a
    clipped AdamW job, whose whole step follows each iteration's last bucket; each replica
    against the trainer's state, tensor by tensor."""
    job = make_job(3, "Simple", 2, "fp32", nqps=2, mtu=1024)
    job = job.model_copy(update={"optimizer": job.optimizer.model_copy(update={"kind": "adamw",
                                                                                "clip_grad_norm": 1.0})})
    simulate(tmp_path / "sim", job, iterations=3)
    truth = tmp_path / "sim" / "truth"
    for overlap in (False, True):
        monkeypatch.setattr(gradtap.pipeline, "overlapping", lambda threads, cores=None, on=overlap: on)
        out = tmp_path / f"overlap-{overlap}"
        _, sink = run_replay(job, streams_of(tmp_path / "sim", job), out, start_of(tmp_path / "sim"),
                             batch_frames=64)
        v = verify(out, truth, job_params(job))
        assert v.ok and v.digests_checked == [1, 2, 3], (overlap, v)
        state = sink.replica.state_dict()
        with np.load(iteration_dir(truth, 3) / "state.npz") as trainer:
            for i, p in enumerate(job_params(job)):
                assert state["model"][p.name].numpy().tobytes() == trainer[f"param/{p.name}"].tobytes(), p.name
                assert (state["optimizer"]["state"][i]["exp_avg_sq"].numpy().tobytes()
                        == trainer[f"exp_avg_sq/{p.name}"].tobytes()), p.name
