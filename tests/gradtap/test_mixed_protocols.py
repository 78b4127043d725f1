"""A job whose buckets travel in different protocols, as NCCL's tuner picks one per call by
size: the simulator's payloads against the ground truth under the slow decoders and NCCL's
step counter walked call by call (``tests/simulator/test_simulate.py``), the replay bit-exact,
and the FIFO-slot check kept on connections whose steps depend on the counter's phase."""

from __future__ import annotations

import json
import struct

import pytest

from gradtap.replay import run_replay
from gradtap.verify import verify
from gradtap.workload.layout import job_buckets, job_params, job_plan
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import DATA
from tests import naive
from tests.frame_edits import bth_offset, read_frames, resign, write_frames
from tests.gradtap.test_replay import start_of, streams_of
from tests.simulator.test_simulate import check_allgather_matches_truth, simulate

ITERATIONS = 4
PROTOCOLS = ["LL", "Simple", "LL128"]     # buckets in launch order: small, large, medium


def mixed_job(era: str, protocols=tuple(PROTOCOLS)):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:01:{i + 1:02x}"} for i in range(3)]
    return parse_job({
        "name": "mixed", "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [64, 256, 256, 10]}},
        "ddp": {"bucket_cap_mb": 0.004}, "optimizer": {"kind": "adam", "lr": 1e-3},
        "nccl": {"protocol": "LL", "protocols": list(protocols), "channels": 2, "era": era},
        "ring": {"ranks": ranks}, "training": {"batch_size": 4},
        "mirrors": [{"name": "m-egress", "rank": 0, "direction": "egress"},
                    {"name": "m-ingress", "rank": 1, "direction": "ingress"},
                    {"name": "m-both", "rank": 2, "direction": "both"}]})


def replay(tmp_path, job, streams):
    _, sink = run_replay(job, streams, tmp_path / "replay", start_of(tmp_path / "sim"))
    events = json.loads((tmp_path / "replay" / "replay.json").read_text())["events"]
    return sink, events


def test_the_test_job_has_one_bucket_per_protocol():
    job = mixed_job("2.19")
    assert len(job_buckets(job)) == len(PROTOCOLS)
    plan = job_plan(job)
    assert [p.nccl_name for p in plan.protocols] == PROTOCOLS and plan.step_phases == 4


@pytest.mark.slow
@pytest.mark.parametrize("era", ["2.19", "2.29"])
def test_mixed_protocol_iterations_replay_bit_exactly(tmp_path, era):
    job = mixed_job(era)
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    check_allgather_matches_truth(tmp_path / "sim", job, ITERATIONS)
    sink, events = replay(tmp_path, job, streams_of(tmp_path / "sim", job))
    v = verify(tmp_path / "replay", tmp_path / "sim" / "truth", job_params(job))
    assert v.ok and not v.stale, v
    assert not sink.replica.stale
    for stream, counts in events.items():
        assert not {k: n for k, n in counts.items() if "mismatch" in k and n}, (stream, counts)


@pytest.mark.slow
def test_a_misplaced_simple_write_is_caught_once_the_counter_is_known(tmp_path):
    """The Simple call follows an LL call on every connection, so its FIFO slots depend on the
    counter's phase; once an LL flag gave the counter, a Simple write at the wrong slot counts."""
    job = mixed_job("2.19")
    simulate(tmp_path / "sim", job, iterations=ITERATIONS)
    plan = job_plan(job)
    m = plan.messages[plan.messages["kind"] == DATA]
    simple = set(m["wire_bytes"][m["protocol"] == 0].tolist()) - set(m["wire_bytes"][m["protocol"] != 0].tolist())
    streams = streams_of(tmp_path / "sim", job)
    frames = read_frames(streams["m-egress"])
    firsts = [i for i, (frame, _) in enumerate(frames)
              if (bth := bth_offset(frame)) is not None and frame[bth] == 0x06
              and struct.unpack_from("!I", frame, bth + 12 + 12)[0] in simple]
    victim = firsts[-1]                                  # in the last iteration
    frame = bytearray(frames[victim][0])
    bth = bth_offset(frame)
    va = struct.unpack_from("!Q", frame, bth + 12)[0]
    struct.pack_into("!Q", frame, bth + 12, va + 3 * plan.geometries[1].step_bytes)    # three slots on
    frames[victim] = (resign(frame), frames[victim][1])
    assert naive.decode_frame(frames[victim][0])[0]["icrc_ok"]
    write_frames(tmp_path / "edited.pcap", frames)
    _, events = replay(tmp_path, job, dict(streams, **{"m-egress": tmp_path / "edited.pcap"}))
    assert events["m-egress"].get("data.va_mismatch", 0) == 1
    assert all(events[s].get("data.va_mismatch", 0) == 0 for s in ("m-ingress", "m-both"))


def test_a_wrong_job_is_not_told_to_change_the_protocol_the_buckets_do_not_use():
    """With nccl.protocols given, nccl.protocol is not what the buckets travel in, so the
    one-field diagnosis (parser/mismatch.py) does not offer it as the fix."""
    from gradtap.parser.mismatch import _variants

    offered = [what for what, _ in _variants(mixed_job("2.19"))]
    assert offered and not any(what.startswith("nccl.protocol ") for what in offered)
    single = mixed_job("2.19").model_copy(update={"nccl": mixed_job("2.19").nccl.model_copy(update={"protocols": None})})
    assert any(what.startswith("nccl.protocol ") for what, _ in _variants(single))
