"""Whose replica a snapshot directory holds: the job and the start state it was begun from.

A snapshot of iteration ``k`` is named after ``k`` only, so two replicas of different jobs,
or of one job begun from different start states, write snapshots of the same names whose
checksums all pass. A directory that kept one replica's snapshots while another wrote
into it would have ``LATEST`` name a state of the wrong replica. So a snapshot directory
records its replica's origin once, in ``ORIGIN.json``, and a writer whose replica has
another origin is refused (``Snapshots``) until it is told to clear the directory.

The origin is

* the job's name and a sha256 per job-spec section that decides the replica's states
  (:data:`JOB_SECTIONS`); the appliance's own settings (``appliance``), the simulator's
  (``training``), which ports are mirrored (``mirrors``) and ``initial_state`` (superseded
  by the start state itself) may change between runs of one replica;
* the start state: its iteration and a sha256 over the replica's parameters and Adam
  moments (float32, in the replica's flat layout), its step count and learning rate; or,
  for a replica that began waiting for the trainer's checkpoint (``gradtap/start.py``),
  iteration -1 and :data:`FROM_TRAINER`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np

FORMAT = "gradtap-replica-origin/1"
ORIGIN = "ORIGIN.json"
JOB_SECTIONS = ("model", "ddp", "optimizer", "nccl", "ring")
FROM_TRAINER = "the trainer's first offered checkpoint"


def job_sha256(job) -> dict[str, str]:
    """A sha256 of each job-spec section of :data:`JOB_SECTIONS` (canonical JSON)."""
    spec = job.model_dump(mode="json")
    return {s: hashlib.sha256(json.dumps(spec[s], sort_keys=True).encode()).hexdigest() for s in JOB_SECTIONS}


@dataclass(frozen=True)
class ReplicaOrigin:
    job: str
    job_sha256: dict[str, str]          # section of JOB_SECTIONS -> sha256 of its canonical JSON
    start_iteration: int
    start_sha256: str

    @classmethod
    def of(cls, replica, waiting: bool = False) -> "ReplicaOrigin":
        """The origin of a :class:`gradtap.updater.replica.Replica` as constructed (before
        its first iteration); ``waiting``: it waits for the trainer's checkpoint."""
        sections = job_sha256(replica.job)
        if waiting:
            return cls(replica.job.name, sections, -1, FROM_TRAINER)
        s = replica.state
        h = hashlib.sha256()
        for array in (s.param, s.exp_avg, s.exp_avg_sq):
            h.update(np.ascontiguousarray(array, np.float32))     # its buffer, not a copy
        h.update(f"step {int(s.step)} lr {float(s.lr)!r}".encode())
        return cls(replica.job.name, sections, int(s.iteration), h.hexdigest())

    def describe(self) -> str:
        if self.start_sha256 == FROM_TRAINER:
            return f"job {self.job!r} begun from {FROM_TRAINER}"
        return (f"job {self.job!r} begun at iteration {self.start_iteration} "
                f"from state {self.start_sha256[:12]}")

    def differences(self, other: "ReplicaOrigin") -> list[str]:
        """What ``other`` differs in, as phrases for an error message."""
        out = []
        if self.job != other.job:
            out.append("the job's name")
        sections = [s for s in JOB_SECTIONS if self.job_sha256.get(s) != other.job_sha256.get(s)]
        if sections:
            out.append("the job spec's " + ", ".join(sections) + (" section" if len(sections) == 1 else " sections"))
        if (self.start_iteration, self.start_sha256) != (other.start_iteration, other.start_sha256):
            out.append("the start state")
        return out


def origin_json(origin: ReplicaOrigin) -> str:
    return json.dumps({"format": FORMAT, **asdict(origin)}, indent=1) + "\n"


def parse_origin(text: str) -> ReplicaOrigin | None:
    """The origin ``text`` (an ``ORIGIN.json``) records; ``None`` when it is not one this
    version reads (then the replica of the directory's snapshots is unknown)."""
    try:
        data = json.loads(text)
        if data.pop("format") != FORMAT:
            return None
        origin = ReplicaOrigin(**data)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return origin if isinstance(origin.job_sha256, dict) else None
