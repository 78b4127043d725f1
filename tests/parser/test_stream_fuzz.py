"""Stage 2 fuzzed, in the NUMBA_BOUNDSCHECK=1 subprocess of ``test_under_boundscheck.py`` only.

Frames of a simulated stream are mutated in their BTH, extension headers and payload, then
given a correct ICRC again, so that stage 1 accepts them and stage 2 must cope with PSNs,
opcodes, lengths, addresses, immediates and flags that contradict the plan. One mutated
frame in four keeps its old ICRC. The parser reads the stream in small batches with its
ICRC deferred, so that stage 2 checks the ICRC of most frames.
"""

import tempfile
from pathlib import Path

import numpy as np
import pytest
from numba import config

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.wire import events as ev
from gradtap.wire.icrc import compute_icrc, locate_icrc
from gradtap.parser.stream import StreamParser
from tests.simulator.test_simulate import make_job, simulate
from gradtap.workload.layout import job_plan


def mutate(frame: bytes, rng: np.random.Generator, icrc: bool) -> bytes:
    try:
        l3, ipv6, end = locate_icrc(frame)
    except ValueError:
        return frame
    b = bytearray(frame)
    bth = l3 + (40 if ipv6 else (frame[l3] & 0x0F) * 4) + 8
    for _ in range(int(rng.integers(1, 4))):
        at = int(rng.integers(bth, end - 4))
        b[at] ^= 1 << int(rng.integers(0, 8))
    if icrc:
        b[end - 4:end] = compute_icrc(bytes(b)).to_bytes(4, "little")
    return bytes(b)


@pytest.mark.skipif(not config.BOUNDSCHECK, reason="runs in the NUMBA_BOUNDSCHECK=1 subprocess")
def test_mutated_frames_go_through_both_stages_and_are_counted_once():
    """Mutated frames that still pass the ICRC go through both stages without a read out of
    bounds, and every frame is counted once."""
    rng = np.random.default_rng(11)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for protocol in ("Simple", "LL", "LL128"):
            job = make_job(3, protocol, 2, "fp32", nqps=2)
            simulate(out, job, iterations=2)
            batch = read_pcap(out / "streams" / "m-both.pcap")
            frames = [bytes(batch.data[o:o + c]) for o, c in zip(batch.offsets, batch.caplens)]
            hit = rng.random(len(frames)) < 0.3
            frames = [mutate(f, rng, rng.random() < 0.75) if h else f for f, h in zip(frames, hit)]
            fuzzed = FrameBatch.from_frames(frames, batch.ts_ns)
            parser = StreamParser(job, job_plan(job), "m-both", defer_icrc=True)
            its = [it for at in range(0, len(frames), 64)
                   for it in parser.feed(fuzzed.frames(at, at + 64))] + parser.flush()
            assert parser.counters.sum() == len(frames), (protocol, ev.as_dict(parser.counters))
            for it in its:
                assert it.grad.shape[0] == parser.tables.grad_bytes
