"""Random hostile frame sequences through the whole appliance (parse, merge, update).

Hypothesis picks frames of a simulated job's captures and mutates them: a PSN, a destination
QPN, an opcode, a payload byte or the payload's length changed (each with a valid ICRC again,
as a hostile or broken sender would send it), a bad ICRC, a frame dropped or sent twice, on
one stream or several. Whatever it picks, the replica is the trainer's bit for bit for every
iteration it applied, every iteration it did not apply follows a ``fallback`` event (or no
stream locked on and each said why), and every frame ends in exactly one event counter.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gradtap.replay import run_replay
from gradtap.verify import verify
from gradtap.workload.layout import job_params
from tests.frame_edits import WRITES, bth_offset, fix_ip_checksum, read_frames, resign, write_frames
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import make_job, simulate

KINDS = ("psn", "qpn", "opcode", "payload", "shorter", "icrc", "drop", "twice")


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    job = make_job(3, "LL", 2, "fp32", mtu=1024)
    simulate(out, job, iterations=3)
    return job, out, {name: read_frames(path) for name, path in streams_of(out, job).items()}


def _mutate(frame: bytes, kind: str, value: int) -> list[bytes]:
    """The frames that go out instead of ``frame``."""
    if kind == "drop":
        return []
    if kind == "twice":
        return [frame, frame]
    b = bytearray(frame)
    bth = bth_offset(frame)
    if kind == "icrc":
        b[-1] ^= 1 + value % 255
        return [bytes(b)]
    if kind == "psn":
        b[bth + 9:bth + 12] = (value % (1 << 24)).to_bytes(3, "big")
    elif kind == "qpn":
        b[bth + 5:bth + 8] = (value % (1 << 24)).to_bytes(3, "big")
    elif kind == "opcode":
        b[bth] = WRITES[value % len(WRITES)]
    elif kind == "payload":
        at = bth + 12 + value % max(1, len(b) - bth - 16)
        b[at] ^= 1 << (value % 8)
    elif kind == "shorter":
        cut = 4 * (1 + value % 16)
        if len(b) - cut < bth + 12 + 4:
            return [frame]
        del b[len(b) - 4 - cut:len(b) - 4]
        struct.pack_into("!H", b, 16, struct.unpack_from("!H", b, 16)[0] - cut)
        fix_ip_checksum(b)
        udp = 14 + (b[14] & 0x0F) * 4
        struct.pack_into("!H", b, udp + 4, struct.unpack_from("!H", b, udp + 4)[0] - cut)
    return [resign(b)]


mutation = st.tuples(st.integers(0, 2), st.floats(0, 1, exclude_max=True), st.sampled_from(KINDS),
                     st.integers(0, (1 << 24) - 1))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(mutation, min_size=1, max_size=40))
# Found by this test: one payload bit of a chunk that only m-both carries (on its two hops),
# re-signed. Caught since the hops' copies are compared within the stream.
@example(mutations=[(2, 0.9765625, "payload", 1)])
def test_the_replica_is_exact_or_stale_with_an_event(captured, mutations):
    job, out, frames = captured
    names = [m.name for m in job.mirrors]
    edits: dict[str, dict[int, tuple[str, int]]] = {}
    for stream, where, kind, value in mutations:
        name = names[stream]
        writes = [i for i, (f, _) in enumerate(frames[name]) if bth_offset(f) is not None and f[bth_offset(f)] in WRITES]
        edits.setdefault(name, {})[writes[int(where * len(writes))]] = (kind, value)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pcaps = streams_of(out, job)
        for name, changes in edits.items():
            pcaps[name] = tmp / f"{name}.pcap"
            write_frames(pcaps[name], [(f, ts) for i, (frame, ts) in enumerate(frames[name])
                                       for f in (_mutate(frame, *changes[i]) if i in changes else [frame])])
        result, sink = run_replay(job, pcaps, tmp / "replay", start_of(out))
        for name in pcaps:
            assert sum(result.counters[name].values()) == result.frames[name], (name, result.counters[name])
        events = [json.loads(line) for line in (tmp / "replay" / "events.jsonl").read_text().splitlines()]
        if not any(result.locked.values()):
            assert not sink.applied
            assert sorted(e["stream"] for e in events if e["event"] == "lockon.failed") == sorted(names)
            return
        v = verify(tmp / "replay", out / "truth", job_params(job))
        assert not v.differences, (mutations, v.differences)
        fallbacks = sorted(e["iteration"] for e in events if e["event"] == "fallback")
        for it in v.stale:
            assert fallbacks and fallbacks[0] <= it, (mutations, it, fallbacks)
