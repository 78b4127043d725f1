"""``gradtap.trainer`` end to end: a real DDP job describes itself, the appliance follows its
traffic and checks its state every step, the job is killed and resumes from the replica.

The job (``tests/trainer/ddp_trainer.py``) is two gloo processes on CPU training a small MLP.
After its second step rank 0 writes the job spec with ``describe_to`` and its state
(``start.pt``). The simulator then produces that run's traffic: the same model factory, seed,
data shards and optimizer, the ranks' gradients summed in ring order (with two ranks, one
float32 addition per element, as gloo's), from ``start.pt`` on. The appliance runs in this
process (``gradtap.appliance.Appliance`` with its control endpoint), and the test plays the
network: each time the trainer attests its state after a step, the frames of that step's
iteration reach the appliance, re-timed to the wall clock (the trainer's fallback checkpoint
carries a wall-clock ``time_ns``), so that the trainer is never more than one step ahead.
The streams lock on only once a whole iteration follows a pause, so the first iteration is
applied with the next one: at the first attestation the next iteration's frames come too.

1. A spec that is wrong on purpose (10x the learning rate): the fingerprint of the first step
   the appliance applies differs, ``integrity.mismatch`` names the first parameter, the
   fallback reaches the trainer's handler, which saves a checkpoint at its next step boundary
   and hands it back; the appliance refuses it, saying that its learning rate is not the
   job's (a resync cannot heal a wrong spec). This job trains on, uninterrupted: it is the
   reference.
2. The right spec: every step attested; the trainer is SIGKILLed mid-run, restored by every
   rank from the appliance's snapshots (``gradtap.trainer.restore``) and trains to the end.
   Every tensor (parameters, ``exp_avg``, ``exp_avg_sq``, ``step``) equals the reference's
   bit for bit, and so does the replica.
3. The right spec, with rank 1's allgather sends of one iteration lost on the mirror: the
   replica goes stale and asks for a checkpoint, the trainer's handler hands back the state of
   its next boundary, the appliance places it by its ``time_ns`` and resyncs, and the replica
   ends equal to the reference.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from gradtap.appliance import Appliance, RunOptions
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.capture.worker import SourceSpec
from gradtap.control_server import ControlServer, ControlSettings
from gradtap.control_token import ensure_token
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.store import snapshot
from gradtap.workload.spec import parse_job
from tests.trainer import ddp_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 8           # the trainer's iterations 0..7; the capture holds 2..7
KILL_AFTER = 4           # the trainer is killed once the appliance has checked the state of iteration 4
PROCESS_TIMEOUT_S = 300
OPERATOR = {"ring": {"ranks": [{"ip": "198.18.0.1", "mac": "02:00:00:00:0e:01"},
                               {"ip": "198.18.1.1", "mac": "02:00:00:00:0e:02"}]},
            "mirrors": [{"name": "r0-egress", "rank": 0, "direction": "egress"},
                        {"name": "r1-ingress", "rank": 1, "direction": "ingress"},
                        {"name": "r1-both", "rank": 1, "direction": "both"}],
            "nccl": {"era": "2.21", "channels": 2, "mtu": 1024}}


class Trainer:
    """The job's two rank processes, in their own process group; killed in any case."""

    def __init__(self, work: Path, tag: str, appliance: str, resume: Path | None = None):
        self.work, self.tag = work, tag
        args = ["--dir", str(work), "--tag", tag, "--iterations", str(ITERATIONS), "--appliance", appliance]
        if resume is not None:
            args += ["--resume", str(resume)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.logs = [open(work / f"rank{r}-{tag}.log", "w") for r in range(ddp_trainer.WORLD)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "tests.trainer.ddp_trainer", "--rank", str(r), *args],
                                       cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
                      for r, log in enumerate(self.logs)]

    def wait(self, timeout_s: float = PROCESS_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            code = p.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, f"rank exited {code}: {self.log()}"

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
        for log in self.logs:
            log.close()

    def log(self) -> str:
        return "\n".join((self.work / f"rank{r}-{self.tag}.log").read_text()[-3000:] for r in range(ddp_trainer.WORLD))


def wait_for(path: Path, trainer: Trainer, timeout_s: float = PROCESS_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if any(p.poll() not in (None, 0) for p in trainer.procs) or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never came: {trainer.log()}")
        time.sleep(0.05)


class Network:
    """The simulated capture, handed to an in-process appliance one iteration at a time: the
    frames of iteration k when the trainer attests the state of k + 1 (after its step k)."""

    def __init__(self, sim: Path, job, out: Path, start: dict, token_file: Path, endpoint: str,
                 lose: int | None = None):
        # snapshot_buffers 0: every due snapshot on the update path, so the one the killed trainer
        # resumes from exists when it restarts (in the background it may still be being written,
        # or be skipped while the one before is: tests/store/test_snapshot_writer.py)
        appliance = job.appliance.model_copy(update={"control_endpoint": endpoint, "control_token_file": token_file,
                                                     "snapshot_keep": ITERATIONS, "snapshot_buffers": 0})
        job = job.model_copy(update={"appliance": appliance})
        self.gap = job.appliance.iteration_gap_ns
        streams = {m.name: SourceSpec("pcap", (str(sim / "streams" / f"{m.name}.pcap"),), {}) for m in job.mirrors}
        self.app = Appliance(job, streams, out, start, RunOptions(ring_slots=4096, slot_size=4352, hugepages="off",
                                                                  digests=True))
        spans = {int(k): v for k, v in json.loads((sim / "truth" / "manifest.json").read_text())["span_ns"].items()}
        whole = {m.name: read_pcap(sim / "streams" / f"{m.name}.pcap") for m in job.mirrors}
        self.frames = {k: {name: _cut(b, *span) for name, b in whole.items()} for k, span in spans.items()}
        if lose is not None:
            rank1 = ipaddress.ip_address(job.ring.ranks[1].ip).packed
            self.frames[lose] = {name: _without_second_half(b, rank1) for name, b in self.frames[lose].items()}
        self.clock = 0
        self.lock = threading.Lock()
        self.fed: list[int] = []
        self.hold: int | None = None         # the attestation of this iteration waits until released
        self.held, self.released = threading.Event(), threading.Event()

    def offer(self, checkpoint: dict, source: str) -> list[int]:
        with self.lock:
            return self.app.offer(checkpoint, source)

    def attest(self, fp: object) -> dict:
        """POST /attest: the appliance takes the fingerprint, then the traffic of the step the
        trainer just took arrives."""
        k = fp.get("iteration") if isinstance(fp, dict) else None
        try:
            with self.lock:
                try:
                    return self.app.attest(fp)
                finally:
                    if isinstance(k, int) and k - 1 in self.frames and k - 1 not in self.fed:
                        self._feed(k - 1)
                        if len(self.fed) == 1 and k in self.frames:
                            self._feed(k)        # lock-on: the streams lock on at the next iteration
        finally:
            if k == self.hold:
                self.held.set()
                self.released.wait(PROCESS_TIMEOUT_S)

    def _feed(self, iteration: int) -> None:
        """Iteration ``iteration``'s frames on the wall clock, then a pause that ends it."""
        batches = self.frames[iteration]
        first = min(int(b.ts_ns[0]) for b in batches.values() if len(b.ts_ns))
        base = max(time.time_ns(), self.clock + 4 * self.gap)
        shifted = {n: _retimed(b, base - first) for n, b in batches.items()}
        self.clock = max(int(b.ts_ns[-1]) for b in shifted.values() if len(b.ts_ns))
        # Never frames from the future: a trainer faster than the pauses between iterations
        # (4 gaps) would otherwise take its next step, and time a fallback checkpoint, before
        # the capture's clock shows the traffic of the step it just took.
        while time.time_ns() <= self.clock:
            time.sleep(max(0.0, (self.clock - time.time_ns()) / 1e9) + 1e-4)
        self.app.pipeline.round(shifted, -1)
        self.app.pipeline.round({}, self.clock + 4 * self.gap)
        self.fed.append(iteration)

    def close(self) -> None:
        self.released.set()
        self.app.pipeline.close()
        self.app.snapshots.close(None)


class Endpoint:
    """The appliance's control endpoint, listening before the appliance exists (the trainer is
    given its address at launch) and serving whichever :class:`Network` is bound."""

    def __init__(self, work: Path):
        self.network: Network | None = None
        self.server = ControlServer(lambda c, s: self.network.offer(c, s), lambda: self.network.app.status(),
                                    ControlSettings(work / "control.token", 1 << 26, resync_dirs=(work / "resync",),
                                                    port=0, request_timeout_s=120.0),
                                    attest=lambda fp: self.network.attest(fp))
        self.url = f"http://127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.server.close()
        if self.network is not None:
            self.network.close()


def _cut(b: FrameBatch, lo: int, hi: int) -> FrameBatch:
    sel = np.flatnonzero((b.ts_ns >= lo) & (b.ts_ns < hi))
    return FrameBatch(b.data, b.offsets[sel], b.caplens[sel], b.wirelens[sel], b.ts_ns[sel], b.linktype)


def _without_second_half(b: FrameBatch, source: bytes) -> FrameBatch:
    """``b`` without the second half of the UDP frames that IPv4 ``source`` sent (its allgather
    sends, which only a stream that sees ``source``'s egress carries): lost on the mirror."""
    sent = np.flatnonzero([b.data[o + 23] == 17 and bytes(b.data[o + 26:o + 30]) == source for o in b.offsets])
    keep = np.setdiff1d(np.arange(len(b.offsets)), sent[len(sent) // 2:])
    return FrameBatch(b.data, b.offsets[keep], b.caplens[keep], b.wirelens[keep], b.ts_ns[keep], b.linktype)


def _retimed(b: FrameBatch, shift: int) -> FrameBatch:
    return FrameBatch(b.data, b.offsets, b.caplens, b.wirelens, b.ts_ns + shift, b.linktype)


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def answers(work: Path, tag: str) -> list[dict]:
    return [json.loads(line) for line in (work / f"attest-{tag}.jsonl").read_text().splitlines()]


def assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got["model"].keys() == want["model"].keys(), what
    for name, t in want["model"].items():
        assert torch.equal(got["model"][name], t), f"{what}: parameter {name}"
    gs, ws = got["optimizer"]["state"], want["optimizer"]["state"]
    assert gs.keys() == ws.keys(), what
    for i in ws:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(gs[i][key]), torch.as_tensor(ws[i][key])), f"{what}: {key} of {i}"
    assert got["iteration"] == want["iteration"], what


def described_job(work: Path, tag: str, **optimizer):
    """The job ``describe_to`` wrote, starting from the trainer's ``start-<tag>.pt``."""
    doc = yaml.safe_load((work / "job.yaml").read_text())
    doc["optimizer"] = {**doc["optimizer"], **optimizer}
    doc["initial_state"] = {"checkpoint": str(work / f"start-{tag}.pt")}
    doc["training"] = {"batch_size": ddp_trainer.BATCH}
    return parse_job(doc, str(work / "job.yaml"))


def start_state(work: Path, tag: str) -> dict:
    """``start-<tag>.pt``: the trainer's state when the capture begins (it carries no time_ns:
    the appliance was not up yet)."""
    return torch.load(work / f"start-{tag}.pt", weights_only=True)


def endpoint_of(work: Path, tag: str, trainer: Trainer) -> str:
    wait_for(work / f"trainer-{tag}.json", trainer)
    return json.loads((work / f"trainer-{tag}.json").read_text())["endpoint"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e")
    (work / "resync").mkdir()
    ensure_token(work / "control.token")
    (work / "job.yaml").write_text(yaml.safe_dump({"name": "e2e", **OPERATOR}))
    return work


@pytest.fixture(scope="module")
def reference(work):
    """Run 1, uninterrupted, against an appliance whose spec has 10x the learning rate. The
    simulator makes the run's traffic (from the right spec) once, for both runs."""
    endpoint = Endpoint(work)
    trainer = Trainer(work, "reference", endpoint.url)
    try:
        wait_for(work / "start-reference.pt", trainer)
        job = described_job(work, "reference")
        before = torch.get_num_threads()
        torch.set_num_threads(1)         # as the trainer's ranks
        try:
            Simulation(job, work / "sim", iterations=ITERATIONS - ddp_trainer.DESCRIBE_AT - 1,
                       seed=ddp_trainer.SEED, faults=parse_faults("", tuple(m.name for m in job.mirrors))).run()
        finally:
            torch.set_num_threads(before)
        wrong = described_job(work, "reference", lr=job.optimizer.lr * 10)
        endpoint.network = Network(work / "sim", wrong, work / "wrong", start_state(work, "reference"),
                                   work / "control.token", endpoint_of(work, "reference", trainer))
        described = (work / "job.yaml").read_text()
        (work / "go-reference").touch()
        trainer.wait()
    finally:
        trainer.kill()
        endpoint.close()
    return job, described, torch.load(work / "final-reference.pt", weights_only=True)


def test_a_wrong_learning_rate_is_caught_at_the_first_attested_step(work, reference):
    job, _, final = reference
    got = events(work / "wrong")
    first = next(i for i, e in enumerate(got) if e["event"] == "integrity.mismatch")
    mismatch, fallback = got[first], got[first + 1]
    start = ddp_trainer.DESCRIBE_AT + 1
    # The state at the start matches; the first step the appliance applies (iteration 2's) does not.
    assert mismatch["iteration"] == start + 1
    assert (mismatch["tensor"], mismatch["state"]) == (next(iter(final["model"])), "param")
    assert (fallback["event"], fallback["iteration"], fallback["request"]) == ("fallback", start + 1,
                                                                               "regular_checkpoint")
    said = answers(work, "reference")
    assert said[0]["iteration"] == start and said[0]["answer"]["checked"]
    # The trainer's handler got the fallback and handed back the checkpoint of its next boundary
    # (and of the two after): each refused, for the learning rate the spec has wrong.
    counts = final["fallback"]
    assert (counts["requests"], counts["handed_back"], counts["failed"], counts["abandoned"]) == (1, 0, 3, 1)
    log = (work / "rank0-reference.log").read_text()
    assert f"the checkpoint of iteration {start + 1} was not handed back" in log
    assert "lr is 0.001 but the job's schedule gives 0.01" in log
    assert sorted(p.name for p in (work / "resync" / "reference").glob("fallback-*.pt")) == \
        [f"fallback-{k:08d}.pt" for k in (start + 2, start + 3)]          # the newest two are kept


def test_a_killed_trainer_restored_from_the_replica_continues_bit_identically(work, reference):
    job, described, final = reference
    endpoint = Endpoint(work)
    trainer = Trainer(work, "killed", endpoint.url)
    resumed = None
    try:
        wait_for(work / "start-killed.pt", trainer)
        assert (work / "job.yaml").read_text() == described          # describe is deterministic
        network = Network(work / "sim", job, work / "right", start_state(work, "killed"), work / "control.token",
                          endpoint_of(work, "killed", trainer))
        network.hold = KILL_AFTER
        endpoint.network = network
        (work / "go-killed").touch()
        assert network.held.wait(PROCESS_TIMEOUT_S), trainer.log()
        trainer.kill()                                # SIGKILL, both ranks, mid-step
        network.released.set()
        snapshots = work / "right" / "snapshots"
        resumed = Trainer(work, "resumed", endpoint.url, resume=snapshots)
        network.app.control.endpoint = endpoint_of(work, "resumed", resumed)
        resumed.wait()
    finally:
        trainer.kill()
        if resumed is not None:
            resumed.kill()
        endpoint.close()
    # The fingerprint of KILL_AFTER reached the appliance; its answer never reached the trainer.
    killed, resumed = answers(work, "killed"), answers(work, "resumed")
    assert [a["iteration"] for a in killed] == list(range(ddp_trainer.DESCRIBE_AT + 1, KILL_AFTER))
    assert [a["iteration"] for a in resumed] == list(range(KILL_AFTER + 1, ITERATIONS + 1))   # restored at KILL_AFTER
    assert all(a["answer"].get("accepted") for a in killed + resumed), killed + resumed
    status = network.app.status()
    assert status.attested == ITERATIONS - ddp_trainer.DESCRIBE_AT and status.diverged == 0 and not status.stale
    assert not [e for e in events(work / "right") if e["event"] in ("integrity.mismatch", "fallback")]
    got = torch.load(work / "final-resumed.pt", weights_only=True)
    assert_same_state(got, final, "the resumed trainer")
    assert got["fallback"]["requests"] == 0
    assert_same_state(snapshot.load(snapshot.named_latest(snapshots)), final, "the replica")


def test_an_unrecoverable_iteration_is_healed_by_the_trainers_fallback_checkpoint(work, reference):
    """Rank 1's allgather sends of iteration LOST never reach the appliance: when the next
    iteration shows it incomplete, the replica goes stale and asks for a checkpoint; the
    trainer's handler hands back the state of its next boundary, placed by its time_ns, and
    the replica resynchronises from it and follows the trainer to the end."""
    job, _, final = reference
    lost = ITERATIONS - 3
    endpoint = Endpoint(work)
    network = Network(work / "sim", job, work / "healed", start_state(work, "reference"), work / "control.token",
                      "http://127.0.0.1:9/not-yet", lose=lost)
    endpoint.network = network
    trainer = Trainer(work, "healed", endpoint.url, resume=work / "start-reference.pt")
    try:
        network.app.control.endpoint = endpoint_of(work, "healed", trainer)
        trainer.wait()
    finally:
        trainer.kill()
        endpoint.close()
    got = events(work / "healed")
    fallback = next(e for e in got if e["event"] == "fallback")
    assert fallback["iteration"] == lost and "fallback_post_failed" not in [e["event"] for e in got], got
    handed = f"fallback-{lost + 2:08d}.pt"          # asked while the trainer was at lost + 2
    # Placed by its time_ns at the first captured iteration to begin after it, and resynced from.
    assert [(e["iteration"], Path(e["source"].split()[-1]).name) for e in got if e["event"] == "anchor.placed"] == \
        [(lost + 2, handed)]
    assert [e["iteration"] for e in got if e["event"] == "resync"] == [lost + 2]
    counts = torch.load(work / "final-healed.pt", weights_only=True)["fallback"]
    assert (counts["requests"], counts["handed_back"], counts["failed"]) == (1, 1, 0)
    assert [Path(p).name for p in counts["checkpoints"]] == [handed]
    said = answers(work, "healed")
    assert [a["iteration"] for a in said if "refused" in a["answer"]] == [lost + 3]     # sent while stale
    assert not network.app.replica.stale and network.app.status().diverged == 0
    assert_same_state(snapshot.load(snapshot.named_latest(work / "healed" / "snapshots")), final, "the healed replica")
