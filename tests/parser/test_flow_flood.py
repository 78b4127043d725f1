"""A flood of flows between the job's own ranks (issue 11, "Resources and the disk"): a stream
parser that cannot lock on keeps bounded state, counts every frame, and explains briefly.

200,000 one-frame RDMA WRITE flows from rank 0 to rank 1 of ``configs/small.yaml`` (each its
own destination QP, valid ICRC) are what a hostile or broken host could send between two of
the job's hosts. Flow learning watches at most ``MAX_WIRE_FLOWS`` of them, so memory does not
grow with the flood, and the lock-on failure lists the busiest few.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradtap.parser.flow_learning import EXPLAIN_FLOWS, MAX_WIRE_FLOWS
from tests.parser.many_flows import one_frame_flows

ROOT = Path(__file__).resolve().parents[2]
FLOWS = 200_000
SCRIPT = """
import json, sys
from gradtap.capture.pcap import PcapReader
from gradtap.parser.stream import StreamParser
from gradtap.wire import events as ev
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import load_job

def status(field):  # kB, from proc(5)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

job = load_job(sys.argv[3])
def parse(path):
    parser = StreamParser(job, job_plan(job), "r0-egress")
    with PcapReader(path, max_frames=65536) as reader:
        for batch in reader:
            parser.feed(batch)
    parser.flush()
    return parser

parse(sys.argv[2])                                   # every kernel compiled
with open("/proc/self/clear_refs", "w") as f:        # VmHWM := VmRSS (proc(5), clear_refs "5")
    f.write("5")
before = status("VmRSS")
parser = parse(sys.argv[1])
print(json.dumps({"rss_kib": status("VmHWM") - before, "counters": ev.as_dict(parser.counters),
                  "wire": len(parser.lockon.learner.wire), "detail": parser.failure.detail,
                  "reason": parser.failure.reason}))
"""


@pytest.mark.slow
def test_a_flood_of_flows_between_the_ranks_keeps_the_parser_bounded(tmp_path):
    path, small = tmp_path / "flood.pcap", tmp_path / "few.pcap"
    one_frame_flows(path, FLOWS, src="198.18.0.1", dst="198.18.1.1", first_qp=0x100)
    one_frame_flows(small, 10, src="198.18.0.1", dst="198.18.1.1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(small), str(ROOT / "configs" / "small.yaml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert sum(got["counters"].values()) == FLOWS, got["counters"]
    assert got["wire"] == MAX_WIRE_FLOWS
    assert f"({MAX_WIRE_FLOWS} wire flows; the {EXPLAIN_FLOWS} busiest:)" in got["detail"]
    assert got["detail"].count("QPN 0x") == EXPLAIN_FLOWS
    # The file's pages, one batch (64 MiB) and the watched flows (a few KiB each): not per frame.
    bound = path.stat().st_size + (64 << 20) + MAX_WIRE_FLOWS * (16 << 10)
    assert got["rss_kib"] * 1024 < bound, (got["rss_kib"] >> 10, bound >> 20)
