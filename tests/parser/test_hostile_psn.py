"""Stray PSNs, conflicting copies and lost first packets against one stream parser.

Frames of a simulated stream are rewritten with their own byte offsets and given a valid ICRC
again (``tests/wire/naive_icrc.py``), so stage 1 accepts them and stage 2 must judge them:

- a PSN of an iteration far past the window, arriving without the pause that starts an
  iteration, advances nothing (no phantom iterations) and counts as ``data.implausible_psn``;
- a copy of a packet with other bytes leaves the blocks it touches uncovered
  (``data.duplicate_conflict``), whichever copy came first;
- a stream whose flows lost the first packet(s) of their first write after the boundary is
  placed by the packets it has, not one write early.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.parser.stream import StreamParser
from gradtap.wire import events as ev
from gradtap.workload.layout import job_plan
from gradtap.workload.wire_plan import PHASE_AG
from tests.frame_edits import WRITES, bth_offset, psn_of, read_frames, resign
from tests.parser.test_stream import assert_exact
from tests.simulator.test_simulate import make_job, simulate


def _with(frame: bytes, psn: int | None = None, payload: bytes | None = None) -> bytes:
    """The frame with another PSN or the end of its payload replaced, and a valid ICRC."""
    b = bytearray(frame)
    bth = bth_offset(frame)
    if psn is not None:
        b[bth + 9:bth + 12] = (psn % (1 << 24)).to_bytes(3, "big")
    if payload is not None:
        b[len(b) - 4 - len(payload):len(b) - 4] = payload
    return resign(b)


def _batch(frames) -> FrameBatch:
    return FrameBatch.from_frames([f for f, _ in frames], ts_ns=[t for _, t in frames])


def _parse(job, name, frames, batch=4096):
    parser = StreamParser(job, job_plan(job), name)
    its = []
    for lo in range(0, len(frames), batch):
        its += parser.feed(_batch(frames[lo:lo + batch]))
    return parser, its + parser.flush()


@pytest.fixture(scope="module", params=["Simple", "LL", "LL128"])
def capture(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"hostile-{request.param}")
    job = make_job(3, request.param, 2, "fp32", mtu=1024)
    simulate(out, job, iterations=3)
    name = "m-egress"
    clean, its = _parse(job, name, read_frames(out / "streams" / f"{name}.pcap"))
    assert [it.index for it in its] == [0, 1, 2]
    return job, out, name, clean, its


def _flow_writes(frames, parser):
    """Indices of the frames of each data flow of the stream, by flow."""
    t = parser.tables
    out: dict[int, list[int]] = {}
    for i, (frame, _) in enumerate(frames):
        bth = bth_offset(frame)
        if bth is None or frame[bth] not in WRITES:
            continue
        qpn = int.from_bytes(frame[bth + 5:bth + 8], "big")
        hit = np.flatnonzero((t.qpn == qpn) & t.is_data)
        if len(hit):
            out.setdefault(int(hit[0]), []).append(i)
    return out


def test_psns_far_ahead_without_a_pause_make_no_phantom_iterations(capture):
    job, out, name, clean, truth_its = capture
    frames = read_frames(out / "streams" / f"{name}.pcap")
    flows = _flow_writes(frames, clean)
    rng = np.random.default_rng(3)
    strays = {}
    for f, idx in flows.items():
        period = int(clean.tables.period[f])
        for i in rng.choice(idx[len(idx) // 4:], 20, replace=False):   # after lock-on, mid-traffic
            strays[int(i)] = _with(frames[i][0], psn=psn_of(frames[i][0]) + period * int(rng.integers(2, 60)))
    hostile = []
    for i, fr in enumerate(frames):
        hostile.append(fr)
        if i in strays:
            hostile.append((strays[i], fr[1]))
    parser, its = _parse(job, name, hostile)
    assert [it.index for it in its] == [0, 1, 2]
    c = ev.as_dict(parser.counters)
    assert c["data.implausible_psn"] == len(strays), c
    assert sum(c.values()) == len(hostile)
    for a, b in zip(its, truth_its):
        assert np.array_equal(a.covered, b.covered)
    assert_exact(its, out, job_plan(job))


@pytest.mark.parametrize("forged_first", [False, True])
def test_a_conflicting_copy_uncovers_the_blocks_it_touches(capture, forged_first):
    job, out, name, clean, truth_its = capture
    frames = read_frames(out / "streams" / f"{name}.pcap")
    plan = job_plan(job)
    # A full-size middle or last packet of an allgather write of iteration 1: its copy gets other bytes.
    t = clean.tables
    target = None
    for f, idx in _flow_writes(frames, clean).items():
        base = (psn_of(frames[idx[0]][0]))
        for i in idx[len(idx) // 3:]:
            frame = frames[i][0]
            pos = (psn_of(frame) - base) % (1 << 24) % int(t.period[f])
            m = t.messages[t.msg_start[f]:t.msg_start[f] + t.msg_count[f]]
            w = np.flatnonzero((m["psn_offset"] <= pos) & (pos < m["psn_offset"] + m["npkts"]))
            if len(w) and m["phase"][w[0]] == PHASE_AG and m["nelem"][w[0]] > 0 and frame[bth_offset(frame)] in (7, 8):
                target = i
                break
        if target is not None:
            break
    assert target is not None
    frame, ts = frames[target]
    # One data byte changed (the first payload byte is data in every protocol: LL and LL128
    # lines start with data, so the flags still say the right step).
    first = len(frame) - 4 - (len(frame) - bth_offset(frame) - 12 - 4)
    forged = (_with(frame, payload=bytes([frame[first] ^ 0x40]) + frame[first + 1:-4]), ts)
    hostile = frames[:target] + ([forged, frames[target]] if forged_first else [frames[target], forged]) + \
        frames[target + 1:]
    parser, its = _parse(job, name, hostile)
    c = ev.as_dict(parser.counters)
    assert c["data.duplicate_conflict"] == 1 and sum(c.values()) == len(hostile), c
    lost = [(a.index, k) for a, b in zip(its, truth_its) for k in np.flatnonzero(b.covered & ~a.covered)]
    assert len(lost) >= 1 and len({it for it, _ in lost}) == 1, lost
    assert all(np.array_equal(a.covered & ~b.covered, np.zeros_like(a.covered)) for a, b in zip(its, truth_its))
    assert_exact(its, out, plan)


def _drop_first(frames, clean, whole_write):
    """Drop each data flow's first packet at the capture's start (where the stream locks:
    the simulator's port is quiet before it), or its whole first write."""
    t = clean.tables
    doomed = set()
    for f, idx in _flow_writes(frames, clean).items():
        npkts = int(t.messages["npkts"][t.msg_start[f]])
        doomed.update(idx[:npkts] if whole_write else idx[:1] if npkts > 1 else [])
    return [fr for i, fr in enumerate(frames) if i not in doomed]


def test_a_flow_that_lost_its_first_packets_is_placed_by_the_rest(capture):
    job, out, name, clean, truth_its = capture
    frames = read_frames(out / "streams" / f"{name}.pcap")
    parser, its = _parse(job, name, _drop_first(frames, clean, whole_write=False))
    assert parser.locked and parser.failure is None and [it.index for it in its] == [0, 1, 2]
    assert_exact(its, out, job_plan(job))
    for a, b in zip(its, truth_its):
        assert (b.covered & ~a.covered).sum() <= len(clean.tables.data_flows) * 2    # the lost packets' blocks


def test_every_flow_losing_its_first_write_is_refused_there_and_locks_at_the_next_boundary(capture):
    """Then nothing tells the first write's loss from a plan one write off (the writes repeat);
    the next pause does."""
    job, out, name, clean, truth_its = capture
    frames = read_frames(out / "streams" / f"{name}.pcap")
    parser, its = _parse(job, name, _drop_first(frames, clean, whole_write=True), batch=1 << 16)
    assert_exact(its, out, job_plan(job))
    c = ev.as_dict(parser.counters)
    assert sum(c.values()) == len(_drop_first(frames, clean, whole_write=True))
    if len(clean.tables.data_flows) == 1:
        # One flow (Simple here) whose writes do not repeat: its place is unique, and a lone
        # flow's late start is no sign of a wrong plan.
        assert parser.failure is None and [it.index for it in its] == [0, 1, 2]
        return
    assert "no flow's first packet lies in the iteration's first write" in parser.failure.reason
    assert parser.locked and [it.index for it in its] == [1, 2]
    assert c["data.before_lock"] > 0
