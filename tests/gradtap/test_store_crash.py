"""The whole appliance against its durable store, killed and starved (issue 13's evidence):

* ``gradtap replay --store`` killed with SIGKILL at random moments while it uploads (20 trials,
  moto's S3 server and a ``file://`` directory): no READY snapshot in the store ever fails its
  checksums (each is also the simulator's truth, bit for bit), and ``gradtap replay
  --start-from-store`` starts from the newest READY one and ends bit-exact with the truth;
* the store dying mid-upload under a running appliance: the replica keeps being updated (bit
  for bit, never stale), the snapshots the store misses are counted (failed, skipped), and the
  uploads resume when the store returns.

The kill trials are seeded (``CRASH_SEED``): a failing trial names its seed, store, and the
moment it was killed at, and reruns the same way. Each appliance is a process of its own, forked
from a ``multiprocessing`` fork server that has imported gradtap and torch once
(``tests/forked.py``; ``gradtap``'s start-up otherwise dominates a trial); it runs the console
script's ``main`` with the trial's arguments and holds everything an appliance holds: its own
Numba threads, pipeline, replica, snapshot writer and uploader. Its capture is read at a
trainer's pace (:func:`paced`), so that snapshots come a few a second and uploads complete
between them, as in a live appliance.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapWriter, read_pcap
from gradtap.store.object_store import SnapshotStore
from gradtap.simulator.truth import iteration_dir
from gradtap.verify import compare_state, verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import parse_job
from tests.forked import fork_server
from tests.gradtap.test_replay import start_of
from tests.simulator.test_simulate import make_job, simulate
from tests.store.s3_server import CREDENTIALS, MotoServer, moto_bucket

pytestmark = pytest.mark.slow

ITERATIONS = 8                     # captured: 1..8; snapshots 2..9, one per iteration
SIZES = [128, 256, 64]             # ~50 k parameters: 0.6 MB per snapshot (model and Adam state)
TRIALS = {"s3": 10, "file": 10}
PACE_S = 2.0                       # the killed appliance's capture comes over 2 s (4 iterations a second)
CRASH_SEED = int(os.environ.get("CRASH_SEED", "13"))
BUCKET = "ckpt"


# -- the simulated job ------------------------------------------------------------------------

class Sim:
    """A simulated capture of ``ITERATIONS`` iterations and its truth; captures cut to begin at
    a given iteration (what a restarted appliance sees: the trainer's traffic from then on)."""

    def __init__(self, root: Path):
        base = make_job(3, "LL", 2, "fp32").model_dump(mode="json")
        base["name"] = "crash"
        base["model"]["kwargs"]["sizes"] = SIZES
        self.root = root
        self.job = parse_job(base)
        simulate(root, self.job, iterations=ITERATIONS)
        self.truth = root / "truth"
        self.params = job_params(self.job)
        self.spans = {int(k): v for k, v in json.loads((self.truth / "manifest.json").read_text())["span_ns"].items()}
        self._cuts: dict[int, dict[str, Path]] = {}

    def streams(self) -> dict[str, Path]:
        return {m.name: self.root / "streams" / f"{m.name}.pcap" for m in self.job.mirrors}

    def streams_from(self, iteration: int) -> dict[str, Path]:
        """Every stream from the first frame of ``iteration`` on."""
        if iteration not in self._cuts:
            begin = self.spans[iteration][0]
            out = self.root / f"from_{iteration}"
            out.mkdir(exist_ok=True)
            for name, path in self.streams().items():
                batch = read_pcap(path)
                keep = np.flatnonzero(batch.ts_ns >= begin)
                with PcapWriter(out / path.name) as w:
                    w.write_batch(FrameBatch(batch.data, batch.offsets[keep], batch.caplens[keep],
                                             batch.wirelens[keep], batch.ts_ns[keep], batch.linktype))
            self._cuts[iteration] = {name: out / path.name for name, path in self.streams().items()}
        return self._cuts[iteration]

    def job_file(self, where: Path, url: str, endpoint: str | None) -> Path:
        """The job spec with its store (short retries, retention of 2 so that kills also fall
        in retention's deletes), as an operator writes it."""
        spec = self.job.model_dump(mode="json")
        spec["initial_state"] = {"checkpoint": str(self.truth / "start.pt")}
        spec["appliance"]["store"] = {"url": url, "endpoint_url": endpoint, "keep_last": 2,
                                      "retry_min_s": 0.05, "retry_max_s": 0.2, "close_timeout_s": 10}
        path = where / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Sim:
    return Sim(tmp_path_factory.mktemp("crash-sim"))


@pytest.fixture(scope="module")
def moto():
    with moto_bucket(BUCKET) as server:
        yield server


# -- checks -----------------------------------------------------------------------------------

def truth_difference(sim: Sim, state: dict):
    """The first difference between a loaded snapshot (``{"model", "optimizer", "iteration"}``)
    and the truth after iteration ``state["iteration"] - 1`` (None: equal, bit for bit)."""
    done = state["iteration"] - 1
    with np.load(iteration_dir(sim.truth, done) / "state.npz") as z:
        truth = {k: z[k] for k in z.files}
    opt = state["optimizer"]["state"]
    arrays = {}
    for i, p in enumerate(sim.params):
        arrays[f"param/{p.name}"] = state["model"][p.name].numpy()
        arrays[f"exp_avg/{p.name}"] = opt[i]["exp_avg"].numpy()
        arrays[f"exp_avg_sq/{p.name}"] = opt[i]["exp_avg_sq"].numpy()
        if int(opt[i]["step"]) != int(truth["step"]):
            return f"step of {p.name}: {int(opt[i]['step'])}, truth {int(truth['step'])}"
    return compare_state(done, arrays, {k: v for k, v in truth.items() if k != "step"})


def check_ready(sim: Sim, store: SnapshotStore, where: str) -> list[int]:
    """Every READY snapshot in ``store`` loads with every object's size and sha256 as its
    manifest says (``SnapshotStore.load``), and is the truth's state; their iterations."""
    ready = store.ready()
    for iteration in ready:
        loaded = store.load(iteration)                # GradtapError: a READY snapshot that fails
        assert loaded["iteration"] == iteration, where
        d = truth_difference(sim, loaded)
        assert d is None, f"{where}: READY snapshot {iteration} differs from the truth: {d}"
    return ready


# -- the appliance as a process of its own ----------------------------------------------------

def appliance(argv: list[str], log: str, pace_s: float, mark: str) -> None:
    """``gradtap ARGV...`` in this (forked) process, its output in ``log``; the capture read over
    ``pace_s`` seconds (:func:`paced`), when its last round comes written to ``mark``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(CREDENTIALS)
    paced(pace_s, mark)
    from gradtap.cli import main
    sys.argv = ["gradtap", *argv]
    main()


def paced(seconds: float, mark: str) -> None:
    """Make ``gradtap replay`` in this process read its capture over ``seconds``, in rounds of
    256 frames: a live capture comes at the trainer's pace (here a few iterations a second),
    whereas a replay reads as fast as it parses and would be over before the store's client has
    made its first connection. A round never comes before its time on that pace (a replay that
    runs behind it catches up at once), so the last comes no sooner than ``seconds`` after the
    first: that moment (``time.monotonic()``, one clock for every process) is written to
    ``mark``, whole, when the replay starts (:func:`capture_left`)."""
    import contextlib

    import gradtap.progress
    import gradtap.replay

    real = gradtap.progress.replay_progress

    @contextlib.contextmanager
    def replay_progress(console, pcaps):
        started = time.monotonic()
        Path(mark + ".tmp").write_text(repr(started + seconds))
        os.replace(mark + ".tmp", mark)
        with real(console, pcaps) as report:
            def step(stream: str, done: int, total: int) -> None:
                report(stream, done, total)
                time.sleep(max(0.0, started + seconds * done / total - time.monotonic()))
            yield step

    gradtap.progress.replay_progress = replay_progress
    gradtap.replay.run_replay.__kwdefaults__["batch_frames"] = 256


def uploads_waiting(out: Path) -> bool:
    """Whether a snapshot handed to the uploader is not yet uploaded or skipped (its staging
    directory, ``store/snapshot.py``, is there): an upload pending or in flight."""
    try:
        return any(n.startswith(".tmp-upload-") for n in os.listdir(out / "snapshots"))
    except FileNotFoundError:
        return False


def uploaded(out: Path) -> int:
    """The uploads completed so far (``store.uploaded`` events)."""
    try:
        return (out / "events.jsonl").read_text().count('"event": "store.uploaded"')
    except FileNotFoundError:
        return 0


def events(out: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


def applied(out: Path) -> int:
    """Iterations the replica has reported (``iterations.jsonl``)."""
    try:
        return (out / "iterations.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def pace_end(out: Path) -> Path:
    """Where the appliance writing ``out`` keeps when its paced capture's last round comes (:func:`paced`)."""
    return Path(str(out) + ".paced")


def capture_left(out: Path) -> float:
    """Seconds at least until the appliance writing ``out`` has been given its whole capture: the
    time left until its paced capture's last round (:func:`paced`), none once that has passed.
    Not the share still to read at the pace: an appliance behind the pace (a loaded machine)
    reads what it is behind at once, and in one suite run a delay drawn within that share let
    it finish first in 5 of 10 trials."""
    try:
        end = float(pace_end(out).read_text())
    except FileNotFoundError:
        return PACE_S
    return max(0.0, end - time.monotonic())


def wait_until(what: str, ready, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.005)


def start_appliance(ctx, argv: list[str], out: Path):
    """``gradtap ARGV...`` started in a process of the fork server, its log beside ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = ctx.Process(target=appliance, args=(argv, str(out) + ".log", PACE_S, str(pace_end(out))))
    proc.start()
    return proc


def replay_argv(sim: Sim, job_file: Path, out: Path) -> list[str]:
    """``gradtap replay`` of the whole capture with ``job_file``'s store into ``out``."""
    return ["replay", str(job_file), *[f"{n}={p}" for n, p in sim.streams().items()], "--out", str(out)]


def upload_window(ctx, argv: list[str], out: Path, timeout: float = 300) -> float:
    """How long an upload stays pending or in flight on this machine and store, in seconds: the
    median time a staging directory is there while the appliance runs to its end unharmed. The
    kills' random delays are drawn within it: a fixed delay that fits one host's uploads (0.6 MB
    to moto takes 0.1 s on one, a few ms to a local disk on another) lands after them on a faster
    host, and the trials would never hit an upload under way."""
    proc = start_appliance(ctx, argv, out)
    windows, since = [], None
    deadline = time.monotonic() + timeout
    while proc.is_alive():
        assert time.monotonic() < deadline, f"the calibration run did not end in {timeout} s"
        now, waiting = time.monotonic(), uploads_waiting(out)
        if waiting and since is None:
            since = now
        elif not waiting and since is not None:
            windows.append(now - since)
            since = None
        time.sleep(0.0005)
    proc.join(30)
    assert proc.exitcode == 0, f"the calibration run exited {proc.exitcode}: {Path(str(out) + '.log').read_text()}"
    assert windows, "the calibration run never showed an upload under way"
    return max(float(np.median(windows)), 0.001)


def run_and_kill(ctx, argv: list[str], out: Path, moment: dict, timeout: float = 300) -> dict:
    """Start the appliance and SIGKILL it at ``moment``: once an upload is pending or in flight
    while the first is (``first``), or once at least one upload has completed and the replica
    has reported ``iteration`` iterations, after a delay of ``fraction`` of the upload
    ``window`` or, if less, of half the capture still to come then. (Killed while the capture
    still comes: after the last iteration the appliance closes at once, whatever the delay.
    The capture left is the time until its paced last round (:func:`capture_left`). Drawn for
    ``iteration``, a delay let the appliance finish first in 5 of 10 trials of one run, whose
    slow store completed the first upload iterations later; drawn from the iterations the
    replica had reported when the moment came, in 3 of 10 of a loaded run, whose replica
    reported iterations behind the capture.) What was seen: whether it was killed (rather than
    finished first), whether an upload was under way then, and the delay."""
    proc = start_appliance(ctx, argv, out)

    def due() -> bool:
        if not uploads_waiting(out):
            return False
        if moment["first"]:
            return uploaded(out) == 0
        return uploaded(out) >= 1 and applied(out) >= moment["iteration"]

    deadline = time.monotonic() + timeout
    try:
        while proc.is_alive() and not due():
            assert time.monotonic() < deadline, f"the appliance did not reach {moment} in {timeout} s"
            time.sleep(0.0005)
        delay = min(moment["window"], capture_left(out) / 2) * moment["fraction"]
        time.sleep(delay)
        in_flight = uploads_waiting(out)
        killed = proc.is_alive()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    return {"killed": killed and proc.exitcode == -signal.SIGKILL, "in_flight": killed and in_flight,
            "exitcode": proc.exitcode, "delay": round(delay, 4)}


def restart(sim: Sim, job_file: Path, iteration: int, out: Path):
    """``gradtap replay --start-from-store`` over the capture from ``iteration`` on (a restarted
    appliance whose local disk is gone, on the trainer's traffic from the store's newest state)."""
    from click.testing import CliRunner

    from gradtap.cli import _register, app

    _register()
    pcaps = [f"{n}={p}" for n, p in sim.streams_from(iteration).items()]
    return CliRunner().invoke(app, ["replay", str(job_file), *pcaps, "--out", str(out), "--start-from-store"])


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_sigkill_of_the_appliance_while_uploading(tmp_path, sim, kind, request):
    """SIGKILL at seeded random moments biased to fall while an upload is pending or in flight
    (a random delay of up to an upload's time after one is under way: the first upload in
    every fifth trial, otherwise one after a random iteration once an upload has completed);
    then every READY snapshot verifies and is the truth, and a restart from the store resumes
    from the newest READY one and ends bit-exact with the truth."""
    if kind == "s3":
        server = request.getfixturevalue("moto")
        endpoint = server.url
        options = server.options()
    else:
        endpoint, options = None, None
    ctx = fork_server()
    rng = random.Random(f"{CRASH_SEED}-{kind}")
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    url = f"s3://{BUCKET}/calibration" if kind == "s3" else f"file://{calibration / 'store'}"
    window = upload_window(ctx, replay_argv(sim, sim.job_file(calibration, url, endpoint), calibration / "a"),
                           calibration / "a")
    print(f"{kind}: an upload is under way for {1e3 * window:.1f} ms (median)")
    outcomes = []
    for trial in range(TRIALS[kind]):
        moment = {"first": trial % 5 == 4, "iteration": rng.randint(2, ITERATIONS - 1), "window": window,
                  "fraction": rng.random()}
        where = f"{kind} trial {trial} (CRASH_SEED={CRASH_SEED}: killed at {moment})"
        root = tmp_path / f"t{trial}"
        root.mkdir()
        url = f"s3://{BUCKET}/t{trial}" if kind == "s3" else f"file://{root / 'store'}"
        job_file = sim.job_file(root, url, endpoint)
        store = SnapshotStore(url, sim.job.name, storage_options=options)
        argv = replay_argv(sim, job_file, root / "a")
        started = time.monotonic()
        seen = run_and_kill(ctx, argv, root / "a", moment)
        ready = check_ready(sim, store, where)
        seen["torn"] = kind == "file" and any(".tmp-" in p.name for p in (root / "store").rglob("*"))
        print(f"{where}: {seen}, READY {ready} ({time.monotonic() - started:.1f} s)")
        if not seen["killed"]:
            assert seen["exitcode"] == 0, f"{where}: the appliance exited {seen['exitcode']} " \
                                          f"({(root / 'a.log').read_text()[-2000:]})"
        outcomes.append({**seen, "ready": ready})
        if not ready:
            # Nothing READY: a restart must not pretend to be current.
            done = restart(sim, job_file, 1, root / "b")
            if done.exit_code == 0:                  # it waits, stale, for the trainer's checkpoint
                assert any(e["event"] == "fallback" for e in events(root / "b")), f"{where}: {done.output}"
                assert json.loads((root / "b" / "replay.json").read_text())["stale"], where
            else:
                assert "no READY snapshot" in str(done.exception) + done.output, f"{where}: {done.output}"
            continue
        newest = ready[-1]
        if newest > ITERATIONS:                    # killed after the last upload: nothing left to replay
            continue
        done = restart(sim, job_file, newest, root / "b")
        assert done.exit_code == 0, f"{where}: the restart failed: {done.output}\n{done.exception!r}"
        lines = [json.loads(s) for s in (root / "b" / "iterations.jsonl").read_text().splitlines()]
        assert lines[0]["iteration"] == newest, f"{where}: resumed at {lines[0]['iteration']}, not {newest}"
        v = verify(root / "b", sim.truth, sim.params)
        assert v.ok and not v.stale, f"{where}: {v}"
        assert v.digests_checked == list(range(newest, ITERATIONS + 1)), f"{where}: {v}"
        after = check_ready(sim, store, where + ", after the restart")
        assert after[-1] == ITERATIONS + 1, f"{where}: the store holds {after} after the restart"
    killed = [o for o in outcomes if o["killed"]]
    print(f"{kind}: {len(killed)}/{len(outcomes)} killed, {sum(o['in_flight'] for o in killed)} with an upload "
          f"pending or in flight, {sum(o['torn'] for o in killed)} leaving an object half-written; READY after "
          f"the kill: {[o['ready'] for o in outcomes]}")
    assert len(killed) >= len(outcomes) - 2
    # The trials must hit uploads under way, but how many still are after the random delay
    # depends on the machine's load (a 0.6 MB file:// upload is over in milliseconds): one
    # CI run saw 1 of 10. Every kill was checked above whatever it hit.
    assert sum(o["in_flight"] for o in killed) >= 1
    assert sum(bool(o["ready"]) for o in outcomes) >= len(outcomes) // 2


def test_the_store_dies_under_the_appliance_and_comes_back(tmp_path, sim, monkeypatch):
    """The appliance (``run_replay``, what ``gradtap replay`` runs) with moto as its store: the
    server is killed while an upload is under way, three iterations are applied with it down,
    then it comes back (empty: moto keeps its buckets in memory). The replica stays bit-exact
    and current throughout, the uploads the store missed are counted (failed, skipped), the
    next upload after its return resumes, and the last state is READY in the store.

    The capture is paced by its progress callback (the replay reads as fast as the CPU goes;
    a live capture comes at the trainer's pace): it waits while the replica is ``allowed``
    iterations ahead, so that the outage falls where the test says, however loaded the machine.
    That pace needs the replica to apply each iteration before the next round, so the updater
    runs between rounds here on any host (``gradtap.pipeline.overlapping``): on its own
    thread it may apply two iterations at once, and a snapshot due meanwhile is skipped."""
    import gradtap.pipeline
    from gradtap.replay import run_replay
    from gradtap.store_tier import with_store

    monkeypatch.setattr(gradtap.pipeline, "overlapping", lambda threads, cores=None: False)

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    server = MotoServer().start()
    server.make_bucket(BUCKET)
    out, url = tmp_path / "replay", f"s3://{BUCKET}/outage"
    job = with_store(sim.job, url)
    job = job.model_copy(update={"appliance": job.appliance.model_copy(update={"store": job.appliance.store.model_copy(
        update={"endpoint_url": server.url, "keep_last": 2, "retry_min_s": 0.1, "retry_max_s": 0.4,
                "close_timeout_s": 30})})})
    allowed = {"n": 2}
    stop = threading.Event()

    def pace(stream: str, done: int, total: int) -> None:
        del stream, done, total
        deadline = time.monotonic() + 120
        while applied(out) >= allowed["n"] and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)

    seen: dict = {}
    failure: list[BaseException] = []

    def outage() -> None:
        try:
            wait_until("a first upload", lambda: uploaded(out) >= 1)
            staged = set(os.listdir(out / "snapshots"))
            allowed["n"] = 4
            wait_until("another upload under way", lambda: any(
                n.startswith(".tmp-upload-") and n not in staged for n in os.listdir(out / "snapshots")))
            server.kill()                                    # the store dies under that upload
            seen["killed_at"] = applied(out)
            allowed["n"] = seen["killed_at"] + 3             # the replica goes on without it
            wait_until("three iterations and two failed uploads with the store down", lambda: applied(out)
                       >= allowed["n"] and sum(e["event"] == "store.failed" for e in events(out)) >= 2)
            seen["back_at"] = applied(out)
            server.start()                                   # back, and empty
            server.make_bucket(BUCKET)
            allowed["n"] = ITERATIONS + 1
        except BaseException as exc:
            failure.append(exc)
        finally:
            stop.set()

    controller = threading.Thread(target=outage, daemon=True)
    controller.start()
    try:
        run_replay(job, sim.streams(), out, start_of(sim.root), progress=pace, batch_frames=256)
        stop.set()
        controller.join(60)
        assert not failure, failure[0]
        # What the store holds since its return: READY, whole, the truth; the last state among it.
        ready = check_ready(sim, SnapshotStore(url, job.name, storage_options=server.options()), "after the outage")
        assert ready and ready[-1] == ITERATIONS + 1, ready
    finally:
        stop.set()
        server.kill()
    assert seen["back_at"] - seen["killed_at"] >= 3
    # The replica: every iteration applied, bit-exact, never stale, the outage notwithstanding.
    v = verify(out, sim.truth, sim.params)
    assert v.ok and not v.stale and v.digests_checked == list(range(1, ITERATIONS + 1)), v
    # The snapshots the store missed are counted, and the uploads resumed when it came back.
    report = json.loads((out / "replay.json").read_text())
    counts = report["store"]
    assert counts["failed"] >= 2 and counts["skipped"] >= 1, counts
    assert counts["last_uploaded"] == ITERATIONS + 1, counts
    # Each snapshot (2..ITERATIONS + 1) is handed over once, and is either uploaded or skipped.
    assert counts["submitted"] == ITERATIONS == counts["uploaded"] + counts["skipped"], counts
    went = {e["iteration"] for e in events(out) if e["event"] == "store.uploaded"}
    missed = {i for e in events(out) if e["event"] == "store.skipped" for i in e["iterations"]}
    assert len(missed) == counts["skipped"] and not went & missed, (went, missed)
    kinds = [e["event"] for e in events(out)]
    assert {"store.failed", "store.skipped", "store.resumed"} <= set(kinds), kinds
    assert kinds.index("store.resumed") > max(i for i, k in enumerate(kinds) if k == "store.failed")
    print(f"store down from iteration {seen['killed_at']} to {seen['back_at']}: {counts}")


def test_a_snapshot_written_again_is_handed_to_the_uploader_once(tmp_path):
    """The final write at a clean shutdown finds the last due snapshot already written: it is
    not handed over a second time (the uploader would count the first as skipped, or upload it
    twice), but one written again after another was handed over still is (a resync back)."""
    import torch

    from gradtap.store.snapshot import Snapshots

    class Uploader:
        def __init__(self):
            self.submitted: list[int] = []

        def submit(self, iteration: int, staged: Path) -> None:
            self.submitted.append(iteration)

        def close(self, timeout: float) -> None:
            pass

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    uploader = Uploader()
    snaps = Snapshots(tmp_path, "j", every=1, keep=3, uploader=uploader)

    def write(iteration: int) -> None:
        snaps.write({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration},
                    step=1)

    write(2)
    write(3)
    write(3)                                   # the final write at close
    assert uploader.submitted == [2, 3]
    write(2)                                   # back to an older state (a resync): handed over again
    assert uploader.submitted == [2, 3, 2]
    snaps.close()
