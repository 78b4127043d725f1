"""Which captured iteration is which: a live appliance learns it from the trainer's checkpoint
time, or waits, stale, until the trainer offers one (``gradtap/start.py``, ``merger/numbering.py``).

The streams are the simulator's; the trainer's checkpoint of a later iteration is built
from its ground truth (the state after the iteration before), with the simulated time at
which it was the trainer's state (``truth/manifest.json``'s span of that iteration).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from gradtap.appliance import Appliance, RunOptions
from gradtap.capture.worker import SourceSpec
from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.metrics import ApplianceCollector
from gradtap.merger.numbering import Anchor, AnchorRefused, StreamStarts, anchor_ordinal
from gradtap.replay import replay
from gradtap.replica_sink import ReplicaSink
from gradtap.simulator.truth import iteration_dir
from gradtap.start import Numbering, replica_start
from gradtap.tables import status_table
from gradtap.updater.replica import Replica
from gradtap.verify import verify
from gradtap.workload.layout import job_params, job_plan
from tests.simulator.test_simulate import make_job, simulate

PAUSE = 1_000_000


# -- where an anchor falls ------------------------------------------------------------------

def starts(capture_ns, **ordinals):
    return StreamStarts(capture_ns, {int(k[1:]): v for k, v in ordinals.items()})


def test_an_anchor_is_the_first_iteration_to_begin_after_its_time():
    a = Anchor(7, 150, "test")
    assert anchor_ordinal(a, {"s": starts(0, o0=100, o1=200, o2=300)}, PAUSE) == 1
    # A stream that has not seen one begin after it yet waits; one that has decides.
    assert anchor_ordinal(a, {"s": starts(0, o0=100)}, PAUSE) is None
    assert anchor_ordinal(a, {"s": starts(0, o0=100), "t": starts(0, o0=100, o1=210)}, PAUSE) == 1
    assert anchor_ordinal(a, {"s": starts(None)}, PAUSE) is None


def test_an_anchor_before_the_capture_began_is_refused_unless_within_the_pause():
    late = {"s": starts(10 * PAUSE, o0=10 * PAUSE + 5, o1=20 * PAUSE)}
    with pytest.raises(AnchorRefused, match="listens since .* more than the 1 ms pause later"):
        anchor_ordinal(Anchor(3, 5 * PAUSE, "POST /resync x"), late, PAUSE)
    # Less than the trainer's pause before the capture: no iteration can have begun unseen.
    assert anchor_ordinal(Anchor(3, 10 * PAUSE - PAUSE // 2, "x"), late, PAUSE) == 0


def test_an_anchor_older_than_the_starts_a_stream_keeps_is_refused():
    """Iterations 0..99 were counted but their starts are no longer kept: the first kept one
    that began after the time need not be the first that did."""
    kept = {"s": starts(0, o100=1000, o101=2000)}
    with pytest.raises(AnchorRefused, match="keeps no start of its iteration 99"):
        anchor_ordinal(Anchor(3, 500, "x"), kept, PAUSE)
    assert anchor_ordinal(Anchor(3, 1500, "x"), kept, PAUSE) == 101
    assert anchor_ordinal(Anchor(3, 500, "x"), {"s": starts(0, o0=600, o1=900)}, PAUSE) == 0


def test_streams_that_disagree_refuse_the_anchor():
    with pytest.raises(AnchorRefused, match="disagree"):
        anchor_ordinal(Anchor(3, 150, "x"), {"s": starts(0, o0=100, o1=200), "t": starts(0, o1=100, o2=200)}, PAUSE)


# -- the appliance --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """A 4-iteration capture (iterations 1..4, DDP's rebuilt layout) and the trainer's checkpoints."""
    root = tmp_path_factory.mktemp("numbering")
    job = make_job(3, "LL", 2, "fp32")
    simulate(root / "sim", job, iterations=4)
    truth = root / "sim" / "truth"
    start = torch.load(truth / "start.pt", weights_only=True)
    spans = json.loads((truth / "manifest.json").read_text())["span_ns"]

    def checkpoint(iteration: int, *, time_of: int | None = None) -> dict:
        """The trainer's state at ``iteration``, with the time it was (or ``time_of``'s)."""
        state = copy.deepcopy(start)
        if iteration > start["iteration"]:
            with np.load(iteration_dir(truth, iteration - 1) / "state.npz") as after:
                for i, name in enumerate(state["model"]):
                    state["model"][name] = torch.from_numpy(after[f"param/{name}"].copy())
                    moments = state["optimizer"]["state"][i]
                    for m in ("exp_avg", "exp_avg_sq"):
                        moments[m] = torch.from_numpy(after[f"{m}/{name}"].copy())
                    moments["step"] = torch.tensor(float(after["step"]))
            state["iteration"] = iteration
        return {**state, "time_ns": spans[str(time_of if time_of is not None else iteration)][0]}

    return job, root / "sim", checkpoint


def appliance(job, sim_dir, out, start):
    streams = {m.name: SourceSpec("pcap", (str(sim_dir / "streams" / f"{m.name}.pcap"),), {}) for m in job.mirrors}
    return Appliance(job, streams, out, start, RunOptions(ring_slots=4096, slot_size=4352, hugepages="off",
                                                          digests=True))


def events(out):
    """The events but the background snapshot writer's (``snapshot.skipped``/``caught_up``: files
    replay faster than any trainer trains, so which snapshots are skipped is timing)."""
    return [e for e in map(json.loads, (out / "events.jsonl").read_text().splitlines())
            if e["event"] not in ("snapshot.skipped", "snapshot.caught_up")]


def test_a_waiting_appliance_resyncs_from_the_trainers_timed_checkpoint_and_stays_exact(sim, tmp_path):
    job, sim_dir, checkpoint = sim
    app = appliance(job, sim_dir, tmp_path / "run", None)
    assert app.replica.stale
    app.offer(checkpoint(3), "POST /resync trainer.pt")
    result = app.run()
    assert result.exit_code == 0
    assert [line["iteration"] for line in app.sink.lines] == [3, 4] and app.sink.applied == [3, 4]
    assert app.pipeline.merger.skipped == 2          # iterations 1 and 2: before the trainer's checkpoint
    assert app.replica.iteration == 5 and not app.replica.stale
    v = verify(tmp_path / "run", sim_dir / "truth", job_params(job))
    assert v.ok and v.digests_checked == [3, 4] and v.before_start == [1, 2], v
    kinds = [(e["event"], e.get("iteration"), e.get("captured_iteration")) for e in events(tmp_path / "run")]
    assert kinds == [("replica.waiting", None, None), ("anchor.placed", 3, 2), ("resync", 3, None)]


def test_an_offer_is_copied_without_the_appliances_locks_and_handed_over(sim, tmp_path, monkeypatch):
    """An offer's slow part, its state copied and checked (12 bytes per parameter), runs while
    the rounds and the update thread may take their locks; only holding it takes them. (Under
    them, GPT-2 small's took 1.3-6.8 s on a 2-core AMD EPYC, and stalled both.) The checkpoint
    may be handed over: the copy then takes its tensors out of it."""
    job, sim_dir, checkpoint = sim
    app = appliance(job, sim_dir, tmp_path / "run", None)
    held, load = [], Replica._load

    def watched(self, *args, **kwargs):
        held.append((app._lock.locked(), app._replica_lock.locked()))
        return load(self, *args, **kwargs)

    monkeypatch.setattr(Replica, "_load", watched)
    kept, handed = checkpoint(3), checkpoint(4)
    app.offer(kept, "POST /resync trainer.pt")
    assert held == [(False, False)]
    assert list(app.replica.offers) == [3] and len(kept["model"]) == len(job_params(job)), "kept was consumed"
    app.offer(handed, "POST /resync trainer.pt", handed_over=True)
    assert held == [(False, False)] * 2
    assert list(app.replica.offers) == [4] and not handed["model"]
    assert all(list(e) == ["step"] for e in handed["optimizer"]["state"].values())


def test_a_waiting_appliance_that_gets_no_offer_applies_nothing(sim, tmp_path):
    job, sim_dir, _ = sim
    app = appliance(job, sim_dir, tmp_path / "run", None)
    result = app.run()
    assert result.exit_code == 0 and app.sink.applied == [] and app.replica.stale
    assert app.pipeline.merger.skipped == 4 and app.sink.lines == []
    assert [e["event"] for e in events(tmp_path / "run")] == ["replica.waiting"]
    assert not any((tmp_path / "run" / "snapshots").glob("iter_*"))
    status = app.status()
    assert not status.numbered and status.skipped == 4
    metrics = {(m.name, tuple(sorted(x.labels.items()))): x.value
               for m in ApplianceCollector(app.status).collect() for x in m.samples}
    assert metrics[("gradtap_replica_numbered", ())] == 0
    assert metrics[("gradtap_iterations", (("result", "skipped"),))] == 4
    assert "waiting for the trainer's checkpoint" in status_table(status).title


def test_before_numbering_an_offer_without_a_time_is_refused(sim, tmp_path):
    job, sim_dir, checkpoint = sim
    app = appliance(job, sim_dir, tmp_path / "run", None)
    untimed = {k: v for k, v in checkpoint(3).items() if k != "time_ns"}
    with pytest.raises(ConfigError, match="time_ns"):
        app.offer(untimed, "POST /resync x.pt")
    with pytest.raises(ConfigError, match="time_ns is 'soon'"):
        app.offer({**untimed, "time_ns": "soon"}, "POST /resync x.pt")
    assert app.replica.offers == {}


def test_a_start_state_timed_before_the_capture_leaves_the_replica_stale(sim, tmp_path):
    job, sim_dir, checkpoint = sim
    early = {**checkpoint(1), "time_ns": checkpoint(1)["time_ns"] - 50 * job.appliance.iteration_gap_ns}
    app = appliance(job, sim_dir, tmp_path / "run", early)
    app.run()
    assert app.sink.applied == [] and app.replica.stale
    got = events(tmp_path / "run")
    assert got[0]["event"] == "anchor.refused" and "more than the 1 ms pause later" in got[0]["reason"]
    assert got[1]["event"] == "fallback" and "cannot be placed" in got[1]["reason"]


def test_a_timed_start_state_is_placed_and_a_declared_one_is_taken_as_the_captures_start(sim, tmp_path):
    job, sim_dir, checkpoint = sim
    # Timed: the trainer's state at iteration 2, with its time: iterations 2..4 are applied.
    app = appliance(job, sim_dir, tmp_path / "timed", checkpoint(2))
    app.run()
    assert app.sink.applied == [2, 3, 4] and verify(tmp_path / "timed", sim_dir / "truth", job_params(job)).ok
    # Declared (no time): it is the state when the capture began, iteration 1.
    untimed = {k: v for k, v in checkpoint(1).items() if k != "time_ns"}
    app = appliance(job, sim_dir, tmp_path / "declared", untimed)
    app.run()
    assert app.sink.applied == [1, 2, 3, 4] and app.pipeline.merger.skipped == 0


def test_an_offer_whose_time_contradicts_the_numbering_is_dropped(sim, tmp_path):
    job, sim_dir, checkpoint = sim
    app = appliance(job, sim_dir, tmp_path / "run", checkpoint(1))
    app.offer(checkpoint(3, time_of=2), "POST /resync wrong-time.pt")   # iteration 3's state, iteration 2's time
    app.run()
    assert app.sink.applied == [1, 2, 3, 4] and not app.replica.stale
    refused = [e for e in events(tmp_path / "run") if e["event"] == "anchor.refused"]
    assert len(refused) == 1 and "which the replica numbers 2" in refused[0]["reason"]
    assert app.replica.offers == {}
    assert verify(tmp_path / "run", sim_dir / "truth", job_params(job)).ok


def test_an_offer_for_an_iteration_the_streams_have_passed_is_refused(sim, tmp_path):
    """Offered after the streams carried its iteration (in the middle of the replay)."""
    job, sim_dir, checkpoint = sim
    start = replica_start(job, None, "the trainer's first offer")
    replica = Replica(job, start.checkpoint)
    control = ControlPlane(tmp_path / "events.jsonl")
    numbering = Numbering(start, replica, control)
    sink = ReplicaSink(replica, control)
    offered = []

    def progress(stream, done, total):
        del stream, total
        if not offered and numbering.pipeline.merger.next >= 2 and done:
            source = "POST /resync late.pt"
            offered.append(numbering.offer(numbering.make_offer(checkpoint(2), source), source))

    pcaps = {m.name: sim_dir / "streams" / f"{m.name}.pcap" for m in job.mirrors}
    replay(job, job_plan(job), pcaps, sink, batch_frames=256, progress=progress, numbering=numbering)
    assert offered, "the replay never reached the point of the offer"
    refused = [e for e in events(tmp_path) if e["event"] == "anchor.refused"]
    assert len(refused) == 1 and "the streams have passed" in refused[0]["reason"], events(tmp_path)
    assert sink.applied == [] and replica.stale and replica.offers == {}
