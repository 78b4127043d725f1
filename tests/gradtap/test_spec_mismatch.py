"""A job spec that does not match the traffic (issue 11, item 3).

One simulated job (``configs/small.yaml``: 4 ranks, NCCL Simple over IPv4, 2 channels, 1 QP
per connection, MTU 4096, fp32 gradients, the rebuilt bucket layout, three egress streams)
is replayed with eleven specs that each get one fact wrong. Every mismatch starts from the
simulated truth's ``start.pt``: none of them changes the model or the optimizer (a 3-rank
ring or bf16 gradients on the wire describe the same fp32 parameters), so the start state
stays loadable and only the traffic can show the mismatch.

For every case:

- nothing wrong is applied: whatever the replica applied equals the trainer bit for bit
  (``gradtap.verify``), and a replica that applied nothing says so (every stream that did
  not lock has a ``lockon.failed`` event, every iteration not applied a ``fallback``);
- every frame ends in exactly one event counter;
- the operator is told what differs: the ``lockon.failed`` events' reason and detail (or a
  ``ConfigError`` before the replay starts) name the field of the job spec that is wrong
  (``parser/mismatch.py``), and for a one-field change, the value that fits the traffic.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from gradtap.core.errors import ConfigError
from gradtap.replay import ReplayResult, run_replay
from gradtap.replica_sink import ReplicaSink
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import JobSpec, load_job, parse_job
from tests.gradtap.test_replay import start_of, streams_of

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _nccl(**fields) -> Callable[[JobSpec], JobSpec]:
    return lambda job: job.model_copy(update={"nccl": job.nccl.model_copy(update=fields)})


def _ddp(**fields) -> Callable[[JobSpec], JobSpec]:
    return lambda job: job.model_copy(update={"ddp": job.ddp.model_copy(update=fields)})


def _ranks(edit: Callable[[tuple], list]) -> Callable[[JobSpec], JobSpec]:
    return lambda job: job.model_copy(update={"ring": job.ring.model_copy(
        update={"ranks": tuple(edit(job.ring.ranks))})})


def _gap(ns: int) -> Callable[[JobSpec], JobSpec]:
    return lambda job: job.model_copy(update={"appliance": job.appliance.model_copy(
        update={"iteration_gap_ns": ns})})


def _ipv6(ranks: tuple) -> list:
    return [r.model_copy(update={"ip": f"fd00::{i + 1}"}) for i, r in enumerate(ranks)]


@dataclass(frozen=True)
class Mismatch:
    id: str
    edit: Callable[[JobSpec], JobSpec]
    names: str               # a regex the operator's message must match: the field that differs and its value

    def param(self):
        return pytest.param(self, id=self.id)


MISMATCHES = [
    Mismatch("three-ranks", _ranks(lambda r: r[:3]), r"world size|number of ranks|\b\d+ ranks\b|not in ring\.ranks"),
    Mismatch("ring-order-swapped", _ranks(lambda r: [r[1], r[0], *r[2:]]), r"ring order|order of the ranks"),
    Mismatch("LL", _nccl(protocol="LL"), r"nccl\.protocol Simple \(the job says LL\)"),
    Mismatch("LL128", _nccl(protocol="LL128"), r"nccl\.protocol Simple \(the job says LL128\)"),
    Mismatch("four-channels", _nccl(channels=4), r"nccl\.channels 2 \(the job says 4\)"),
    Mismatch("mtu-1024", _nccl(mtu=1024), r"4096-byte payloads .*nccl\.mtu is 1024"),
    Mismatch("two-qps", _nccl(qps_per_connection=2), r"nccl\.qps_per_connection 1 \(the job says 2\)"),
    Mismatch("bf16", _ddp(grad_dtype="bf16"), r"ddp\.grad_dtype fp32 \(the job says bf16\)"),
    Mismatch("initial-layout", _ddp(layout="initial"), r"ddp\.layout rebuilt \(the job says initial\)"),
    Mismatch("gap-1s", _gap(1_000_000_000), r"pause of at least 1000 ms in the job's traffic, appliance\.iteration_gap_ns.*longest pause seen was 2(\.\d+)? ms"),
    Mismatch("ipv6-ranks", _ranks(_ipv6), r"over IPv4 .* the job's ranks are IPv6"),
]


@dataclass
class Outcome:
    job: JobSpec
    out: Path
    error: ConfigError | None = None
    result: ReplayResult | None = None
    sink: ReplicaSink | None = None
    events: list[dict] | None = None

    def told(self) -> str:
        """What the operator reads: the refusal, or every stream's lock-on failure."""
        if self.error is not None:
            return str(self.error)
        return "\n".join(f"{e['stream']}: {e['what']}: {e['reason']}\n{e['detail']}"
                         for e in self.events if e["event"] == "lockon.failed")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch") / "sim"
    job = load_job(ROOT / "configs" / "small.yaml")
    Simulation(job, out, iterations=3, seed=5, faults=parse_faults("", tuple(m.name for m in job.mirrors))).run()
    return job, out


@pytest.fixture(scope="module")
def replayed(small, tmp_path_factory):
    """Each case replayed once (both tests below read it)."""
    job, sim = small
    done: dict[str, Outcome] = {}

    def run(case: Mismatch | None) -> Outcome:
        key = "matching" if case is None else case.id
        if key not in done:
            spec = job if case is None else case.edit(job)
            o = Outcome(spec, tmp_path_factory.mktemp(key))
            try:
                # Loaded as a user's YAML would be (model_copy skips validation).
                o.job = parse_job(spec.model_dump(mode="json", exclude_none=True), key)
                o.result, o.sink = run_replay(o.job, streams_of(sim, job), o.out, start_of(sim))
            except ConfigError as exc:
                o.error = exc
            else:
                o.events = [json.loads(line) for line in (o.out / "events.jsonl").read_text().splitlines()]
            done[key] = o
        return done[key]

    return run


def test_the_simulated_job_itself_replays_bit_exact(small, replayed):
    """The reference: with the job that made the traffic, every iteration is applied exactly,
    so whatever goes missing below is the mismatch's doing."""
    _, sim = small
    o = replayed(None)
    assert all(o.result.locked.values()) and o.sink.applied == [1, 2, 3]
    v = verify(o.out, sim / "truth", job_params(o.job))
    assert v.ok and not v.stale and v.digests_checked == [1, 2, 3], v


@pytest.mark.parametrize("case", [pytest.param(m, id=m.id) for m in MISMATCHES])
def test_nothing_wrong_is_applied_and_every_frame_is_counted(small, replayed, case):
    _, sim = small
    o = replayed(case)
    if o.error is not None:
        assert not (o.out / "iterations.jsonl").exists()
        return
    r = o.result
    for name in r.frames:
        assert r.frames[name] > 0 and sum(r.counters[name].values()) == r.frames[name], (name, r.counters[name])
    failed = sorted(e["stream"] for e in o.events if e["event"] == "lockon.failed")
    assert failed == sorted(n for n, locked in r.locked.items() if not locked), (failed, r.locked)
    if not any(r.locked.values()):
        assert not o.sink.applied and o.sink.replica.iteration == start_of(sim)["iteration"]
        return
    v = verify(o.out, sim / "truth", job_params(o.job))
    assert not v.differences, v.differences
    fallbacks = sorted(e["iteration"] for e in o.events if e["event"] == "fallback")
    for it in v.stale:
        assert fallbacks and fallbacks[0] <= it, (it, fallbacks)


@pytest.mark.parametrize("case", [m.param() for m in MISMATCHES])
def test_the_message_names_what_differs(replayed, case):
    o = replayed(case)
    told = o.told()
    assert told, f"{case.id}: no lockon.failed event and no error"
    assert re.search(case.names, told, re.IGNORECASE), f"{case.id}: the operator is told:\n{told}"
