"""The rehearsal ``gradtap run`` makes before listening (``gradtap/rehearsal.py``).

Its point is that no kernel compiles once frames arrive: a fresh process rehearses, then runs
the live appliance over capture files (through its capture workers and rings, as live), and
Numba's dispatchers must have gained no compiled signature. It is also a self-check: a
planted bug in the updater or in the merger's vote makes it fail, and the appliance then never
starts a capture worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradtap.appliance import Appliance, RunOptions
from gradtap.capture.worker import SourceSpec
from gradtap.parser.aside import AsideCopies
from gradtap.rehearsal import MINI_SIZES, RehearsalFailed, miniature, rehearse
from gradtap.updater.replica import Replica
from gradtap.workload.spec import parse_job
from tests.simulator.test_simulate import make_job, simulate

LIVE_AFTER_REHEARSAL = """
import gc, json, sys
from pathlib import Path
import torch
from numba.core.registry import CPUDispatcher
from gradtap.appliance import Appliance, RunOptions
from gradtap.capture.worker import SourceSpec
from gradtap.parser.aside import _lay_over, aside_free
from gradtap.rehearsal import rehearse
from tests.simulator.test_simulate import make_job


def compiled():
    return {d: set(d.signatures) for d in gc.get_objects() if isinstance(d, CPUDispatcher)}


def main():
    sim, job = Path(sys.argv[1]), make_job(3, "LL", 2, "fp32")
    options = RunOptions(ring_slots=4096, slot_size=4352, hugepages="off", digests=True, rehearse=False)
    rehearse(job, options.round_frames, options.slot_size, digests=options.digests)
    before = compiled()
    # Called from Python only when a stream kept a unit aside, which the live run may not do.
    aside = {f.__name__: len(f.signatures) for f in (aside_free, _lay_over)}
    streams = {m.name: SourceSpec("pcap", (str(sim / "streams" / f"{m.name}.pcap"),), {}) for m in job.mirrors}
    start = torch.load(sim / "truth" / "start.pt", weights_only=True)
    result = Appliance(job, streams, sim.parent / "run", start, options).run()
    new = {f"{d.py_func.__module__}.{d.py_func.__qualname__}": sorted(map(str, sigs - before.get(d, set())))
           for d, sigs in compiled().items() if sigs - before.get(d, set())}
    print(json.dumps({"exit": result.exit_code, "unrecoverable": result.unrecoverable, "new": new,
                      "aside": aside}))


if __name__ == "__main__":
    main()
"""

PIECES_AFTER_REHEARSAL = """
import json
from gradtap.parser.pieces import parse_pieces
from gradtap.rehearsal import rehearse
from gradtap.workload.spec import parse_job
from tests.simulator.test_simulate import make_job

doc = make_job(3, "Simple", 2, "fp32").model_dump(mode="json", exclude_none=True)
doc["mirrors"] = [m for m in doc["mirrors"] if m["name"] == "m-both"]
rehearse(parse_job(doc, "one stream"), 8192, 4352)
print(json.dumps({"parse_pieces": len(parse_pieces.signatures)}))
"""


def _run_script(tmp_path, text: str, *args: str) -> dict:
    """The last line of ``text`` run in a fresh process (whose kernels nothing compiled yet), as JSON."""
    script = tmp_path / "script.py"
    script.write_text(text)
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=600, cwd=sys.path[0] if sys.path[0] else None,
                          env={**os.environ, "PYTHONPATH": ":".join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_after_the_rehearsal_the_live_run_compiles_nothing(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path / "sim", job, iterations=3)
    out = _run_script(tmp_path, LIVE_AFTER_REHEARSAL, str(tmp_path / "sim"))
    assert out["exit"] == 0 and out["unrecoverable"] == 0
    assert out["new"] == {}
    assert out["aside"] == {"aside_free": 1, "_lay_over": 1}


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: a stream is never parsed in pieces")
def test_the_rehearsal_of_a_job_parsed_in_pieces_compiles_the_piece_kernel(tmp_path):
    """One stream on two cores or more checks its ICRCs in stage 1, and the live run parses
    its batches, larger than half the L2 cache per thread, in pieces (``parser/pieces.py``):
    the miniature's small batches must be too."""
    assert _run_script(tmp_path, PIECES_AFTER_REHEARSAL) == {"parse_pieces": 1}


def test_the_miniature_keeps_what_the_wire_depends_on_and_nothing_that_reaches_out():
    job = make_job(4, "auto", 2, "bf16", ipv6=True, nqps=2, mtu=4096, era="auto")
    doc = job.model_dump(mode="json")
    doc["appliance"].update(verify_icrc=False, iteration_gap_ns=2_000_000, control_endpoint="http://198.18.9.9/x",
                            store={"url": "file:///nowhere"})
    job = parse_job(doc, "test")
    mini = miniature(job)
    for section in ("nccl", "ring", "mirrors", "optimizer"):
        assert getattr(mini, section) == getattr(job, section), section
    assert (mini.ddp.grad_dtype, mini.ddp.layout, mini.ddp.predivide) == \
        (job.ddp.grad_dtype, job.ddp.layout, job.ddp.predivide)
    assert mini.model.kwargs == {"sizes": MINI_SIZES}
    assert (mini.appliance.verify_icrc, mini.appliance.iteration_gap_ns) == (False, 2_000_000)
    assert mini.appliance.store is None and mini.appliance.control_endpoint is None
    assert mini.nccl.era == "auto" and mini.nccl.protocol == "auto"
    written = miniature(job, simulated=True)
    assert written.nccl.era == "2.30" and written.nccl.protocol == "auto"


@pytest.mark.parametrize("job", [
    make_job(3, "Simple", 2, "fp32", mtu=4096),
    make_job(4, "LL128", 2, "bf16", ipv6=True, nqps=2, mtu=4096),
    make_job(3, "auto", 1, "fp32", era="auto"),
], ids=["simple", "ll128-ipv6-bf16", "auto"])
def test_a_rehearsal_is_exact(job):
    done = rehearse(job, 2048, 4352, digests=True)
    assert done.iterations == 2


def test_a_wrong_gradient_fails_the_rehearsal_and_no_capture_starts(tmp_path, monkeypatch):
    """A planted bug: the replica applies every bucket with its first byte's lowest bit flipped."""
    apply_bucket = Replica.apply_bucket

    def wrong(self, bucket, grad, **kw):
        grad = grad.copy()
        grad[0] ^= 1
        apply_bucket(self, bucket, grad, **kw)

    monkeypatch.setattr(Replica, "apply_bucket", wrong)
    job = make_job(3, "Simple", 2, "fp32", mtu=4096)
    streams = {m.name: SourceSpec("pcap", (str(tmp_path / f"{m.name}.pcap"),), {}) for m in job.mirrors}
    simulate(tmp_path / "sim", job, iterations=1)
    start = torch.load(tmp_path / "sim" / "truth" / "start.pt", weights_only=True)
    appliance = Appliance(job, streams, tmp_path / "run", start, RunOptions(hugepages="off"))
    with pytest.raises(RehearsalFailed, match=r"not exact on this host \(iteration 1: .* differs at .*--no-rehearsal"):
        appliance.run()
    assert not appliance.workers and not appliance.rings


def test_a_vote_that_does_not_take_the_majority_fails_the_rehearsal(monkeypatch):
    """A planted bug: the merger takes the first covering stream's copy, never comparing."""
    from gradtap.merger import union

    monkeypatch.setattr(union, "_blocks_differ", lambda a, b, start, nbytes, check: np.zeros(len(start), bool))
    with pytest.raises(RehearsalFailed, match="did not take the majority's"):
        rehearse(make_job(3, "Simple", 2, "fp32", mtu=4096), 2048, 4352)


def test_a_unit_kept_aside_and_not_laid_over_fails_the_rehearsal(monkeypatch):
    """A planted bug: a stream's copy of a bucket leaves out what the stream kept aside."""
    monkeypatch.setattr(AsideCopies, "overlay", lambda self, grad, lo, hi, index: grad[lo:hi])
    with pytest.raises(RehearsalFailed, match="a unit a stream kept aside was not laid over the shared gradient"):
        rehearse(make_job(3, "Simple", 2, "fp32", mtu=4096), 2048, 4352)
