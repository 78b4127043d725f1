"""The fault matrix: one simulated job (``configs/small.yaml``, three mirror streams), replayed
under every capture fault on one, two and all three streams.

Each fault rewrites the frames of a real capture file the way a lossy or hostile mirror link
would (``tests/frame_edits.py``: the tests' own byte offsets and, where a fault must keep the
ICRC valid, the plain ICRC of ``tests/wire/naive_icrc.py``). For every cell:

- the replica is never silently wrong: every iteration it applied equals the trainer's, bit
  for bit (``gradtap.verify``), and every iteration it did not apply follows a ``fallback``
  event; when no stream can lock on, each says why (``lockon.failed``) and nothing is applied;
- a fault on one stream loses nothing (the other two cover every block), whatever it does
  to that stream: a stream's faults never make the merge worse than leaving it out;
- every frame ends in exactly one event counter.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from gradtap.replay import run_replay
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from gradtap.workload.spec import load_job
from tests.frame_edits import WRITE_FIRST, bth_offset, fix_ip_checksum, read_frames, resign, write_frames, \
    writes
from tests.gradtap.test_replay import start_of, streams_of

ROOT = Path(__file__).resolve().parents[2]
def drop_every_10th_write(frames, rng):
    doomed = set(writes(frames)[9::10])
    return [f for i, f in enumerate(frames) if i not in doomed]


def drop_every_2nd_write_first(frames, rng):
    firsts = [i for i in writes(frames) if frames[i][0][bth_offset(frames[i][0])] == WRITE_FIRST]
    doomed = set(firsts[1::2])
    return [f for i, f in enumerate(frames) if i not in doomed]


def _every_10th(edit):
    def fault(frames, rng):
        out = list(frames)
        for i in writes(frames)[9::10]:
            frame = bytearray(frames[i][0])
            edit(frame)
            out[i] = (bytes(frame), frames[i][1])
        return out
    fault.__name__ = edit.__name__
    return fault


@_every_10th
def bad_icrc(frame):
    frame[-1] ^= 0x5A


@_every_10th
def udp_length_lies(frame):
    udp = 14 + (frame[14] & 0x0F) * 4
    struct.pack_into("!H", frame, udp + 4, struct.unpack_from("!H", frame, udp + 4)[0] + 8)


@_every_10th
def ip_total_length_plus_50(frame):
    struct.pack_into("!H", frame, 16, struct.unpack_from("!H", frame, 16)[0] + 50)
    fix_ip_checksum(frame)


@_every_10th
def ihl_3(frame):
    frame[14] = (frame[14] & 0xF0) | 3
    fix_ip_checksum(frame)


def random_psn_on_a_quarter(frames, rng):
    """A quarter of the writes carry a random PSN, with a valid ICRC (a hostile sender)."""
    out = list(frames)
    for i in writes(frames):
        if rng.random() < 0.25:
            frame = bytearray(frames[i][0])
            bth = bth_offset(frame)
            frame[bth + 9:bth + 12] = int(rng.integers(0, 1 << 24)).to_bytes(3, "big")
            out[i] = (resign(frame), frames[i][1])
    return out


def forged_copies(frames, rng):
    """One write in twenty gets a copy with other payload bytes and a valid ICRC, before or
    after it: the copies conflict, and nothing says which is right."""
    out = []
    forge = set(i for i in writes(frames) if rng.random() < 0.05)
    for i, (frame, ts) in enumerate(frames):
        if i not in forge:
            out.append((frame, ts))
            continue
        fake = bytearray(frame)
        bth = bth_offset(frame)
        payload = slice(bth + 12 + 16 if frame[bth] in (6, 10, 11) else bth + 12, len(frame) - 4)
        fake[payload] = rng.integers(0, 256, len(fake[payload]), dtype=np.uint8).tobytes()
        pair = [(resign(fake), ts), (frame, ts)]
        out += pair if rng.random() < 0.5 else pair[::-1]
    return out


def everything(frames, rng):
    for fault in (drop_every_2nd_write_first, random_psn_on_a_quarter, forged_copies, bad_icrc):
        frames = fault(frames, rng)
    return frames


FAULTS = [drop_every_10th_write, drop_every_2nd_write_first, bad_icrc, udp_length_lies, ip_total_length_plus_50,
          ihl_3, random_psn_on_a_quarter, forged_copies, everything]
STREAMS = ["r0-egress", "r1-egress", "r2-egress"]
SHOWN_AS = {bad_icrc: ["decode.icrc_bad"], udp_length_lies: ["decode.udp_bad_length"],
            ihl_3: ["decode.ipv4_bad_header"], forged_copies: ["data.duplicate_conflict"]}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    job = load_job(ROOT / "configs" / "small.yaml")
    Simulation(job, out / "sim", iterations=3, seed=5, faults=parse_faults("", tuple(m.name for m in job.mirrors))).run()
    return job, out / "sim"


def _rewrite(src: Path, dst: Path, fault, seed: int) -> int:
    frames = fault(read_frames(src), np.random.default_rng(seed))
    write_frames(dst, frames)
    return len(frames)


@pytest.mark.slow
@pytest.mark.parametrize("faulty", [1, 2, 3], ids=["one-stream", "two-streams", "all-streams"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__ for f in FAULTS])
def test_never_a_wrong_replica(small, fault, faulty, tmp_path):
    job, sim = small
    pcaps = streams_of(sim, job)
    for k, name in enumerate(STREAMS[:faulty]):
        pcaps[name] = tmp_path / f"{name}.pcap"
        _rewrite(sim / "streams" / f"{name}.pcap", pcaps[name], fault, seed=k)
    result, sink = run_replay(job, pcaps, tmp_path / "replay", start_of(sim))

    events = [json.loads(line) for line in (tmp_path / "replay" / "events.jsonl").read_text().splitlines()]
    for name in pcaps:
        assert sum(result.counters[name].values()) == result.frames[name], (name, result.counters[name])
    seen = {e: sum(result.counters[name].get(e, 0) for name in STREAMS[:faulty]) for e in SHOWN_AS.get(fault, ())}
    assert all(seen.values()), seen          # the fault was there, and was seen for what it is
    if not any(result.locked.values()):
        # Nothing applied, and said so (the command exits non-zero): every stream reports why.
        assert faulty == 3 and sink.replica.iteration == start_of(sim)["iteration"]
        assert sorted(e["stream"] for e in events if e["event"] == "lockon.failed") == STREAMS
        return
    v = verify(tmp_path / "replay", sim / "truth", job_params(job))
    assert not v.differences, v.differences
    fallbacks = sorted(e["iteration"] for e in events if e["event"] == "fallback")
    for it in v.stale:
        assert fallbacks and fallbacks[0] <= it, (it, fallbacks)
    if faulty == 1:
        assert v.ok and not v.stale and v.digests_checked == [1, 2, 3], (v, fallbacks)
