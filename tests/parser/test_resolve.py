"""``nccl.era: auto`` and ``nccl.protocol: auto``: the job's era and per-bucket protocols read
from the wire (``parser/resolve.py``), on the real captures and on simulated traffic of every
era with buckets in all three protocols, replayed bit-exactly against the simulator's truth."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.merger.merger import IterationReport
from gradtap.parser.decode import decode_batch
from gradtap.parser.line_format import UNDECIDED, packet_protocols
from gradtap.parser.resolve import Resolver
from gradtap.parser.stream import StreamParser
from gradtap.pipeline import Pipeline
from gradtap.replay import run_replay
from gradtap.verify import verify
from gradtap.wire.frame_record import FRAME_DTYPE
from gradtap.wire.protocol import Protocol
from gradtap.workload.layout import job_buckets, job_params, job_plan
from gradtap.workload.spec import SUPPORTED_ERAS
from gradtap.workload.tuner import tuned
from gradtap.workload.wire_plan import build_plan
from tests import naive
from tests.frame_edits import bth_offset, read_frames, resign, write_frames
from tests.golden import CAPTURES
from tests.gradtap.test_mixed_protocols import ITERATIONS, PROTOCOLS, mixed_job
from tests.gradtap.test_replay import start_of, streams_of
from tests.parser.test_real_captures import COUNT, EXPECTED, GOLDEN, job as real_job
from tests.simulator.test_simulate import check_allgather_matches_truth, make_job, simulate


def auto(job, era="auto", protocol="auto", **ddp):
    nccl = job.nccl.model_copy(update={"era": era, "protocol": protocol, "protocols": None})
    return job.model_copy(update={"nccl": nccl, "ddp": job.ddp.model_copy(update=ddp)})


def records_of(payloads: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Records whose payloads are ``payloads``, packed one after another in one buffer."""
    data = np.frombuffer(b"".join(payloads), np.uint8).copy()
    recs = np.zeros(len(payloads), FRAME_DTYPE)
    recs["payload_len"] = [len(p) for p in payloads]
    recs["payload_off"] = np.r_[0, np.cumsum(recs["payload_len"])[:-1]]
    return recs, data


def ll_encode(data: bytes, flag: int) -> bytes:
    """LL as prims_ll.h storeLL writes it: ``data1 flag data2 flag`` per 16-byte line."""
    words = struct.unpack(f"<{len(data) // 4}I", data)
    return b"".join(struct.pack("<IIII", words[i], flag, words[i + 1], flag) for i in range(0, len(words), 2))


def test_each_packet_says_its_protocol():
    rng = random.Random(7)
    gradient = bytes(rng.randrange(256) for _ in range(1920))
    payloads = [ll_encode(gradient[:512], 5), naive.encode_ll128(gradient, 9)[:1024], gradient[:1024],
                bytes(1024),                       # zeros: no flag (flags are step + 1, never 0)
                b"\x01\x00\x00\x00" * 256,         # constant words show LL's flags (see line_format)
                gradient[:64]]                      # under one 128-byte line: undecided
    recs, data = records_of(payloads)
    assert packet_protocols(recs, data).tolist() == [Protocol.LL, Protocol.LL128, Protocol.SIMPLE, Protocol.SIMPLE,
                                                     Protocol.LL, UNDECIDED]


def test_a_payload_reaching_outside_the_bytes_is_undecided():
    recs, data = records_of([bytes(range(256)) * 4])
    recs["payload_off"] = len(data) - 128
    assert packet_protocols(recs, data).tolist() == [UNDECIDED]


def test_a_walk_over_thousands_of_buckets():
    """A large model has thousands of buckets: the walk goes bucket by bucket (no recursion)
    and finds the one assignment its packets allow."""
    from gradtap.parser.resolve import _FlowShape, _walk, _WireIteration

    nb = 5000
    simple, ll = np.full(nb, 2, np.int64), np.full(nb, 4, np.int64)
    writes = [(np.zeros(1, np.int64), np.zeros(1, np.int64))] * nb
    shapes = {Protocol.SIMPLE: _FlowShape(simple, writes), Protocol.LL: _FlowShape(ll, writes)}
    expect = [Protocol.LL if b % 7 == 0 else Protocol.SIMPLE for b in range(nb)]
    sizes = np.array([4 if p == Protocol.LL else 2 for p in expect])
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    it = _WireIteration(key=0, positions=starts, classes=np.array([int(p) for p in expect]),
                        write_at=np.zeros(0, np.int64), write_bytes=np.zeros(0, np.int64),
                        period=(int(sizes.sum()), int(sizes.sum())))
    assert _walk(shapes, it, lengths=False) == [tuple(int(p) for p in expect)]


def resolve_capture(job, path):
    r = Resolver(job, ["port"], job.appliance.iteration_gap_ns)
    with PcapReader(path) as reader:
        for batch in reader:
            recs, _ = decode_batch(batch, True)
            r.observe("port", recs, batch.data)
    return r, r.decide(final=True)


@pytest.mark.parametrize("protocol", ["LL", "auto"])
@pytest.mark.parametrize("name,ar", GOLDEN)
def test_real_captures_resolve_to_nccl_2_19_with_ll(name, ar, protocol):
    """The real allreduces are NCCL 2.19 LL (``../shared/captures/README.md``); the job read from
    the wire then recovers every element, with no QPN given."""
    spec = auto(real_job(adaptive_routing=ar), protocol=protocol, layout="initial")
    r, found = resolve_capture(spec, CAPTURES / name)
    assert found is not None, r.detail("port")
    assert found.job.nccl.era == "2.19" and found.eras == ("2.19",) and found.protocols == ("LL",)
    parser = StreamParser(found.job, build_plan(found.job, [COUNT]), "port")
    out = []
    with PcapReader(CAPTURES / name) as reader:
        for batch in reader:
            out += parser.feed(batch)
    out += parser.flush()
    assert out and out[0].covered.all() and np.array_equal(out[0].grad.view(np.int32), EXPECTED)


def replay_auto(tmp_path, era, **replay):
    job = mixed_job(era)
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    result, sink = run_replay(auto(job), streams_of(tmp_path / "sim", job), tmp_path / "replay",
                              start_of(tmp_path / "sim"), **replay)
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    return job, result, sink, events


@pytest.mark.slow
@pytest.mark.parametrize("era", SUPPORTED_ERAS)
def test_every_era_with_buckets_in_every_protocol_is_read_from_the_wire(tmp_path, era):
    """Era and protocols both ``auto``: the wire gives the buckets' protocols (LL, Simple,
    LL128 in launch order) and an era that sends exactly as the simulated one, and the replay
    equals the simulator's truth bit for bit, with no mismatch counted."""
    job, result, sink, events = replay_auto(tmp_path, era)
    check_allgather_matches_truth(tmp_path / "sim", job, ITERATIONS)
    resolved = [e for e in events if e["event"] == "job.resolved"]
    assert len(resolved) == 1 and resolved[0]["protocols"] == PROTOCOLS and era in resolved[0]["eras"], resolved
    chosen = job.model_copy(update={"nccl": job.nccl.model_copy(update={"era": resolved[0]["era"]})})
    assert np.array_equal(job_plan(chosen).messages, job_plan(job).messages), "the era taken sends the same"
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale and v.digests_checked, v
    for stream, counts in result.counters.items():
        assert not {k: n for k, n in counts.items() if "mismatch" in k and n}, (stream, counts)
        assert sum(counts.values()) == result.frames[stream], "every frame ends in exactly one event counter"


@pytest.mark.slow
@pytest.mark.parametrize("era", ["2.19", "2.23", "2.30"])
def test_the_tuners_choice_is_read_back_from_the_wire(tmp_path, era):
    """``protocol: auto`` end to end: the simulator sends each bucket in the protocol its model
    of NCCL's tuner picks (``workload/tuner.py``), and the appliance, told nothing but
    ``auto``, reads the same choice and the era back from the wire and replays bit-exactly."""
    job = make_job(3, "auto", era=era, tuner={"graph_channels": 1, "graph_bw": 0.5, "ll128": False})
    job = job.model_copy(update={"ddp": job.ddp.model_copy(update={"bucket_cap_mb": 0.004})})
    chosen = tuned(job, [b.numel for b in job_buckets(job)]).nccl.protocols
    assert len(set(chosen)) == 2
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    result, sink = run_replay(auto(job), streams_of(tmp_path / "sim", job), tmp_path / "replay",
                              start_of(tmp_path / "sim"))
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    resolved = [e for e in events if e["event"] == "job.resolved"]
    assert resolved and tuple(resolved[0]["protocols"]) == chosen and era in resolved[0]["eras"]
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale and v.digests_checked, v


@pytest.mark.slow
def test_eras_that_send_the_same_bytes_with_other_elements_are_refused(tmp_path):
    """One LL128 call of 7210 elements: NCCL 2.22 and 2.23+ cut it into per-channel ranges at
    other elements, yet both fill the same 6144-byte messages (padded LL128 lines). The wire
    cannot tell them apart, so the appliance stops and asks for nccl.era rather than guess."""
    job = make_job(3, "LL128", 2, "fp32", era="2.24")
    simulate(tmp_path / "sim", job, iterations=3)
    result, sink = run_replay(auto(job), streams_of(tmp_path / "sim", job), tmp_path / "replay",
                              start_of(tmp_path / "sim"))
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "lockon.failed"]
    assert failed and not any(result.locked.values()) and not sink.applied
    assert all("2.22" in e["reason"] and "carry different elements" in e["reason"] and "nccl.era" in e["reason"]
               for e in failed), failed


@pytest.mark.slow
def test_a_job_the_wire_does_not_fit_is_loud(tmp_path):
    """A job spec with a channel the traffic does not have: no era and no protocols fit; every
    stream fails lock-on with the resolver's reason, nothing is applied, and every frame is
    counted."""
    job = mixed_job("2.22")
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    other = auto(job)
    other = other.model_copy(update={"nccl": other.nccl.model_copy(update={"channels": 3})})
    result, sink = run_replay(other, streams_of(tmp_path / "sim", job), tmp_path / "replay",
                              start_of(tmp_path / "sim"), force=True)
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    failed = {e["stream"]: e for e in events if e["event"] == "lockon.failed"}
    assert set(failed) == set(result.locked) and not any(result.locked.values())
    assert all(e["what"] == "job not resolved from the wire" and "nccl.era and nccl.protocols" in e["reason"]
               for e in failed.values()), failed
    assert not sink.applied
    for stream, counts in result.counters.items():
        assert sum(counts.values()) == result.frames[stream] and counts.get("other.unresolved", 0) > 0


@pytest.mark.slow
def test_a_bucket_whose_packets_say_nothing_is_still_read(tmp_path):
    """A bucket of ten elements travels in writes of a few bytes, too short to show LL's
    flags: no packet of the iteration is LL, yet only LL's write lengths fit that bucket."""
    base = mixed_job("2.26", protocols=("LL", "Simple", "Simple"))
    job = base.model_copy(update={"ddp": base.ddp.model_copy(update={"layout": "explicit", "buckets": (
        ("layers.4.bias",), ("layers.4.weight", "layers.2.bias", "layers.2.weight"),
        ("layers.0.bias", "layers.0.weight"))})})
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    result, sink = run_replay(auto(job), streams_of(tmp_path / "sim", job), tmp_path / "replay",
                              start_of(tmp_path / "sim"))
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    resolved = [e for e in events if e["event"] == "job.resolved"]
    assert resolved and resolved[0]["protocols"] == ["LL", "Simple", "Simple"], events
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale and v.digests_checked, v


@pytest.mark.slow
def test_request_ids_in_immdt_are_refused_by_name(tmp_path):
    """NCCL 2.30's ID-based receive matching writes a request ID into ImmDt, not the size: an
    appliance reading the era from the wire says so at lock-on instead of guessing."""
    job = mixed_job("2.30")
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    frames = read_frames(streams_of(tmp_path / "sim", job)["m-egress"])
    request = 0
    for i, (frame, ts) in enumerate(frames):
        bth = bth_offset(frame)
        if bth is None or frame[bth] not in (0x09, 0x0B):
            continue
        edited = bytearray(frame)
        struct.pack_into("!I", edited, bth + 12 + (16 if frame[bth] == 0x0B else 0), request % 32)
        request += 1
        frames[i] = (resign(edited), ts)
    write_frames(tmp_path / "ids.pcap", frames)
    result, _ = run_replay(auto(job), {"m-egress": tmp_path / "ids.pcap"}, tmp_path / "replay",
                           start_of(tmp_path / "sim"))
    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "lockon.failed"]
    assert failed and "NCCL_IB_OOO_RQ" in failed[0]["reason"] and not result.locked["m-egress"], failed


class _Collect:
    def __init__(self):
        self.done: list[int] = []

    def bucket(self, iteration, bucket, data):
        pass

    def iteration_done(self, iteration: int, report: IterationReport):
        if report.recovered:
            self.done.append(iteration)


@pytest.mark.slow
def test_frames_held_past_the_bound_are_counted_and_later_iterations_recovered(tmp_path):
    job = mixed_job("2.26")
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    streams = streams_of(tmp_path / "sim", job)
    sink = _Collect()
    pipeline = Pipeline(auto(job), None, list(streams), sink, first_iteration=0, hold_bytes=1)
    frames = {}
    try:
        readers = {n: PcapReader(p, max_frames=512) for n, p in streams.items()}
        batches = {n: list(r) for n, r in readers.items()}
        for r in readers.values():
            r.close()
        for k in range(max(map(len, batches.values()))):
            pipeline.round({n: b[k] for n, b in batches.items() if k < len(b)})
        pipeline.finish()
        frames = {n: sum(len(x.offsets) for x in b) for n, b in batches.items()}
    finally:
        pipeline.close()
    assert pipeline.resolved and sink.done and max(sink.done) == ITERATIONS - 1
    for name, counts in pipeline.counters().items():
        assert counts["other.unresolved"] > 0 and sum(counts.values()) == frames[name]


def test_hostile_frames_neither_crash_nor_resolve():
    """Bit flips, cuts and random bytes between the ring's addresses: the resolver answers."""
    spec = auto(real_job(), layout="initial")
    rng = np.random.default_rng(3)
    frames = [frame for _, frame in naive.read_capture(CAPTURES / "allreduce+p2p.pcapng")]
    mutated = []
    for frame in frames:
        b = bytearray(frame)
        kind = rng.integers(4)
        if kind == 0 and len(b) > 60:
            b[rng.integers(54, len(b))] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            b = b[:int(rng.integers(1, len(b) + 1))]
        elif kind == 2:
            b = bytearray(rng.integers(0, 256, len(b), dtype=np.uint8).tobytes())
        mutated.append(bytes(b))
    batch = FrameBatch.from_frames(mutated, ts_ns=np.arange(len(mutated), dtype=np.int64) * 1000)
    r = Resolver(spec, ["port"], spec.appliance.iteration_gap_ns)
    recs, _ = decode_batch(batch, True)
    r.observe("port", recs, batch.data)
    r.decide(final=True)
    assert isinstance(r.detail("port"), str)
