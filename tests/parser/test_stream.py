"""The stream parser against the simulator's ground truth.

Simulated captures (``gradtap.simulator.run``) are parsed stream by stream. Every covered block must
equal the true reduced gradient, and the coverage must be exactly what NCCL's step order
gives the stream's port and direction, minus the blocks whose frames the mirror lost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader, read_pcap
from gradtap.wire import events as ev
from gradtap.wire.icrc import ICRC_LEN
from gradtap.wire.headers.opcodes import KIND_WRITE, OPCODE_KIND
from gradtap.parser.decode import decode_batch
from gradtap.parser.shared_gradient import GradientPool
from gradtap.parser.stream import StreamParser
from tests import naive
from tests.parser import naive_coverage
from tests.simulator.test_simulate import make_job, simulate
from gradtap.workload.layout import job_plan
from gradtap.workload.wire_plan import DATA, PHASE_AG
from gradtap.wire.protocol import Protocol
from tests.core.no_jit import run_without_jit

FAULTS_ALL_BUT_MIRROR_LOSS = "link_loss=0.01,corrupt=0.01,reorder=0.02,duplicate=0.02,truncate=0.01"


def parse_stream(out, job, name, batch_frames=65536, skip_frames=0, defer_icrc=False):
    parser = StreamParser(job, job_plan(job), name, defer_icrc=defer_icrc)
    its = []
    with PcapReader(out / "streams" / f"{name}.pcap", max_frames=batch_frames) as reader:
        for batch in reader:
            if skip_frames:
                cut = min(skip_frames, len(batch.offsets))
                skip_frames -= cut
                batch = batch.tail(cut)
            its += parser.feed(batch)
    return parser, its + parser.flush()


def truth_grads(out):
    manifest = json.loads((out / "truth" / "manifest.json").read_text())
    return [np.load(out / "truth" / f"iter_{it:06d}" / "grad.npy").view(np.uint8) for it in manifest["iterations"]]


def block_chunks(plan):
    """Ring chunk of every coverage block (from the allgather writes that carry it)."""
    m = plan.messages
    ag = m[(m["kind"] == DATA) & (m["phase"] == PHASE_AG) & (m["block"] >= 0)]
    chunk = np.full(len(plan.blocks), -1)
    for w in ag:
        if plan.protocols[int(w["bucket"])] == Protocol.LL128:
            n = -(-int(w["msg_bytes"]) // 2048)
        else:
            n = max(1, -(-int(w["wire_bytes"]) // plan.mtu))
        chunk[w["block"]:w["block"] + n] = w["chunk"]
    assert (chunk >= 0).all()
    return chunk


def expected_coverage(plan, mirror, n):
    chunk = block_chunks(plan)
    missing = {"egress": {(mirror.rank + 1) % n}, "ingress": {mirror.rank}, "both": set()}[mirror.direction]
    return ~np.isin(chunk, list(missing))


def assert_exact(its, out, plan):
    truths = truth_grads(out)
    b = plan.blocks
    elem = plan.elem_size
    checked = 0
    for it in its:
        truth = truths[it.index]
        for k in np.flatnonzero(it.covered):
            lo, hi = int(b["elem"][k]) * elem, int(b["elem"][k] + b["nelem"][k]) * elem
            assert it.grad[lo:hi].tobytes() == truth[lo:hi].tobytes(), (it.stream, it.index, k)
            checked += 1
    assert checked


MATRIX = [
    # n, protocol, channels, qps, mtu, ipv6, dtype
    (2, "Simple", 1, 1, 1024, False, "fp32"),
    (3, "Simple", 2, 2, 4096, True, "bf16"),
    (8, "Simple", 2, 1, 4096, False, "fp32"),
    (2, "LL", 2, 2, 1024, True, "fp32"),
    (3, "LL", 1, 1, 4096, False, "bf16"),
    (8, "LL", 2, 2, 1024, False, "bf16"),
    (2, "LL128", 1, 2, 4096, False, "bf16"),
    (3, "LL128", 2, 1, 1024, True, "fp32"),
    (8, "LL128", 2, 2, 1024, True, "fp32"),
    (3, "LL128", 2, 2, 2048, False, "bf16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("n,protocol,channels,nqps,mtu,ipv6,dtype", MATRIX)
def test_clean_streams_cover_exactly_their_chunks_and_equal_truth(tmp_path, n, protocol, channels, nqps, mtu,
                                                                   ipv6, dtype):
    job = make_job(n, protocol, channels, dtype, ipv6=ipv6, nqps=nqps, mtu=mtu)
    simulate(tmp_path, job, iterations=3)
    plan = job_plan(job)
    for mirror in job.mirrors:
        parser, its = parse_stream(tmp_path, job, mirror.name)
        assert [it.index for it in its] == [0, 1, 2]
        expected = expected_coverage(plan, mirror, n)
        for it in its:
            assert np.array_equal(it.covered, expected), (mirror.name, it.index)
        assert_exact(its, tmp_path, plan)
        c = ev.as_dict(parser.counters)
        assert not any(k.startswith("data.") and k != "data.written" for k in c), {k: v for k, v in c.items() if k.startswith("data.")}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["link_loss=0.02", "corrupt=0.02", "reorder=0.05", "duplicate=0.05",
                                   "truncate=0.02", FAULTS_ALL_BUT_MIRROR_LOSS])
@pytest.mark.parametrize("protocol", ["Simple", "LL", "LL128"])
@pytest.mark.parametrize("defer_icrc", [False, True])
def test_faults_without_mirror_loss_leave_coverage_complete_and_exact(tmp_path, fault, protocol, defer_icrc):
    job = make_job(3, protocol, 2, "fp32", nqps=2)
    simulate(tmp_path, job, iterations=3, faults=fault)
    plan = job_plan(job)
    for mirror in job.mirrors:
        # Batches smaller than an iteration: most frames come after the stream has locked on.
        parser, its = parse_stream(tmp_path, job, mirror.name, batch_frames=64, defer_icrc=defer_icrc)
        expected = expected_coverage(plan, mirror, 3)
        if "truncate" in fault:
            # A truncated frame is lost to the mirror: it may open a hole, and nothing else.
            truncated = parser.counters[ev.DECODE_FRAME_TRUNCATED]
            assert truncated > 0
            for it in its:
                assert not (it.covered & ~expected).any()
                assert (expected & ~it.covered).sum() <= truncated
        else:
            for it in its:
                assert np.array_equal(it.covered, expected), (mirror.name, fault, it.index)
        if "corrupt" in fault:
            # Stage 1 finds every bad ICRC the independent decoder finds. So does stage 2
            # (defer_icrc, once locked), but for reduce-scatter data that follows its flow's
            # previous frame, which it takes unchecked: its payload is never read.
            path = tmp_path / "streams" / f"{mirror.name}.pcap"
            scattered, others = naive_coverage.bad_icrcs(path, job, plan, naive_coverage.first_psns(path, job, plan))
            counted = parser.counters[ev.DECODE_ICRC_BAD]
            assert scattered + others > 0
            if defer_icrc:
                assert others <= counted <= others + scattered, (counted, others, scattered)
            else:
                assert counted == others + scattered
        assert_exact(its, tmp_path, plan)


def _damaged(frames: FrameBatch, damage: list[int], drop: list[int]) -> FrameBatch:
    """``frames`` with the last payload byte of each frame of ``damage`` flipped (the ICRC
    then fails, as the simulator's ``corrupt`` makes it) and the frames of ``drop`` left out."""
    data = np.array(frames.data)
    for i in damage:
        data[frames.offsets[i] + frames.caplens[i] - ICRC_LEN - 1] ^= 0x01
        f, _ = naive.decode_frame(bytes(data[frames.offsets[i]:frames.offsets[i] + frames.caplens[i]]))
        assert not f["icrc_ok"]
    keep = np.setdiff1d(np.arange(len(frames)), drop)
    return FrameBatch(data, frames.offsets[keep], frames.caplens[keep], frames.wirelens[keep], frames.ts_ns[keep])


@pytest.mark.parametrize("defer_icrc", [False, True])
def test_only_reduce_scatter_data_in_sequence_is_taken_without_its_icrc(tmp_path, defer_icrc):
    """Stage 2 (``defer_icrc``) takes a reduce-scatter frame that follows its flow's previous
    frame unchecked: its payload is never read, and it teaches the stream nothing a sound frame
    would not (``other.reduce_scatter``). Damaged allgather data, and damaged reduce-scatter
    data that does not follow its flow's previous frame, are ``decode.icrc_bad`` and teach
    nothing. Stage 1 counts all three as ``decode.icrc_bad``."""
    job = make_job(3, "Simple", 1, "fp32")
    simulate(tmp_path, job, iterations=3)
    plan = job_plan(job)
    name = job.mirrors[0].name
    path = tmp_path / "streams" / f"{name}.pcap"
    # Per phase, the middle packets of iteration 1's writes, with their flow's frame before them.
    middle: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    last: dict[tuple, int] = {}
    for i, (_, f, placed) in enumerate(naive_coverage.positions(path, job, plan,
                                                                naive_coverage.first_psns(path, job, plan))):
        if placed is None:
            continue
        flow = f["ip_src"], f["ip_dst"], f["dest_qp"]
        it, w, k = placed
        if it == 1 and 0 < k < int(w["npkts"]) - 1:
            middle[bool(w["phase"] == PHASE_AG)].append((i, last[flow]))
        last[flow] = i
    (rs, rs_before), (rs_apart, rs_apart_before), (ag, _) = middle[False][5], middle[False][-5], middle[True][5]
    clean = read_pcap(path)

    def parse(frames):
        parser = StreamParser(job, plan, name, defer_icrc=defer_icrc)
        its = []
        for lo in range(0, len(frames), 64):      # most frames after the stream has locked on
            its += parser.feed(frames.frames(lo, lo + 64))
        return ev.as_dict(parser.counters), its + parser.flush()

    want, want_its = parse(clean)
    got, its = parse(_damaged(clean, [rs, rs_apart, ag], drop=[rs_apart_before]))
    assert len({rs, rs_before, rs_apart, rs_apart_before, ag}) == 5
    lost = {"decode.icrc_bad": 2 if defer_icrc else 3,             # rs_apart, ag, and rs in stage 1
            "other.reduce_scatter": -2 if defer_icrc else -3,      # the frame left out, rs_apart, rs in stage 1
            "data.written": -1}                                    # ag
    assert got == {k: v for k, v in ((k, want.get(k, 0) + lost.get(k, 0)) for k in want.keys() | lost.keys()) if v}
    assert [it.index for it in its] == [it.index for it in want_its] == [0, 1, 2]
    assert int(want_its[1].covered.sum()) - int(its[1].covered.sum()) == 1      # ag's block
    assert_exact(its, tmp_path, plan)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["Simple", "LL", "LL128"])
@pytest.mark.parametrize("faults", ["mirror_loss=0.05", "mirror_loss=0.03," + FAULTS_ALL_BUT_MIRROR_LOSS])
def test_mirror_loss_leaves_holes_exactly_where_frames_were_dropped(tmp_path, protocol, faults):
    """Coverage equals what the slow twin finds in the same capture, and a clean run's
    coverage shrinks only where that capture lost frames."""
    job = make_job(3, protocol, 2, "fp32", mtu=1024, nqps=2)
    simulate(tmp_path / "clean", job, iterations=2)
    simulate(tmp_path / "lossy", job, iterations=2, faults=faults)
    plan = job_plan(job)
    holes = 0
    for mirror in job.mirrors:
        first = naive_coverage.first_psns(tmp_path / "clean" / "streams" / f"{mirror.name}.pcap", job, plan)
        expected = naive_coverage.coverage(tmp_path / "lossy" / "streams" / f"{mirror.name}.pcap", job, plan,
                                           first, 2)
        _, clean = parse_stream(tmp_path / "clean", job, mirror.name)
        _, lossy = parse_stream(tmp_path / "lossy", job, mirror.name)
        assert [it.index for it in lossy] == [0, 1]
        for c, l in zip(clean, lossy):
            assert np.array_equal(l.covered, expected[l.index]), (mirror.name, l.index)
            assert not (l.covered & ~c.covered).any()
            holes += int((c.covered & ~l.covered).sum())
        assert_exact(lossy, tmp_path / "lossy", plan)
    assert holes > 0


@pytest.mark.slow
def test_lock_on_mid_iteration_waits_for_the_next_boundary_and_says_so(tmp_path, caplog):
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path, job, iterations=3)
    plan = job_plan(job)
    total = len(read_pcap(tmp_path / "streams" / "m-both.pcap").offsets)
    with caplog.at_level(logging.INFO, logger="gradtap.parser.stream"):
        parser, its = parse_stream(tmp_path, job, "m-both", batch_frames=64, skip_frames=total // 6)
    assert "locked on an iteration boundary" in caplog.text
    # The capture now begins inside iteration 0, so the first whole one is iteration 1.
    assert [it.index for it in its] == [1, 2]
    for it in its:
        assert it.covered.all()
    assert_exact(its, tmp_path, plan)
    assert parser.counters[ev.DATA_BEFORE_LOCK] > 0


@pytest.mark.slow
def test_a_late_copy_of_a_retired_iteration_moves_nothing(tmp_path):
    """One iteration is assembled at a time: the first write after the pause retires the one
    before. Copies of that iteration's last writes arriving after it (a mirror that reordered
    across the pause, which real ones do not) are counted and change nothing."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path, job, iterations=3)
    plan = job_plan(job)
    name = "m-both"
    frames = read_pcap(tmp_path / "streams" / f"{name}.pcap")

    def parse(batch):
        parser = StreamParser(job, plan, name)
        its = []
        for lo in range(0, len(batch), 64):
            its += parser.feed(batch.frames(lo, lo + 64))
        return parser, its + parser.flush()

    clean, clean_its = parse(frames)
    # The writes of the stream's data flows (their QPNs learnt by the clean parse).
    t = clean.tables
    recs, _ = decode_batch(frames)
    flows = {(int(t.qpn[f]), t.src_ip[f].tobytes(), t.dst_ip[f].tobytes()) for f in t.data_flows}
    writes = np.array([i for i, r in enumerate(recs) if r["event"] == ev.DECODE_OK
                       and OPCODE_KIND[r["opcode"]] == KIND_WRITE
                       and (int(r["dest_qp"]), r["src_ip"].tobytes(), r["dst_ip"].tobytes()) in flows])
    # The pauses: before iteration 0 (after the end of the one the capture began in), 1 and 2.
    pause = int(np.flatnonzero(np.diff(frames.ts_ns) >= job.appliance.iteration_gap_ns)[1])
    late = writes[writes <= pause][-5:]
    first_of_next = int(writes[writes > pause][0])
    order = np.r_[np.arange(first_of_next + 1), late, np.arange(first_of_next + 1, len(frames))]
    ts = frames.ts_ns[order].copy()
    ts[first_of_next + 1:first_of_next + 1 + len(late)] = frames.ts_ns[first_of_next] + 1
    reordered = FrameBatch(frames.data, frames.offsets[order], frames.caplens[order], frames.wirelens[order], ts,
                           frames.linktype, lasting=True)

    parser, its = parse(reordered)
    assert [it.index for it in its] == [it.index for it in clean_its] == [0, 1, 2]
    for a, b in zip(its, clean_its):
        assert np.array_equal(a.covered, b.covered) and a.covered.any()
    assert_exact(its, tmp_path, plan)
    late_counted = parser.counters[ev.DATA_OUT_OF_WINDOW] + parser.counters[ev.DATA_IMPLAUSIBLE_PSN]
    assert late_counted == len(late) == 5
    assert clean.counters[ev.DATA_OUT_OF_WINDOW] == clean.counters[ev.DATA_IMPLAUSIBLE_PSN] == 0
    assert parser.counters.sum() == clean.counters.sum() + len(late)


@pytest.mark.slow
@pytest.mark.parametrize("agrees", [True, False], ids=["claimer-agrees", "claimer-differs"])
def test_copies_pending_in_an_iteration_retired_mid_round_are_compared_with_the_round(tmp_path, agrees):
    """Another stream has claimed every unit of iteration 1 this stream holds and writes them
    only after this stream has placed its copies (kept pending) and retired the iteration, in
    the same round. reconcile() at the end of the round compares them too: copies that agree
    are dropped and covered, so the stream's bucket is the shared bytes themselves (a view,
    not a copy of the bucket with its copies laid over); one that differs stays for the vote,
    counted as set aside instead of written."""
    job = make_job(3, "Simple", 2, "fp32")
    simulate(tmp_path, job, iterations=3)
    plan = job_plan(job)
    name = "m-both"
    frames = read_pcap(tmp_path / "streams" / f"{name}.pcap")
    clean = StreamParser(job, plan, name)
    clean_its = clean.feed(frames) + clean.flush()
    pool = GradientPool(plan.grad_bytes, len(plan.blocks), 3)
    claimed = pool.enter(1)                  # the other stream's hold on iteration 1
    mine = clean_its[1].got
    claimed.claim[:] = mine
    parser = StreamParser(job, plan, name, pool=pool)
    its = parser.feed(frames)
    assert [it.index for it in its] == [0, 1]
    held = its[1].aside
    assert len(held) == np.count_nonzero(mine) and held.rec["pending"].all()
    assert parser.counters[ev.DATA_WRITTEN] == clean.counters[ev.DATA_WRITTEN]

    claimed.grad[:] = clean_its[1].grad      # the other stream writes its copies, equal to this one's
    wrong = int(np.flatnonzero(mine)[0])
    lo = int(plan.blocks["elem"][wrong]) * plan.elem_size
    if not agrees:
        claimed.grad[lo] ^= 1
    claimed.written[:] = mine
    parser.reconcile()

    whole = np.arange(len(plan.blocks))
    data, covered = its[1].bucket(0, plan.grad_bytes, whole, its[1].need)
    if agrees:
        assert len(its[1].aside) == 0 and np.array_equal(its[1].got, mine)
        assert np.shares_memory(data, claimed.grad), "nothing aside: the bucket is the shared bytes"
        assert np.array_equal(parser.counters, clean.counters)
    else:
        assert len(its[1].aside) == 1 and not its[1].aside.rec["pending"].any()
        assert its[1].got[wrong] == 0 and np.array_equal(np.delete(its[1].got, wrong), np.delete(mine, wrong))
        assert data[lo] == clean_its[1].grad[lo] != claimed.grad[lo], "the stream's own copy, for the vote"
        assert parser.counters[ev.DATA_WRITTEN] == clean.counters[ev.DATA_WRITTEN] - 1
        assert parser.counters[ev.DATA_SET_ASIDE] == clean.counters[ev.DATA_SET_ASIDE] + 1
    assert covered.tolist() == clean_its[1].covered.tolist()
    assert_exact([its[1]], tmp_path, plan)


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True], ids=["icrc-in-stage-1", "icrc-in-stage-2"])
@pytest.mark.parametrize("protocol, encapsulation", [("Simple", "none"), ("LL128", "none"), ("Simple", "erspan3")])
def test_a_batch_parsed_in_cache_sized_pieces_gives_what_it_gives_whole(tmp_path, protocol, encapsulation, defer,
                                                                         monkeypatch):
    """With the ICRC checked, in stage 1 or (``defer_icrc``) in stage 2, a batch of a locked
    stream larger than ``piece_bytes`` is parsed in pieces (``parser/pieces.py``: so that
    stage 2 finds in the cache what stage 1 read): the counters, the coverage and every byte
    equal those of the batch parsed whole, on a faulty stream, plain or arriving over ERSPAN.
    With the check in stage 2, stage 1 decodes each piece on the calling thread (one part)."""
    import gradtap.parser.stream as stream
    from gradtap.parser.pieces import parse_pieces
    from tests.simulator.test_erspan import with_encapsulation
    job = with_encapsulation(make_job(3, protocol, 2, "fp32", nqps=2), {"m-both": encapsulation})
    simulate(tmp_path, job, iterations=3, faults="mirror_loss=0.02," + FAULTS_ALL_BUT_MIRROR_LOSS)
    plan = job_plan(job)
    frames = read_pcap(tmp_path / "streams" / "m-both.pcap")
    calls = {}          # piece_bytes -> (start, frames per piece, stage 1's parts) of every call of the compiled loop
    runs = {}
    for piece_bytes in (0, 1000):
        made = calls.setdefault(piece_bytes, [])
        monkeypatch.setattr(stream, "parse_pieces", lambda *a, inner=parse_pieces, made=made: made.append(
            (a[9], a[10], len(a[8]))) or inner(*a))
        parser = StreamParser(job, plan, "m-both", piece_bytes=piece_bytes, defer_icrc=defer)
        its = [it for lo in range(0, len(frames), 64) for it in parser.feed(frames.frames(lo, lo + 64))]
        runs[piece_bytes] = (parser, its + parser.flush())
    (whole, whole_its), (pieces, piece_its) = runs[0], runs[1000]
    # Whole batches never went through the loop. In pieces, the batches after lock-on did, a
    # frame or two at a time (1000 bytes; the frames are some 600), and where an iteration
    # ended inside one, the loop stopped there and was called again from that frame.
    assert calls[0] == [] and len(calls[1000]) > len(frames) // 64 // 2, calls
    assert {p for _, p, _ in calls[1000]} <= {1, 2} and any(start > 0 for start, _, _ in calls[1000]), calls
    if defer:
        assert {parts for _, _, parts in calls[1000]} == {1}, calls
    assert np.array_equal(pieces.counters, whole.counters)
    assert [it.index for it in piece_its] == [it.index for it in whole_its] == [0, 1, 2]
    for a, b in zip(piece_its, whole_its):
        assert np.array_equal(a.covered, b.covered)
    assert_exact(piece_its, tmp_path, plan)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["Simple", "LL128"])
def test_a_stream_alone_copies_after_placing_what_it_would_copy_in_place(tmp_path, protocol, monkeypatch):
    """A parser alone leaves Simple's payload copies to every thread after the kernel
    (``parser/payload.py``): on a faulty stream (duplicates among the faults, which compare
    with copies still pending), the counters, the coverage and every byte equal those of
    a parser that copies as it places."""
    import gradtap.parser.stream as stream
    job = make_job(3, protocol, 2, "fp32", nqps=2)
    simulate(tmp_path, job, iterations=3, faults="mirror_loss=0.02," + FAULTS_ALL_BUT_MIRROR_LOSS)
    plan = job_plan(job)
    frames = read_pcap(tmp_path / "streams" / "m-both.pcap")
    deferred = []
    monkeypatch.setattr(stream, "copy_deferred",
                        lambda pending, data, grads, copy=stream.copy_deferred:
                        deferred.append(int(pending.count[0])) or copy(pending, data, grads))
    runs = {}
    for alone in (False, True):
        parser = StreamParser(job, plan, "m-both", alone=alone)
        its = [it for lo in range(0, len(frames), 400) for it in parser.feed(frames.frames(lo, lo + 400))]
        runs[alone] = (parser, its + parser.flush(), sum(deferred))
    (inline, inline_its, none), (alone, alone_its, copies) = runs[False], runs[True]
    assert none == 0 and (copies > 0 if protocol == "Simple" else copies == 0)
    assert alone.counters[ev.DATA_DUPLICATE] > 0
    assert np.array_equal(alone.counters, inline.counters)
    assert [it.index for it in alone_its] == [it.index for it in inline_its] == [0, 1, 2]
    for a, b in zip(alone_its, inline_its):
        assert np.array_equal(a.covered, b.covered)
    assert_exact(alone_its, tmp_path, plan)


def test_bad_stream_name_is_a_config_error():
    from gradtap.core.errors import ConfigError
    job = make_job(2, "LL", 1, "fp32")
    with pytest.raises(ConfigError, match="not in the job"):
        StreamParser(job, job_plan(job), "nope")


def no_jit_job(protocol):
    """A small job whose streams every protocol's stage 2 handles in seconds without the JIT."""
    return make_job(2, protocol, 1, "fp32", mtu=1024)


def parse_summary(out, job) -> dict:
    """Per stream: the event counters and, per iteration, its coverage and a hash of the
    whole gradient array; the covered blocks are checked against the truth on the way. In
    small batches with the ICRC deferred, so that stage 2 checks most frames' ICRC."""
    plan = job_plan(job)
    summary = {}
    for mirror in job.mirrors:
        parser, its = parse_stream(out, job, mirror.name, batch_frames=64, defer_icrc=True)
        assert its
        assert_exact(its, out, plan)
        summary[mirror.name] = {"counters": ev.as_dict(parser.counters), "iterations": [
            [it.index, it.covered.tolist(), hashlib.sha256(it.grad.tobytes()).hexdigest()] for it in its]}
    return summary


NO_JIT_PARSE = """
import json, sys
from pathlib import Path
from tests.parser.test_stream import no_jit_job, parse_summary
print(json.dumps({p: parse_summary(Path(sys.argv[1]) / p, no_jit_job(p)) for p in sys.argv[2:]}))
"""


@pytest.mark.slow
def test_without_jit_stage2_is_bit_exact(tmp_path):
    """Stage 1 and 2 (lock-on, assembly kernel, retirement) run as plain Python under
    NUMBA_DISABLE_JIT=1 on faulty streams of every protocol, and give the compiled parser's
    counters, coverage and bytes."""
    protocols = [p.nccl_name for p in Protocol]
    for p in protocols:
        simulate(tmp_path / p, no_jit_job(p), iterations=2, faults="mirror_loss=0.03," + FAULTS_ALL_BUT_MIRROR_LOSS)
    plain = run_without_jit(NO_JIT_PARSE, str(tmp_path), *protocols)
    compiled = {p: parse_summary(tmp_path / p, no_jit_job(p)) for p in protocols}
    assert json.loads(plain) == json.loads(json.dumps(compiled))


def refcount_job(protocol):
    """A 3-rank job whose first stream has a few hundred frames per iteration."""
    return make_job(3, protocol, 1, "fp32")


NO_REFCOUNT_PARSE = """
import ctypes, os, sys
from pathlib import Path
from gradtap.capture.pcap import read_pcap
from gradtap.parser.stream import StreamParser
from gradtap.workload.layout import job_plan
from tests.parser.test_stream import refcount_job
libc = ctypes.CDLL(None)

def mark(text):
    libc.fflush(None)               # NRT's debug lines go through C stdio
    os.write(1, text.encode() + b"\\n")

for protocol in sys.argv[2:]:
    job = refcount_job(protocol)
    name = job.mirrors[0].name
    frames = read_pcap(Path(sys.argv[1]) / protocol / "streams" / f"{name}.pcap")
    parser = StreamParser(job, job_plan(job), name, defer_icrc=True)     # stage 2 checks the ICRC
    cut = len(frames) // 2
    parser.feed(frames.frames(0, cut))
    assert parser.locked
    mark(f"start {protocol} {len(frames) - cut}")
    parser.feed(frames.frames(cut))
    mark("end")
"""


@pytest.mark.slow
def test_stage2_takes_no_reference_per_frame(tmp_path):
    """Stage 2 runs without Numba's reference counting (``core/jit.py``, ``JIT_NO_REFCOUNT``):
    with ``NUMBA_DEBUG_NRT=1``, which prints every reference taken, a locked stream's frames
    of every protocol (faults included, so that duplicates, conflicts and copies kept aside
    run too) take fewer than one per 10 frames. With reference counting they took 11 per
    frame here (40 on the GPT-2-small stream), each an atomic instruction."""
    protocols = [p.nccl_name for p in Protocol]
    for p in protocols:
        simulate(tmp_path / p, refcount_job(p), iterations=6, faults="mirror_loss=0.03," + FAULTS_ALL_BUT_MIRROR_LOSS)
    env = {**os.environ, "NUMBA_DEBUG_NRT": "1", "PYTHONPATH": "."}
    out = subprocess.run([sys.executable, "-c", NO_REFCOUNT_PARSE, str(tmp_path), *protocols], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    sections = out.stdout.split("\nstart ")[1:]
    assert len(sections) == len(protocols)
    for section in sections:
        head, body = section.split("\n", 1)
        protocol, frames = head.split()
        taken = body.split("\nend\n")[0].count("NRT_Incref")
        assert int(frames) > 200
        assert taken < int(frames) / 10, f"{protocol}: {taken} references taken for {frames} frames"
