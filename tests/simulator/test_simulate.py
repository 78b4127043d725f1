"""End to end: simulated mirror captures carry the true reduced gradient where NCCL puts it.

Frames are decoded with the slow struct-based decoder of ``tests/naive.py`` (nothing from
``parser/``); the element range of each message comes from the wire plan, which is checked
against real NCCL traffic in ``tests/workload/test_plan_captures.py``.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict

import numpy as np
import pytest
import torch

from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation, resume
from gradtap.simulator.truth import optimizer_arrays
from tests import naive
from tests.core.no_jit import run_without_jit
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import parse_job
from gradtap.wire.psn import PSN_MODULUS
from gradtap.workload.wire_plan import DATA, PHASE_AG

PAYLOAD_DECODERS = {"Simple": naive.decode_simple, "LL": naive.decode_ll, "LL128": naive.decode_ll128}
WIRE_NP = {"fp32": np.float32, "bf16": np.uint16, "fp16": np.float16}


def make_job(n=3, protocol="Simple", channels=2, dtype="fp32", ipv6=False, nqps=1, mtu=1024, **extra):
    ranks = [{"ip": f"fe80::1:{i + 1:x}" if ipv6 else f"198.18.{i}.1", "mac": f"02:00:00:00:01:{i + 1:02x}"}
             for i in range(n)]
    mirrors = [{"name": "m-egress", "rank": 0, "direction": "egress"},
               {"name": "m-ingress", "rank": 1 % n, "direction": "ingress"},
               {"name": "m-both", "rank": n - 1, "direction": "both"}]
    return parse_job({
        "name": f"t{n}{protocol}{channels}{dtype}",
        "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [64, 96, 10]}},
        "ddp": {"bucket_cap_mb": 0.01, "grad_dtype": dtype},
        "optimizer": {"kind": "adam", "lr": 1e-3},
        "nccl": {"protocol": protocol, "channels": channels, "qps_per_connection": nqps, "mtu": mtu,
                 **extra},
        "ring": {"ranks": ranks}, "mirrors": mirrors, "training": {"batch_size": 4},
    })


def simulate(tmp_path, job, iterations=2, faults=""):
    spec = parse_faults(faults, tuple(m.name for m in job.mirrors))
    return Simulation(job, tmp_path, iterations=iterations, seed=7, faults=spec).run()


def decoded_flows(path):
    """Data-write packets of a capture grouped by (src ip, dst ip, dest QP), in file order."""
    flows = defaultdict(list)
    for _, frame in naive.read_capture(path):
        f, _ = naive.decode_frame(frame)
        if f is not None and 0x06 <= f["opcode"] <= 0x0B:
            assert f["icrc_ok"], "a simulated frame failed its ICRC"
            flows[(f["ip_src"], f["ip_dst"], f["dest_qp"])].append(f)
    return flows


def check_allgather_matches_truth(out, job, iterations):
    plan = job_plan(job)
    layout = json.loads((out / "truth" / "layout.json").read_text())
    ranks = job.ring.ranks
    dtype = WIRE_NP[job.ddp.grad_dtype]
    its = layout_iterations(out, iterations)
    truths = [np.load(out / "truth" / f"iter_{it:06d}" / "grad.npy") for it in its]
    big_endian = version(job.nccl.era) >= (2, 29)     # ImmDt = htobe32(size) from NCCL 2.29
    for mirror in job.mirrors:
        flows = decoded_flows(out / "streams" / f"{mirror.name}.pcap")
        wanted = [f for f in plan.flows_of(mirror.rank, mirror.direction) if plan.flows["kind"][f] == DATA]
        assert wanted
        sends = {}   # (iteration, bucket, channel, src, step) -> [message bytes, plan row]
        for f in wanted:
            fl = plan.flows[f]
            pkts = flows[(ranks[fl["src"]].ip, ranks[fl["dst"]].ip, int(fl["dst_qpn"]))]
            assert len(pkts) == iterations * fl["npkts"], "a flow lost or gained packets without faults"
            by_psn = {p["psn"]: p for p in pkts}
            base = pkts[0]["psn"]
            for k in range(iterations):
                for m in plan.flow_messages(f):
                    psn0 = (base + k * int(fl["npkts"]) + int(m["psn_offset"])) % PSN_MODULUS
                    frames = [by_psn[(psn0 + j) % PSN_MODULUS] for j in range(m["npkts"])]
                    payload = b"".join(p["payload"] for p in frames)
                    assert len(payload) == m["wire_bytes"]
                    if m["imm"]:
                        assert frames[-1]["immdt_be" if big_endian else "immdt_le"] == m["msg_bytes"]
                    key = (k, int(m["bucket"]), int(m["channel"]), int(fl["src"]), int(m["step"]))
                    buf = sends.setdefault(key, [bytearray(int(m["msg_bytes"])), m])[0]
                    buf[m["part_offset"]:m["part_offset"] + len(payload)] = payload
        observed = defaultdict(list)   # (channel, src) -> [(iteration, bucket, step, flag)]
        checked = 0
        for (k, bucket, channel, src, step), (message, m) in sorted(sends.items(), key=lambda kv: kv[0]):
            if not message:
                continue
            data, flags = PAYLOAD_DECODERS[protocol_of(job, bucket)](bytes(message))
            if flags:
                assert len(set(flags)) == 1
                observed[channel, src].append((k, bucket, step, flags[0]))
            if m["phase"] != PHASE_AG:
                continue
            start = layout["buckets"][bucket]["flat_offset"] + int(m["elem_offset"])
            expect = truths[k][start:start + int(m["nelem"])].astype(dtype).tobytes()
            assert data[:len(expect)] == expect, (mirror.name, k, bucket, channel, src, step)
            checked += 1
        assert checked > 0
        for (channel, src), flagged in observed.items():
            check_step_counter(job, plan, channel, src, iterations, flagged)


def version(era):
    return tuple(int(x) for x in era.split("."))


def protocol_of(job, bucket):
    return job.nccl.protocols[bucket] if job.nccl.protocols else job.nccl.protocol


def check_step_counter(job, plan, channel, src, iterations, flagged):
    """The LL/LL128 flags of one connection (flag = step + 1) against NCCL's counter, walked
    call by call: one counter per connection whatever the protocol; each call starts it at the
    next multiple of its chunk steps (4 for Simple, 1 for LL and LL128: net.cc sendProxyProgress
    ``sub->base = ROUNDUP(resources->step, args->chunkSteps)``, v2.19.3-1) and advances it by
    its steps (2 per Simple slice, 1 per LL/LL128 send). The counter is seeded by the first flag."""
    m = plan.messages
    mine = m[(m["kind"] == DATA) & (m["channel"] == channel) & (plan.flows["src"][m["flow"]] == src)]
    calls = []
    for bucket in sorted(set(mine["bucket"].tolist())):
        steps = mine["step"][mine["bucket"] == bucket]
        simple = protocol_of(job, bucket) == "Simple"
        calls.append((bucket, int(steps.min()), int(steps.max()) + (2 if simple else 1) - int(steps.min()),
                      4 if simple else 1))
    flags = {(k, bucket, step): flag for k, bucket, step, flag in flagged}
    counter = None
    for k in range(iterations):
        for bucket, first, nsteps, chunk in calls:
            seen = {step - first: flag for (kk, b, step), flag in flags.items() if (kk, b) == (k, bucket)}
            if counter is None and seen:
                offset, flag = min(seen.items())
                counter = flag - 1 - offset
            if counter is None:
                continue
            base = -(-counter // chunk) * chunk
            assert all(flag == base + offset + 1 for offset, flag in seen.items()), \
                ("flags do not follow the step counter", channel, src, k, bucket)
            counter = base + nsteps


def layout_iterations(out, iterations):
    manifest = json.loads((out / "truth" / "manifest.json").read_text())
    assert len(manifest["iterations"]) == iterations
    return manifest["iterations"]


MATRIX = [(n, p, c, d) for n in (2, 3, 8) for p in ("Simple", "LL", "LL128") for c in (1, 2) for d in ("fp32", "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("n,protocol,channels,dtype", MATRIX)
def test_allgather_payloads_equal_ground_truth(tmp_path, n, protocol, channels, dtype):
    job = make_job(n, protocol, channels, dtype)
    simulate(tmp_path, job)
    check_allgather_matches_truth(tmp_path, job, 2)


@pytest.mark.slow
@pytest.mark.parametrize("ipv6,nqps,mtu", [(True, 2, 4096), (False, 2, 2048), (True, 1, 1024)])
def test_addresses_qps_and_mtus(tmp_path, ipv6, nqps, mtu):
    job = make_job(3, "LL128", 2, "fp32", ipv6=ipv6, nqps=nqps, mtu=mtu)
    simulate(tmp_path, job)
    check_allgather_matches_truth(tmp_path, job, 2)


@pytest.mark.slow
def test_mirror_faults_leave_the_truth_alone_and_appear_at_their_rates(tmp_path):
    job = make_job(3, "LL", 2, "fp32")
    clean = simulate(tmp_path / "clean", job)
    rates = dict(mirror_loss=0.02, duplicate=0.02, reorder=0.02, truncate=0.02)
    faulty = simulate(tmp_path / "faulty", job, faults=",".join(f"{k}={v}" for k, v in rates.items()))
    for it in clean.iterations:
        a = np.load(tmp_path / "clean" / "truth" / f"iter_{it:06d}" / "grad.npy")
        b = np.load(tmp_path / "faulty" / "truth" / f"iter_{it:06d}" / "grad.npy")
        assert a.tobytes() == b.tobytes()
    for f in faulty.streams:
        n = f.offered
        for key, p in rates.items():
            # Binomial counts: within 5 standard deviations (fails by chance ~1e-6).
            got = f.faults[key]
            assert abs(got - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1, (key, got, n * p)
        assert f.frames == n - f.faults["mirror_loss"] + f.faults["duplicate"]


@pytest.mark.slow
def test_link_faults_retransmit_and_are_visible_on_every_mirror(tmp_path):
    job = make_job(3, "Simple", 1, "fp32")
    simulate(tmp_path / "clean", job)
    faulty = simulate(tmp_path / "faulty", job, faults="link_loss=0.01,corrupt=0.01")
    assert faulty.link_faults["link_loss"] > 0 and faulty.link_faults["link_corrupt"] > 0
    a = np.load(tmp_path / "clean" / "truth" / "iter_000001" / "grad.npy")
    b = np.load(tmp_path / "faulty" / "truth" / "iter_000001" / "grad.npy")
    assert a.tobytes() == b.tobytes()
    bad = 0
    retransmitted = 0
    for s in faulty.streams:
        seen = defaultdict(int)
        for _, frame in naive.read_capture(s.path):
            f, _ = naive.decode_frame(frame)
            if f is None:
                continue
            bad += not f["icrc_ok"]
            if 0x06 <= f["opcode"] <= 0x0B:
                seen[(f["dest_qp"], f["psn"])] += 1
        retransmitted += sum(v - 1 for v in seen.values())
    assert bad > 0 and retransmitted > 0


NO_JIT_SIMULATE = """
import sys
from tests.simulator.test_simulate import make_job, simulate
simulate(sys.argv[1], make_job(2, "LL128", 1, "fp32", ipv6=sys.argv[2] == "ipv6"), faults=sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_without_jit_the_captures_are_the_same(tmp_path, family):
    """The frame encoder (and every kernel the simulator calls) runs as plain Python under
    NUMBA_DISABLE_JIT=1 and writes the compiled simulator's captures byte for byte."""
    faults = "link_loss=0.02,corrupt=0.02,mirror_loss=0.02,duplicate=0.02"
    run_without_jit(NO_JIT_SIMULATE, str(tmp_path / "plain"), family, faults)
    simulate(tmp_path / "compiled", make_job(2, "LL128", 1, "fp32", ipv6=family == "ipv6"), faults=faults)
    names = sorted(p.name for p in (tmp_path / "compiled" / "streams").iterdir())
    assert names and names == sorted(p.name for p in (tmp_path / "plain" / "streams").iterdir())
    for name in names:
        assert (tmp_path / "plain" / "streams" / name).read_bytes() == \
            (tmp_path / "compiled" / "streams" / name).read_bytes(), name


def test_resuming_leaves_the_checkpoint_as_it_was(tmp_path):
    """``resume`` trains from a checkpoint without stepping its tensors in place (torch's
    ``Optimizer.load_state_dict`` keeps them), so a second resume from it is the same."""
    job = make_job(3, "LL", 2, "fp32")
    simulate(tmp_path, job, iterations=3)
    start = torch.load(tmp_path / "truth" / "start.pt", weights_only=True)
    before = copy.deepcopy(start)
    for until in (2, 3):
        trainer = resume(job, start, seed=7, until=until)
        got = optimizer_arrays(trainer.model, trainer.optimizer)
        with np.load(tmp_path / "truth" / f"iter_{until - 1:06d}" / "state.npz") as truth:
            assert all(got[k].tobytes() == truth[k].tobytes() for k in truth.files), until
    for i, moments in before["optimizer"]["state"].items():
        assert torch.equal(moments["exp_avg"], start["optimizer"]["state"][i]["exp_avg"])
