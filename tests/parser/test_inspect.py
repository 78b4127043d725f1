"""``gradtap inspect``: the counts equal tshark's on every real capture (and on simulated
ones with cut frames), the ICRC counts are right, PSN gaps equal a plain-Python twin, the
protocol guess is right on simulated Simple/LL/LL128 and the real LL captures, ``--job``
labels flows as the stream parser learns them and maps their messages onto the plan's phases
and buckets, a capture of many flows stays within its flow limit, its memory bound and its
time, and bad files are one-line errors."""

from __future__ import annotations

import ipaddress
import json
import os
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader, PcapWriter
from gradtap.cli import _register, app
from gradtap.core.errors import ConfigError
from gradtap.parser.inspect import inspect_capture
from gradtap.parser.stream_tables import UNKNOWN_QPN
from tests import naive
from tests.parser.many_flows import one_frame_flow_batches, one_frame_flows
from tests.parser.test_decode import BTH_WRITE_ONLY_IMM, CAPTURES, ROCE_FRAMES, roce_frame
from tests.parser.test_real_captures import GOLDEN, job as real_job, parse as parse_stream
from tests.simulator.test_simulate import make_job, simulate
from gradtap.workload.layout import job_plan
from gradtap.workload.wire_plan import CTS, PHASE_AG, PHASE_RS

ROOT = Path(__file__).resolve().parents[2]
EXTENSIONS = ("reth", "immdt", "aeth", "deth", "ieth", "atomiceth", "atomicacketh")
TSHARK_FIELDS = ("ip.src", "ip.dst", "ipv6.src", "ipv6.dst", "udp.srcport", "udp.length", "infiniband.bth.opcode",
                 "infiniband.bth.destqp", "infiniband.bth.psn", "infiniband.bth.padcnt",
                 *(f"infiniband.{e}" for e in EXTENSIONS))
REQUESTS = {*range(0x00, 0x0D), 0x13, 0x14, 0x16, 0x17, *range(0x20, 0x2C), 0x64, 0x65}


def tshark_flows(path) -> tuple[int, dict]:
    """(frames, {(src, dst, qp): flow}) from tshark's own fields, grouped in plain Python.
    A frame is RoCEv2 when tshark gives it a BTH destination QP; its payload is the UDP
    length less the UDP header, BTH, the extension headers tshark found, pad and ICRC."""
    cmd = ["tshark", "-r", str(path), "-T", "fields", "-E", "separator=/t", "-E", "occurrence=f"]
    for field in TSHARK_FIELDS:
        cmd += ["-e", field]
    rows = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    flows: dict = {}
    for row in rows:
        v = dict(zip(TSHARK_FIELDS, row.split("\t")))
        if not v["infiniband.bth.destqp"]:
            continue
        src, dst = v["ipv6.src"] or v["ip.src"], v["ipv6.dst"] or v["ip.dst"]
        key = (str(ipaddress.ip_address(src)), str(ipaddress.ip_address(dst)), int(v["infiniband.bth.destqp"], 16))
        ext = sum(len(v[f"infiniband.{e}"]) // 2 for e in EXTENSIONS)
        payload = int(v["udp.length"]) - 8 - 12 - ext - int(v["infiniband.bth.padcnt"]) - 4
        f = flows.setdefault(key, {"udp_sport": int(v["udp.srcport"]), "frames": 0, "opcodes": Counter(),
                                   "payload_bytes": 0, "psn_first": int(v["infiniband.bth.psn"])})
        f["frames"] += 1
        f["opcodes"][v["infiniband.bth.opcode"]] += 1
        f["payload_bytes"] += payload
        f["psn_last"] = int(v["infiniband.bth.psn"])
    return len(rows), flows


FLOW_KEYS = ("udp_sport", "frames", "opcodes", "payload_bytes", "psn_first", "psn_last")


def ours(summary: dict, keys=FLOW_KEYS) -> dict:
    return {(f["src"], f["dst"], f["dest_qp"]): {k: Counter(f[k]) if k == "opcodes" else f[k] for k in keys}
            for f in summary["flows"]}


def pick(flows: dict, keys) -> dict:
    return {key: {k: f[k] for k in keys} for key, f in flows.items()}


@pytest.mark.tshark
@pytest.mark.parametrize("name", ROCE_FRAMES)
def test_real_captures_agree_with_tshark(name):
    summary = inspect_capture(CAPTURES / name)
    frames, flows = tshark_flows(CAPTURES / name)
    assert (summary["frames"], summary["roce_frames"]) == (frames, sum(f["frames"] for f in flows.values()))
    assert summary["roce_frames"] == ROCE_FRAMES[name] and summary["format"] == "pcapng"
    assert ours(summary) == flows
    bad = 7 if name == "rdma32.pcapng" else 0          # the 0xaa frames, and nothing else
    assert summary["icrc"] == {"ok": ROCE_FRAMES[name] - bad, "bad": bad}
    assert sum(f["opcodes"].get("170", 0) for f in summary["flows"]) == bad


@pytest.mark.tshark
def test_cut_frames_count_as_tshark_counts_them(tmp_path):
    """Frames cut short by the mirror keep their flow when their BTH was captured. (tshark
    also labels frames cut inside the BTH RRoCE; they have no destination QP and no flow.)"""
    job = make_job(n=3, protocol="LL", ipv6=False)
    summary = simulate(tmp_path, job, faults="truncate=0.1")
    for stream in summary.streams:
        got = inspect_capture(stream.path)
        frames, flows = tshark_flows(stream.path)
        assert got["frames"] == frames and got["roce_frames"] == sum(f["frames"] for f in flows.values())
        # Not payload bytes: where a cut removed extension headers, tshark does not count them.
        keys = tuple(k for k in FLOW_KEYS if k != "payload_bytes")
        assert ours(got, keys) == pick(flows, keys)
        assert got["icrc"]["ok"] < got["roce_frames"] and got["icrc"]["bad"] == 0


def psn_gaps_twin(path) -> dict:
    """PSN gaps per flow, plainly: over requests with a good ICRC, a PSN more than one (and
    less than 2^23) ahead of the highest seen so far, modulo 2^24."""
    top, gaps = {}, Counter()
    for _, frame in naive.read_capture(path):
        f, _ = naive.decode_frame(frame)
        if f is None or f["opcode"] not in REQUESTS or not f["icrc_ok"]:
            continue
        key = (f["ip_src"], f["ip_dst"], f["dest_qp"])
        if key in top:
            ahead = (f["psn"] - top[key]) % (1 << 24)
            if 0 < ahead < 1 << 23:
                gaps[key] += ahead > 1
                top[key] = f["psn"]
        else:
            top[key] = f["psn"]
    return {key: n for key, n in gaps.items() if n}


def test_psn_gaps_equal_the_twin_under_mirror_faults(tmp_path):
    job = make_job(n=3, protocol="Simple", ipv6=True)
    summary = simulate(tmp_path, job, faults="mirror_loss=0.05,reorder=0.05,duplicate=0.05,link_loss=0.02,corrupt=0.02")
    total = 0
    for stream in summary.streams:
        got = inspect_capture(stream.path)
        want = psn_gaps_twin(stream.path)
        assert {(f["src"], f["dst"], f["dest_qp"]): f["psn_gaps"] for f in got["flows"] if f["psn_gaps"]} == want
        total += sum(want.values())
    assert total > 0


def _with_psns(psns: list[int], qp: int, opcode: int = 0x07) -> list[bytes]:
    """IPv4 frames of one flow (RDMA WRITE MIDDLE, or an ACK) with these PSNs."""
    return [roce_frame(bth=bytes([opcode]) + BTH_WRITE_ONLY_IMM[1:4] + struct.pack("!II", qp, psn),
                   rest=b"\0\0\0\0" if opcode == 0x11 else bytes(64)) for psn in psns]


def test_psn_gaps_by_definition(tmp_path):
    # Gaps at 13 and 20; 12, the second 13 and 19 are behind the highest PSN; ACKs do not count.
    frames = _with_psns([10, 11, 13, 12, 13, 20, 19, 21], qp=1) + _with_psns([5, 900, 3], qp=1, opcode=0x11)
    # Across the 24-bit wrap: 0 follows 2^24 - 1, 2 skips 1.
    frames += _with_psns([(1 << 24) - 2, (1 << 24) - 1, 0, 2], qp=2)
    path = tmp_path / "gaps.pcap"
    writer = PcapWriter(path)
    writer.write_batch(FrameBatch.from_frames(frames, ts_ns=range(len(frames))))
    writer.close()
    one, two = inspect_capture(path)["flows"]
    assert (one["psn_gaps"], one["psn_first"], one["psn_last"], one["frames"]) == (2, 10, 3, 11)
    assert (two["psn_gaps"], two["psn_first"], two["psn_last"], two["frames"]) == (1, (1 << 24) - 2, 2, 4)


@pytest.mark.parametrize("protocol", ["Simple", "LL", "LL128"])
def test_protocol_guess_on_simulated_streams(tmp_path, protocol):
    job = make_job(n=3, protocol=protocol, channels=2, ipv6=False)
    summary = simulate(tmp_path, job)
    for stream in summary.streams:
        by_kind: dict[str, set] = {}
        for f in inspect_capture(stream.path, job)["flows"]:
            if f.get("job", {}).get("plan_flow") is not None:
                by_kind.setdefault(f["job"]["kind"], set()).add(f["nccl_protocol"])
        assert by_kind["data"] == {protocol} and by_kind.get("CTS", {"unknown"}) == {"unknown"}


def test_protocol_guess_on_the_real_ll_captures():
    for name, ll_flows in (("allreduce_addstep.pcapng", 4), ("rdma32.pcapng", 4), ("allreduce+p2p.pcapng", 4)):
        flows = inspect_capture(CAPTURES / name)["flows"]
        guessed = Counter(f["nccl_protocol"] for f in flows)
        assert guessed["LL"] == ll_flows and guessed["LL128"] == 0, (name, guessed)
        # Flows of 32-byte CTS writes and ACKs carry no protocol.
        assert all(f["nccl_protocol"] == "unknown" for f in flows if f["payload_bytes"] <= 96)


def plan_counts(job, iterations: int, mirror) -> tuple[Counter, Counter]:
    """Messages per phase and bucket that the mirror's capture carries in ``iterations``,
    CTS only where the mirror also carries the data they clear: a CTS flow is told from other
    CTS-sized writes between the same hosts only by its data flow's connection
    (``parser/flow_learning.py``), so without the data it is not the job's (as in replay)."""
    plan = job_plan(job)
    phases, buckets = Counter(), Counter()
    seen = set(plan.flows_of(mirror.rank, mirror.direction).tolist())
    data = {(int(plan.flows[g]["src"]), int(plan.flows[g]["dst"]), int(plan.flows[g]["channel"]))
            for g in seen if plan.flows[g]["kind"] != CTS}
    for g in seen:
        flow = plan.flows[g]
        if flow["kind"] == CTS and (int(flow["dst"]), int(flow["src"]), int(flow["channel"])) not in data:
            continue
        for m in plan.flow_messages(g):
            if m["kind"] == CTS:
                phases["CTS"] += iterations
            else:
                phases[{PHASE_RS: "reduce-scatter", PHASE_AG: "allgather"}[int(m["phase"])]] += iterations
                buckets[str(m["bucket"])] += iterations
    return phases, buckets


@pytest.mark.parametrize("faults", ["", "link_loss=0.03,corrupt=0.03,duplicate=0.03,reorder=0.05"])
def test_job_maps_messages_to_the_plans_phases_and_buckets(tmp_path, faults):
    job = make_job(n=3, protocol="LL128", channels=2, nqps=2, ipv6=True)
    job = job.model_copy(update={"ddp": job.ddp.model_copy(update={"bucket_cap_mb": 0.001})})  # 2 buckets
    summary = simulate(tmp_path, job, iterations=2, faults=faults)
    ctss = 0
    for stream, mirror in zip(summary.streams, job.mirrors):
        got = inspect_capture(stream.path, job, max_frames=100)       # flows span batches
        phases, buckets = plan_counts(job, 2, mirror)
        ctss += phases["CTS"]
        assert got["job"]["learnt"] and got["job"]["stream"] in {m.name for m in job.mirrors}
        assert {k: v for k, v in got["job"]["phases"].items() if k != "other" and v} == dict(phases)
        assert got["job"]["buckets"] == dict(buckets) and len(buckets) > 1
        ranks = {str(ipaddress.ip_address(r.ip)): i for i, r in enumerate(job.ring.ranks)}
        for f in got["flows"]:
            info = f.get("job")
            if info and info["plan_flow"] is not None:
                assert (info["src_rank"], info["dst_rank"]) == (ranks[f["src"]], ranks[f["dst"]])
                assert info["messages"]["other"] == 0
    assert ctss > 0


def _flowcheck_job(adaptive_routing: bool):
    """The job of the real allreduce captures, as ``test_real_captures`` writes it, with the
    bucket layout a parameter list can give."""
    spec = real_job(adaptive_routing=adaptive_routing)
    return spec.model_copy(update={"ddp": spec.ddp.model_copy(update={"layout": "initial"})})


@pytest.mark.parametrize("name,ar", GOLDEN)
def test_job_labels_the_real_captures_as_the_stream_parser_learns_them(name, ar):
    """Every flow is the planned flow the stream parser learns at lock-on, and nothing else is
    the job's: the pipeline p2p between the same hosts (data QPN 0x83e and its CTS 0x735,
    ``test_real_captures``) is not, although its CTS has the ring CTS's size and addresses."""
    spec = _flowcheck_job(ar)
    parser, _ = parse_stream(spec, CAPTURES / name)
    assert parser.locked, parser.failure
    t = parser.tables
    learnt = {t.label(f): int(q) for f, q in enumerate(t.qpn) if q != UNKNOWN_QPN}
    assert len(learnt) == 8                      # 2 channels x 2 directions x (data, CTS)
    got = inspect_capture(CAPTURES / name, spec)
    assert got["job"]["learnt"] and got["job"]["stream"] == "port"
    labelled = {f["job"]["label"]: f["dest_qp"] for f in got["flows"]
                if f.get("job", {}).get("plan_flow") is not None}
    assert labelled == learnt
    for f in got["flows"]:
        info = f.get("job")
        if info is None or info["plan_flow"] is None:
            continue
        m = info["messages"]
        if info["kind"] == "data":
            assert m["reduce-scatter"] > 0 and m["allgather"] > 0 and m["CTS"] == m["other"] == 0, f
        else:
            assert m["CTS"] > 0 and m["reduce-scatter"] == m["allgather"] == m["other"] == 0, f
    if name == "allreduce+p2p.pcapng":
        p2p = {f["dest_qp"]: f["job"] for f in got["flows"] if f["dest_qp"] in (0x83E, 0x735)}
        assert set(p2p) == {0x83E, 0x735}
        assert all(info["plan_flow"] is None and info["messages"]["other"] == 1 for info in p2p.values())
    assert got["job"]["phases"]["other"] == (2 if name == "allreduce+p2p.pcapng" else 0)


def test_job_not_in_the_capture_says_what_the_learner_saw():
    spec = _flowcheck_job(False)
    spec = spec.model_copy(update={"ring": spec.ring.model_copy(update={"ranks": list(reversed(spec.ring.ranks))})})
    other = real_job(order=("fe80::1", "fe80::2"))
    other = other.model_copy(update={"ddp": other.ddp.model_copy(update={"layout": "initial"})})
    got = inspect_capture(CAPTURES / "allreduce+p2p.pcapng", other)
    assert not got["job"]["learnt"] and got["job"]["stream"] is None
    assert "no RDMA WRITE between these addresses" in got["job"]["detail"]
    assert all("job" not in f for f in got["flows"])          # no flow is between the job's ranks
    swapped = inspect_capture(CAPTURES / "allreduce+p2p.pcapng", spec)
    assert "ring order" in swapped["job"]["refused"]         # as replay refuses it


def test_flows_past_the_limit_are_counted_not_listed():
    """With room for 4 flows, the others of the real capture are counted, exactly: their
    number and their frames are what the unlimited summary lists after the first 4."""
    path = CAPTURES / "allreduce+p2p.pcapng"
    whole = inspect_capture(path)
    assert whole["not_tracked"] == {"limit": 65536, "flows": 0, "frames": 0, "flows_exact": True}
    some = inspect_capture(path, max_flows=4, max_frames=50)
    assert some["flows"] == whole["flows"][:4]
    rest = whole["flows"][4:]
    assert some["not_tracked"] == {"limit": 4, "flows": len(rest), "frames": sum(f["frames"] for f in rest),
                                   "flows_exact": True}
    assert (some["frames"], some["roce_frames"], some["icrc"]) == (whole["frames"], whole["roce_frames"],
                                                                  whole["icrc"])


def test_flow_limit_is_checked():
    for bad in (0, -1, 1.5, True, "7"):
        with pytest.raises(ConfigError, match=r"max_flows: .* positive number of flows"):
            inspect_capture(CAPTURES / "rdma32.pcapng", max_flows=bad)
    with pytest.raises(ConfigError, match="stream: 'port' names a mirror stream of a job"):
        inspect_capture(CAPTURES / "rdma32.pcapng", stream="port")


MANY_FLOWS = 200_000
# Peak RSS added by inspecting MANY_FLOWS one-frame flows: the file's pages (mmap), one batch
# (PcapReader's 64 MiB bound), the listed flows' summary (Python dicts, under 2 KiB each) and
# 16 MiB for the tables (under 250 B per tracked flow and 16 B per flow not tracked: 20 MB).
# The per-flow rows of 2 KiB that issue 11 measured, regrown by concatenation, need over 800 MB.
RSS_SCRIPT = """
import json, sys
from gradtap.parser.inspect import inspect_capture

def status(field):  # kB, from proc(5)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

inspect_capture(sys.argv[2], max_flows=2)            # every kernel compiled, the growth paths too
with open("/proc/self/clear_refs", "w") as f:        # VmHWM := VmRSS (proc(5), clear_refs "5")
    f.write("5")
before = status("VmRSS")
summary = inspect_capture(sys.argv[1])
print(json.dumps({"rss_kib": status("VmHWM") - before, "not_tracked": summary["not_tracked"],
                  "flows": len(summary["flows"]), "roce": summary["roce_frames"], "first": summary["flows"][0],
                  "last": summary["flows"][-1]}))
"""


def test_many_one_frame_flows_stay_within_the_limit_and_the_memory_bound(tmp_path):
    path, small = tmp_path / "flows.pcap", tmp_path / "few.pcap"
    one_frame_flows(path, MANY_FLOWS, first_qp=0x100)
    one_frame_flows(small, 10)
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path), str(small)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    limit = 65536
    assert got["not_tracked"] == {"limit": limit, "flows": MANY_FLOWS - limit, "frames": MANY_FLOWS - limit,
                                  "flows_exact": True}
    assert (got["flows"], got["roce"]) == (limit, MANY_FLOWS)
    assert (got["first"]["dest_qp"], got["last"]["dest_qp"]) == (0x100, 0x100 + limit - 1)   # first come, first listed
    assert got["first"]["opcodes"] == {"11": 1} and got["first"]["src"] == "198.18.0.1"
    bound = path.stat().st_size + (64 << 20) + limit * 2048 + (16 << 20)
    assert got["rss_kib"] * 1024 < bound, (got["rss_kib"] >> 10, bound >> 20)


@pytest.mark.parametrize("junk_first", [False, True])
def test_job_among_many_flows_between_its_ranks(tmp_path, junk_first):
    """5000 one-frame flows between the job's two ranks, after or before one simulated stream:
    after, the job's flows are learnt as without them and the junk is other (or not tracked);
    before, the learner is shown only the first 1024 wire flows and says so."""
    job = make_job(n=2, protocol="LL", ipv6=False)
    stream = simulate(tmp_path, job, iterations=2).streams[2]        # m-both: rank 1, both directions
    with PcapReader(stream.path) as reader:
        batches = list(reader)
    end = int(batches[-1].ts_ns[-1]) + 10_000_000
    junk = list(one_frame_flow_batches(5000, start_ns=0 if junk_first else end, first_qp=0x800000))
    if junk_first:
        shift = int(junk[-1].ts_ns[-1]) + 10_000_000
        for b in batches:
            b.ts_ns[:] += shift
    path = tmp_path / "mixed.pcap"
    with PcapWriter(path, nanosecond=True) as writer:
        for b in (junk + batches if junk_first else batches + junk):
            writer.write_batch(b)
    clean = inspect_capture(stream.path, job)
    got = inspect_capture(path, job, max_flows=3000, max_frames=1000)
    assert got["not_tracked"]["flows"] == len(clean["flows"]) + 5000 - 3000
    if junk_first:
        assert not got["job"]["learnt"] and "not shown to the learner" in got["job"]["detail"]
        return
    labels = {f["job"]["label"]: f["dest_qp"] for f in clean["flows"] if f.get("job", {}).get("plan_flow") is not None}
    assert labels and labels == {f["job"]["label"]: f["dest_qp"] for f in got["flows"]
                                 if f.get("job", {}).get("plan_flow") is not None}
    assert {k: v for k, v in got["job"]["phases"].items() if k != "other"} == \
        {k: v for k, v in clean["job"]["phases"].items() if k != "other"}
    assert got["job"]["phases"]["other"] == clean["job"]["phases"]["other"] + 5000


def test_batch_size_does_not_change_the_summary(tmp_path):
    path = CAPTURES / "allreduce+p2p.pcapng"
    seen = []
    whole = inspect_capture(path, progress=lambda done, total: seen.append((done, total)))
    assert inspect_capture(path, max_frames=7) == whole
    assert seen and seen[-1][0] <= seen[-1][1] == path.stat().st_size


def gradtap(*args: str):
    _register()
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_cli_json_has_exactly_the_documented_shape():
    done = gradtap("inspect", str(CAPTURES / "rdma32.pcapng"), "--json")
    assert done.exit_code == 0, done.output
    summary = json.loads(done.stdout)
    assert set(summary) == {"file", "format", "frames", "roce_frames", "icrc", "flows", "not_tracked"}
    assert set(summary["icrc"]) == {"ok", "bad"}
    assert summary["not_tracked"] == {"limit": 65536, "flows": 0, "frames": 0, "flows_exact": True}
    for f in summary["flows"]:
        assert set(f) == {"src", "dst", "dest_qp", "udp_sport", "frames", "opcodes", "payload_bytes",
                          "psn_first", "psn_last", "psn_gaps", "nccl_protocol"}
        assert all(k.isdigit() and isinstance(v, int) for k, v in f["opcodes"].items())
        assert f["nccl_protocol"] in ("Simple", "LL", "LL128", "mixed", "unknown")
    table = gradtap("inspect", str(CAPTURES / "rdma32.pcapng"))
    text = " ".join(table.stdout.split())       # the title folds where the path is long
    assert table.exit_code == 0 and "0xaa unknown: 7" in text and "ICRC ok 116, bad 7" in text


def test_cli_job_table(tmp_path):
    job = make_job(n=2, protocol="LL", ipv6=False)
    summary = simulate(tmp_path, job, iterations=1)
    spec = tmp_path / "job.yaml"
    assert spec.exists()
    done = gradtap("inspect", str(summary.streams[0].path), "--job", str(spec))
    assert done.exit_code == 0, done.output
    assert "messages of job" in done.stdout and "allgather" in done.stdout and "total" in done.stdout


def gradtap_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from gradtap.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})


def test_bad_files_are_one_line_errors_with_exit_2(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a capture\n")
    raw_ip = tmp_path / "raw.pcap"
    raw_ip.write_bytes(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 101))
    cases = {tmp_path / "missing.pcap": "no such capture file", text: "not a pcap or pcapng file",
             raw_ip: "link type 101 is not Ethernet"}
    for path, what in cases.items():
        done = gradtap_process("inspect", str(path))
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"error: {path}")
        assert what in done.stderr
    good = gradtap_process("inspect", str(CAPTURES / "rdma32.pcapng"), "--json")
    assert good.returncode == 0 and good.stderr == ""     # no progress bar off a terminal
