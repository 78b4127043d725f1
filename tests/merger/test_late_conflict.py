"""A copy that arrives after its bucket was applied, and contradicts the copy used.

The merger steps a bucket as soon as the streams' union covers it. A forged frame (valid
ICRC, plausible PSN) that reaches the only stream carrying its block *before* the real one
would be applied; the real frame, arriving later as a duplicate with other bytes, uncovers
the block in that stream (``data.duplicate_conflict``). The iteration must then end as
unrecoverable (a ``fallback``, the replica stale), never as a silently wrong replica: the
merger ends an iteration only once every stream has moved past it (retired it, or paused
for ``appliance.iteration_gap_ns`` after it), and checks that no block it applied lost its
cover in between.

One stream mirrors both directions of rank 0 of a two-rank ring, so it alone carries every
block. Replayed in small rounds, so that the bucket is applied between the two copies.
"""

from __future__ import annotations

import json

import numpy as np

from gradtap.replay import run_replay
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import parse_job
from tests.frame_edits import bth_offset, read_frames, resign, write_frames
from tests.gradtap.test_replay import allgather_frames, start_of
from tests.simulator.test_simulate import make_job, simulate


def one_stream_job():
    doc = make_job(2, "Simple", 1, "fp32").model_dump(mode="json", exclude_none=True)
    doc["mirrors"] = [{"name": "m-both", "rank": 0, "direction": "both"}]
    return parse_job(doc)


def forge_before(frames, target: int, gap_ns: int):
    """``frames`` with frame ``target`` replaced by a copy of other payload bytes (valid ICRC)
    and the real frame moved to the end of its iteration (just before the next pause)."""
    frame, ts = frames[target]
    fake = bytearray(frame)
    bth = bth_offset(frame)
    payload = slice(bth + 12 + (16 if frame[bth] in (6, 10, 11) else 0), len(frame) - 4)
    fake[payload] = bytes(b ^ 0x5A for b in fake[payload])
    end = target
    while end + 1 < len(frames) and frames[end + 1][1] - frames[end][1] < gap_ns:
        end += 1
    assert end > target + 16, "the forged frame must be well inside its iteration"
    return frames[:target] + [(resign(fake), ts)] + frames[target + 1:end + 1] + [(frame, frames[end][1])] + \
        frames[end + 1:]


def test_a_late_copy_that_contradicts_an_applied_block_makes_the_iteration_unrecoverable(tmp_path):
    job = one_stream_job()
    simulate(tmp_path / "sim", job, iterations=3)
    path = tmp_path / "sim" / "streams" / "m-both.pcap"
    target = allgather_frames(path, job, ordinal=1, bucket=0)[0]
    forged = tmp_path / "m-both.pcap"
    write_frames(forged, forge_before(read_frames(path), target, job.appliance.iteration_gap_ns))

    result, sink = run_replay(job, {"m-both": forged}, tmp_path / "replay", start_of(tmp_path / "sim"),
                              batch_frames=16)
    assert result.counters["m-both"].get("data.duplicate_conflict", 0) >= 1
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    fallbacks = [e for e in events if e["event"] == "fallback"]
    assert [e["iteration"] for e in fallbacks] == [2], events
    assert "contradicted" in fallbacks[0]["reason"]
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert not v.differences, v.differences          # never silently wrong
    assert v.digests_checked == [1] and v.stale == [2, 3]
    line = next(x for x in sink.lines if x["iteration"] == 2)
    assert not line["recovered"] and line["contradicted_blocks"], line


def test_without_a_forged_copy_the_same_replay_is_exact(tmp_path):
    """The control: the same stream, replayed in the same small rounds, untouched."""
    job = one_stream_job()
    simulate(tmp_path / "sim", job, iterations=3)
    run_replay(job, {"m-both": tmp_path / "sim" / "streams" / "m-both.pcap"}, tmp_path / "replay",
               start_of(tmp_path / "sim"), batch_frames=16)
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and v.digests_checked == [1, 2, 3], v
    assert np.all([x["recovered"] for x in json.loads((tmp_path / "replay" / "replay.json").read_text())["iterations"]])
