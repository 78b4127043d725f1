"""The wire plan against real NCCL 2.19 traffic (golden).

Three FlowCheck captures (``../shared/captures``, see its README) hold a ring allreduce of
5000 int32 elements per call between 2 ranks over 2 channels with the LL protocol, input
``x[i] = i mod 10`` in place. The frames are decoded with the slow reference decoder
(``tests/naive.py``), their RDMA WRITEs are reassembled per (source, destination, QP)
without looking at the plan, and then every message is compared with
``build_plan(job, [5000] * calls)``: sizes, ImmDt, packets, PSNs, RETH addresses and keys,
CTS writes and their fields, LL flags, and the element values themselves.

What is learned from a capture rather than predicted (the plan is relative by design): which
host is which ring position and which QP is which channel (the one assignment under which
the captured message sizes follow the plan), and per connection one PSN base, one buffer
address, one CTS fifo address and one FIFO step base. Everything else must agree exactly.
"""

from __future__ import annotations

import itertools
import shutil
import struct
import subprocess
from dataclasses import dataclass, field

import numpy as np
import pytest

from gradtap.simulator.allreduce import chunk_index, ring_partials
from gradtap.wire.psn import PSN_MODULUS
from tests import naive
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import CTS, DATA, NO_VA, PHASE_AG, PHASE_RS, build_plan
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURES = GOLDEN_CAPTURES
COUNT = 5000                     # int32 elements per allreduce call
RANKS = 2
MTU = 1024
WRITES = range(0x06, 0x0C)       # RDMA WRITE FIRST .. ONLY_WITH_IMMEDIATE
FIFO = struct.Struct("<QiIIIQ")  # NCCL 2.19 struct ncclIbSendFifo: addr size rkey nreqs tag idx

# (file, NCCL_IB_ADAPTIVE_ROUTING, calls the capture touches, calls it holds completely)
GOLDEN = [("allreduce_addstep.pcapng", False, 2, 1),
          ("allreduce+p2p.pcapng", False, 1, 1),
          ("rdma32.pcapng", True, 1, 1)]


@dataclass
class Write:
    """One RDMA WRITE work request as reassembled from its packets."""

    frames: list[int]
    psn: int
    opcodes: list[int]
    va: int
    rkey: int
    dma_lens: list[int]
    imm_le: int | None
    payload: bytes
    udp_sport: int

    @property
    def npkts(self) -> int:
        return len(self.frames)


@dataclass
class Capture:
    name: str
    hosts: dict[str, str] = field(default_factory=dict)             # ip -> mac
    flows: dict[tuple, list[Write]] = field(default_factory=dict)   # (src, dst, dest QP) -> writes
    dropped: dict[tuple, list[str]] = field(default_factory=dict)   # partial writes: where


def load(name: str) -> Capture:
    cap = Capture(name)
    packets: dict[tuple, list] = {}
    for number, (_, frame) in enumerate(naive.read_capture(CAPTURES / name), start=1):
        f, _reason = naive.decode_frame(frame)
        if f is None:
            continue
        assert f["icrc_ok"], f"{name} frame {number}: ICRC {f['icrc']:#x} != {f['icrc_computed']:#x}"
        cap.hosts[f["ip_src"]] = f["eth_src"]
        if f["opcode"] in WRITES:
            packets.setdefault((f["ip_src"], f["ip_dst"], f["dest_qp"]), []).append((number, f))
    for key, pkts in packets.items():
        cap.flows[key], cap.dropped[key] = reassemble(name, pkts)
    return cap


def reassemble(name: str, pkts: list) -> tuple[list[Write], list[str]]:
    """Packets of one flow, in capture order, to work requests. A write cut by the start or
    end of the capture (or, never in these captures, by a lost packet: "middle") is dropped
    and noted. A plain write that the NIC sent as one WRITE_ONLY per packet, each with its
    own RETH, is joined back into one work request."""
    writes: list[Write] = []
    current: Write | None = None
    dropped: list[str] = []
    for i, (number, f) in enumerate(pkts):
        if i:
            assert f["psn"] == (pkts[i - 1][1]["psn"] + 1) % PSN_MODULUS, \
                f"{name} frame {number}: PSN {f['psn']} does not follow {pkts[i - 1][1]['psn']}"
        op = f["opcode"]
        if op in (0x06, 0x0A, 0x0B):
            if current is not None:
                dropped.append("middle")
            current = Write([number], f["psn"], [op], f["reth_va"], f["reth_rkey"], [f["reth_dma_len"]],
                            None, f["payload"], f["udp_sport"])
        elif current is None:
            if op in (0x08, 0x09):               # the end of a write whose start is not here
                dropped.append("middle" if writes else "start")
            continue
        else:
            current.frames.append(number)
            current.opcodes.append(op)
            current.payload += f["payload"]
        if op in (0x09, 0x0B):
            current.imm_le = f["immdt_le"]
        if op in (0x08, 0x09, 0x0A, 0x0B):
            writes.append(current)
            current = None
    if current is not None:
        dropped.append("end")
    joined: list[Write] = []
    for w in writes:
        prev = joined[-1] if joined else None
        if (prev is not None and w.opcodes == [0x0A] and prev.opcodes[-1] == 0x0A and prev.imm_le is None
                and len(prev.payload) % MTU == 0 and len(w.payload) == prev.dma_lens[-1] == MTU
                and w.va == prev.va + len(prev.payload) and w.rkey == prev.rkey
                and w.psn == (prev.psn + prev.npkts) % PSN_MODULUS):
            prev.frames += w.frames
            prev.opcodes += w.opcodes
            prev.dma_lens += w.dma_lens
            prev.payload += w.payload
        else:
            joined.append(w)
    return joined, dropped


def job_for(hosts: list[tuple[str, str]], adaptive_routing: bool):
    return parse_job({
        "name": "flowcheck-captures",
        "model": {"params": [{"name": "x", "shape": [COUNT]}]},
        "ddp": {"grad_dtype": "fp32"},   # int32 travels like fp32: 4-byte elements
        "nccl": {"protocol": "LL", "channels": 2, "mtu": MTU, "adaptive_routing": adaptive_routing},
        "ring": {"ranks": [{"ip": ip, "mac": mac} for ip, mac in hosts]},
        "mirrors": [{"name": "port", "rank": 0, "direction": "both"}],
    })


def signature(rows) -> list[tuple[int, bool]]:
    return [(int(r["wire_bytes"]), bool(r["imm"])) for r in rows]


def observed_signature(writes: list[Write]) -> list[tuple[int, bool]]:
    return [(len(w.payload), w.imm_le is not None) for w in writes]


def assign(cap: Capture, plan) -> tuple[list[str], dict[tuple[int, int], tuple]]:
    """The one (ring order of the hosts, flow of every (position, channel)) under which the
    captured data flows follow the plan's message sizes. Flows that fit no data flow of the
    plan (p2p, CTS) stay unassigned. Fails unless exactly one assignment fits."""
    data_flows = [k for k, ws in cap.flows.items() if any(w.imm_le is not None for w in ws)]
    plan_rows = {}
    for i, fl in enumerate(plan.flows):
        if fl["kind"] == DATA:
            plan_rows[int(fl["src"]), int(fl["channel"])] = plan.flow_messages(i)
    n, nch = plan.world_size, int(plan.flows["channel"].max()) + 1
    fits = []
    for ring in itertools.permutations(sorted(cap.hosts), n):
        per_position = []
        for p in range(n):
            candidates = [k for k in data_flows if k[0] == ring[p] and k[1] == ring[(p + 1) % n]]
            per_position.append([perm for perm in itertools.permutations(candidates, nch)
                                 if all(prefix(cap.flows[k], plan_rows[p, c]) for c, k in enumerate(perm))])
        for choice in itertools.product(*per_position):
            fits.append((list(ring), {(p, c): k for p, perm in enumerate(choice) for c, k in enumerate(perm)}))
    assert len(fits) == 1, (f"{cap.name}: {len(fits)} assignments of hosts and QPs fit the plan; captured "
                            f"sizes: { {k: observed_signature(v) for k, v in cap.flows.items()} }; plan: "
                            f"{ {k: signature(v) for k, v in plan_rows.items()} }")
    return fits[0]


def prefix(writes: list[Write], rows) -> bool:
    got = observed_signature(writes)
    return 0 < len(got) <= len(rows) and got == signature(rows[:len(got)])


def cts_flow(cap: Capture, data_key: tuple, writes: list[Write]) -> tuple:
    """The CTS flow of a data connection: the reverse direction, same UDP port (one RC
    connection), every write a 32-byte plain WRITE_ONLY."""
    src, dst, _ = data_key
    keys = [k for k, ws in cap.flows.items() if k[0] == dst and k[1] == src
            and all(w.opcodes == [0x0A] and len(w.payload) == 32 for w in ws)
            and {w.udp_sport for w in ws} == {writes[0].udp_sport}]
    assert len(keys) == 1, f"{cap.name}: CTS flows of {data_key}: {keys}"
    return keys[0]


def learned(values: list[int], what: str) -> int:
    assert len(set(values)) == 1, f"{what} is not one constant per connection: {values}"
    return values[0]


@pytest.fixture(scope="module", params=GOLDEN, ids=[g[0] for g in GOLDEN])
def golden(request):
    name, ar, touched, complete = request.param
    if not (CAPTURES / name).exists():
        pytest.skip(f"{CAPTURES / name} is not present")
    cap = load(name)
    # The plan does not depend on the addresses: any two hosts will do to find the ring.
    provisional = build_plan(job_for(sorted(cap.hosts.items())[:RANKS], ar), [COUNT] * 4)
    ring, flows = assign(cap, provisional)
    last_bucket = [plan_flow(provisional, DATA, p, c)["bucket"][len(cap.flows[key]) - 1]
                   for (p, c), key in flows.items()]
    plan = build_plan(job_for([(ip, cap.hosts[ip]) for ip in ring], ar), [COUNT] * (1 + int(max(last_bucket))))
    return dict(name=name, cap=cap, ring=ring, flows=flows, plan=plan, touched=touched, complete=complete)


def plan_flow(plan, kind, src, channel):
    (i,) = [i for i, f in enumerate(plan.flows)
            if f["kind"] == kind and f["src"] == src and f["channel"] == channel]
    return plan.flow_messages(i)


def test_calls_in_the_capture(golden):
    """The capture touches ``touched`` calls; ``complete`` of them have every data write."""
    plan, cap, flows = golden["plan"], golden["cap"], golden["flows"]
    assert len(plan.bucket_numels) == golden["touched"]
    complete = 0
    for b in range(golden["touched"]):
        complete += all(len(cap.flows[key]) >= np.flatnonzero(plan_flow(plan, DATA, p, c)["bucket"] == b)[-1] + 1
                        for (p, c), key in flows.items())
    assert complete == golden["complete"]


def test_position_0_sends_the_short_chunk_first_on_channel_0(golden):
    """Chunk 1 of 5000 elements is 904 elements (7232 LL bytes); position 0 sends it at step 0."""
    cap, flows = golden["cap"], golden["flows"]
    first = len(cap.flows[flows[0, 0]][0].payload)
    assert first == 7232 and flows[0, 0][0] == golden["ring"][0]


def test_data_writes_follow_the_plan(golden):
    plan, cap, geo = golden["plan"], golden["cap"], golden["plan"].geometries[0]
    for (p, c), key in golden["flows"].items():
        writes, rows = cap.flows[key], plan_flow(plan, DATA, p, c)
        where = f"{golden['name']} position {p} channel {c} ({key[0]} -> {key[1]} QP {key[2]:#x})"
        psn_base = learned([(w.psn - int(r["psn_offset"])) % PSN_MODULUS for w, r in zip(writes, rows)], f"{where}: PSN base")
        va_base = learned([w.va - int(r["remote_offset"]) for w, r in zip(writes, rows)
                           if r["remote_offset"] != NO_VA], f"{where}: buffer address")
        learned([w.rkey for w, r in zip(writes, rows) if r["remote_offset"] != NO_VA], f"{where}: R_Key")
        for i, (w, r) in enumerate(zip(writes, rows)):
            at = f"{where} write {i} (frames {w.frames[0]}-{w.frames[-1]})"
            assert len(w.payload) == r["wire_bytes"] == sum(w.dma_lens), at
            assert w.npkts == r["npkts"], at
            assert (w.psn - psn_base) % PSN_MODULUS == r["psn_offset"], at
            assert r["remote_offset"] == NO_VA or r["remote_offset"] == (r["step"] % 8) * geo.step_bytes, at
            if r["remote_offset"] == NO_VA:          # adaptive routing: zero-length, VA and R_Key 0
                assert (w.va, w.rkey, w.payload) == (0, 0, b""), at
            else:
                assert w.va == va_base + r["remote_offset"], at
            if r["imm"]:
                assert w.imm_le == r["msg_bytes"], at
                assert w.opcodes[-1] in (0x09, 0x0B), at
            else:
                assert w.imm_le is None and (set(w.opcodes) == {0x0A} or w.opcodes[-1] == 0x08), at


def test_ll_flags_are_the_plan_step_plus_one_base(golden):
    plan, cap = golden["plan"], golden["cap"]
    for (p, c), key in golden["flows"].items():
        writes, rows = cap.flows[key], plan_flow(plan, DATA, p, c)
        bases = []
        for w, r in zip(writes, rows):
            if w.payload:
                _, flags = naive.decode_ll(w.payload)
                assert len(flags) == len(w.payload) // 16
                bases += [flag - 1 - int(r["step"]) for flag in flags]
        # Each capture starts with the connections' first call: flag 1 at step 0.
        assert learned(bases, f"{golden['name']} {key}: LL flag base") == 0


def test_cts_writes_follow_the_plan(golden):
    plan, cap, geo = golden["plan"], golden["cap"], golden["plan"].geometries[0]
    for (p, c), key in golden["flows"].items():
        data_writes, data_rows = cap.flows[key], plan_flow(plan, DATA, p, c)
        cts_key = cts_flow(cap, key, data_writes)
        writes, rows = cap.flows[cts_key], plan_flow(plan, CTS, (p + 1) % plan.world_size, c)
        where = f"{golden['name']} CTS of position {p} channel {c} ({cts_key[0]} -> QP {cts_key[2]:#x})"
        assert 0 < len(writes) <= len(rows), where
        slot_rows = data_rows[data_rows["remote_offset"] != NO_VA]
        va_base = learned([w.va - int(r["remote_offset"]) for w, r in zip(data_writes, data_rows)
                           if r["remote_offset"] != NO_VA], "buffer address")
        data_rkey = next(w.rkey for w, r in zip(data_writes, data_rows) if r["remote_offset"] != NO_VA)
        flag_base = learned([naive.decode_ll(w.payload)[1][0] - 1 - int(r["step"])
                             for w, r in zip(data_writes, data_rows) if w.payload], "flag base")
        psn_base = learned([(w.psn - int(r["psn_offset"])) % PSN_MODULUS for w, r in zip(writes, rows)], "CTS PSN base")
        fifo_base = learned([w.va - int(r["remote_offset"]) for w, r in zip(writes, rows)], "CTS fifo address")
        idx_base = learned([FIFO.unpack(w.payload)[5] - 1 - int(r["fifo_seq"]) for w, r in zip(writes, rows)],
                           "CTS idx base")
        assert idx_base == flag_base, where      # LL: one receive per step, idx is the flag
        for i, (w, r) in enumerate(zip(writes, rows)):
            at = f"{where} write {i} (frame {w.frames[0]})"
            assert (w.npkts, w.imm_le, len(w.payload)) == (1, None, r["wire_bytes"]) == (1, None, 32), at
            assert (w.psn - psn_base) % PSN_MODULUS == r["psn_offset"], at
            # MAX_REQUESTS = 32 * 8 fifo slots of NCCL_NET_IB_MAX_RECVS = 8 entries of 32 bytes (NCCL 2.19).
            assert w.va == fifo_base + r["remote_offset"] == fifo_base + (r["fifo_seq"] % (32 * 8)) * (8 * 32), at
            addr, size, rkey, nreqs, tag, idx = FIFO.unpack(w.payload)
            (slot,) = slot_rows["remote_offset"][slot_rows["fifo_seq"] == r["fifo_seq"]]
            assert addr == va_base + slot, at
            assert (size, rkey, nreqs, tag) == (geo.slot_bytes, data_rkey, 1, p), at


def test_element_values_are_the_ring_sums(golden):
    """Reduce-scatter messages carry x, allgather messages 2x; the in-place second call 2x
    and 4x. Expected values come from simulator.allreduce.ring_partials (exact here)."""
    plan, cap = golden["plan"], golden["cap"]
    n = plan.world_size
    x = (np.arange(COUNT) % 10).astype(np.float32)
    expected = {}
    for b in range(len(plan.bucket_numels)):
        inputs = np.stack([x * 2 ** b] * n)
        expected[b] = ring_partials(inputs, chunk_index(plan, b)).astype(np.int32)
        assert np.array_equal(expected[b][n - 1], (x * 2 ** (b + 1)).astype(np.int32))
    checked = {PHASE_RS: 0, PHASE_AG: 0}
    for (p, c), key in golden["flows"].items():
        for i, (w, r) in enumerate(zip(cap.flows[key], plan_flow(plan, DATA, p, c))):
            if not w.payload:
                assert r["nelem"] == 0 or r["remote_offset"] == NO_VA   # empty send, or AR's signal
                continue
            data, _ = naive.decode_ll(w.payload)
            got = np.frombuffer(data[:4 * int(r["nelem"])], dtype="<i4")
            off, k = int(r["elem_offset"]), int(r["nelem"])
            want = expected[int(r["bucket"])][min(int(r["ring_step"]), n - 1), off:off + k]
            assert np.array_equal(got, want), f"{golden['name']} {key} write {i}: " \
                f"first difference at element {off + np.flatnonzero(got != want)[:1]}"
            checked[int(r["phase"])] += k
    assert checked[PHASE_RS] > 0 and checked[PHASE_AG] > 0


def test_reassembly_is_clean(golden):
    """No write is cut except by the end of a capture that stops inside a call, and the
    adaptive-routing capture's per-packet WRITE_ONLYs were joined into whole plain writes."""
    cap = golden["cap"]
    ours = set(golden["flows"].values())
    ours |= {cts_flow(cap, key, cap.flows[key]) for key in golden["flows"].values()}
    cut = [where for key in ours for where in cap.dropped[key]]
    assert cut == ([] if golden["touched"] == golden["complete"] else ["end"])
    split = [w for key in ours for w in cap.flows[key] if len(w.opcodes) > 1 and set(w.opcodes) == {0x0A}]
    assert (golden["name"] == "rdma32.pcapng") == bool(split)
    assert all(w.npkts == 16 and w.dma_lens == [MTU] * 16 for w in split)


# --- the reference decoder itself -------------------------------------------------------

TSHARK_FIELDS = ["frame.number", "infiniband.bth.opcode", "infiniband.bth.padcnt", "infiniband.bth.p_key",
                 "infiniband.bth.destqp", "infiniband.bth.a", "infiniband.bth.psn", "infiniband.reth.va",
                 "infiniband.reth.r_key", "infiniband.reth.dmalen", "infiniband.immdt",
                 "infiniband.aeth.syndrome", "infiniband.aeth.msn", "udp.srcport"]


@pytest.mark.tshark
@pytest.mark.parametrize("name", sorted(p.name for p in CAPTURES.glob("*.pcapng")))
def test_naive_decoder_agrees_with_tshark(name):
    if shutil.which("tshark") is None:
        pytest.skip("tshark is not installed (bin/test installs it)")
    cmd = ["tshark", "-r", str(CAPTURES / name), "-Y", "infiniband", "-T", "fields", "-E", "occurrence=f"]
    for fld in TSHARK_FIELDS:
        cmd += ["-e", fld]
    rows = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    frames = naive.read_capture(CAPTURES / name)
    compared = 0
    for line in rows:
        v = dict(zip(TSHARK_FIELDS, line.split("\t")))
        f, reason = naive.decode_frame(frames[int(v["frame.number"]) - 1][1])
        if f is None:
            assert reason == "bth.unknown_opcode" and int(v["infiniband.bth.opcode"]) not in naive.OPCODES
            continue
        mine = {"infiniband.bth.opcode": f["opcode"], "infiniband.bth.padcnt": f["padcnt"],
                "infiniband.bth.p_key": f["pkey"], "infiniband.bth.destqp": f["dest_qp"],
                "infiniband.bth.a": f["ackreq"], "infiniband.bth.psn": f["psn"], "udp.srcport": f["udp_sport"],
                "infiniband.reth.va": f.get("reth_va"), "infiniband.reth.r_key": f.get("reth_rkey"),
                "infiniband.reth.dmalen": f.get("reth_dma_len"),
                "infiniband.immdt": f["immdt_raw"].hex() if "immdt_raw" in f else None,
                "infiniband.aeth.syndrome": f.get("aeth_syndrome"), "infiniband.aeth.msn": f.get("aeth_msn")}
        for fld, value in mine.items():
            if value is None:
                assert v[fld] == "", (name, v["frame.number"], fld)
            elif fld == "infiniband.immdt":
                assert v[fld] == value, (name, v["frame.number"], fld)
            else:
                assert int(v[fld], 0) == value, (name, v["frame.number"], fld, v[fld], value)
        compared += 1
    assert compared > 100


@pytest.mark.parametrize("name", sorted(p.name for p in CAPTURES.glob("*.pcapng")))
def test_capture_reader_agrees_with_scapy(name):
    from scapy.utils import rdpcap
    ours = naive.read_capture(CAPTURES / name)
    theirs = rdpcap(str(CAPTURES / name))
    assert [frame for _, frame in ours] == [bytes(p) for p in theirs]
    assert [ts for ts, _ in ours] == [int(p.time * 10 ** 9 + 0.5) for p in theirs]


def _scapy_frame(ip_layer, vlans=(), opcode=0x0B, padcnt=2):
    from scapy.contrib.roce import BTH
    from scapy.layers.inet import UDP
    from scapy.layers.l2 import Dot1Q, Ether
    from scapy.packet import Raw
    frame = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    for vid in vlans:
        frame = frame / Dot1Q(vlan=vid)
    exts = struct.pack("!QII", 0x7F00_1234_5678, 0xABCDEF, 7232) + bytes.fromhex("401c0000")
    body = exts + bytes(range(1, 41)) + bytes(padcnt)
    return bytes(frame / ip_layer / UDP(sport=50000, dport=4791)
                 / BTH(opcode=opcode, padcount=padcnt, pkey=0xFFFF, dqpn=0x915, ackreq=1, psn=0xFFFFFE)
                 / Raw(body))


@pytest.mark.parametrize("ip,vlans", [("v4", ()), ("v4", (7, 100)), ("v6", (5,))])
def test_naive_decoder_on_scapy_built_frames(ip, vlans):
    """IPv4 with options and IPv6, behind 802.1Q tags: fields, payload without pad, and an
    ICRC that scapy computed independently."""
    from scapy.layers.inet import IP, IPOption_NOP
    from scapy.layers.inet6 import IPv6
    layer = (IP(src="198.18.0.1", dst="198.18.0.2", tos=0x68, ttl=17, options=[IPOption_NOP()] * 4)
             if ip == "v4" else IPv6(src="fe80::1", dst="fe80::2", tc=3, fl=12345, hlim=9))
    frame = _scapy_frame(layer, vlans)
    f, reason = naive.decode_frame(frame)
    assert reason is None and f["icrc_ok"], (reason, f and hex(f["icrc"]), f and hex(f["icrc_computed"]))
    assert f["vlans"] == list(vlans) and f["ip_version"] == (4 if ip == "v4" else 6)
    assert (f["opcode"], f["padcnt"], f["dest_qp"], f["ackreq"], f["psn"]) == (0x0B, 2, 0x915, 1, 0xFFFFFE)
    assert (f["reth_va"], f["reth_rkey"], f["reth_dma_len"]) == (0x7F00_1234_5678, 0xABCDEF, 7232)
    assert (f["immdt_raw"], f["immdt_le"], f["immdt_be"]) == (bytes.fromhex("401c0000"), 7232, 0x401C0000)
    assert f["payload"] == bytes(range(1, 41))
    corrupt = bytearray(frame)
    corrupt[-10] ^= 1
    assert naive.decode_frame(bytes(corrupt))[0]["icrc_ok"] is False


def test_naive_decoder_refuses_every_truncation_without_raising():
    from scapy.layers.inet import IP
    frame = _scapy_frame(IP(src="198.18.0.1", dst="198.18.0.2"), (3,))
    for cut in range(len(frame)):
        f, reason = naive.decode_frame(frame[:cut])
        assert f is None and reason, cut
