"""Stage 1 (``parser/decode.py``) equals the slow struct-based decoder of ``tests/naive.py``
frame by frame: on the five real captures, on simulated traffic with every fault (truncated,
corrupted, retransmitted, reordered, duplicated frames), with VLAN tags, with one and two
threads, and without the JIT.

:func:`check_batch` is the comparison; ``test_decode_fuzz.py`` reuses it. Deliberate
differences from the naive decoder, each handled in :func:`expected_events`:

- TPID 0x9100 (a pre-standard double tag) is a VLAN tag for the naive decoder; the parser
  knows 802.1Q (0x8100) and 802.1ad (0x88a8) only (``wire/headers/eth.py``), so a frame
  whose type field says 0x9100 is ``other.non_ip``.
- CNP (0x81): the naive decoder takes everything after the BTH as payload; the opcode table
  gives the CNP its 16 reserved bytes (IBTA Annex A17 §A17.9.3) and no payload, so a CNP must
  carry exactly those 16 bytes.
- The naive decoder has one reason for several of the parser's events (``ipv4.bad_header`` is
  a bad version/IHL or a total length past the captured bytes, ``payload.bad_length`` a pad
  count too large or payload after an opcode that carries none); the mapping is
  :data:`NAIVE_EVENTS`.
- A frame cut short on the wire (caplen < wirelen) is refused by both; the parser says
  ``decode.frame_truncated`` unless the captured bytes already show what else it is.
"""

from __future__ import annotations

import ipaddress
import struct
import zlib

import numba
import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.wire import events as ev
from gradtap.parser.decode import decode_batch, is_roce, settle_icrc
from gradtap.wire.frame_record import FRAME_DTYPE, ICRC_BAD, ICRC_DEFERRED, ICRC_OK, ICRC_UNCHECKED
from gradtap.wire.headers.opcodes import CNP
from gradtap.wire.icrc import ROCE_MTUS
from tests import naive
from tests.core.no_jit import run_without_jit
from tests.simulator.test_simulate import make_job, simulate
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURES = GOLDEN_CAPTURES
ROCE_FRAMES = {"allreduce+p2p.pcapng": 150, "allreduce_addstep.pcapng": 156,
               "iter_40000_p2p_iter10.pcapng": 1417, "iter_40000_p2p_iter10_3.pcapng": 665,
               "rdma32.pcapng": 123}
FAULTS = "truncate=0.05,corrupt=0.03,link_loss=0.02,duplicate=0.02,reorder=0.02"

# Events in wire order, one tuple per layer; a frame cut inside a layer may end in any
# event of that layer or a later one (what the cut hides is unknown).
LAYERS = (
    (ev.DECODE_ETH_TRUNCATED, ev.OTHER_NON_IP),
    (ev.DECODE_IPV4_TRUNCATED, ev.DECODE_IPV4_BAD_HEADER, ev.DECODE_IPV4_FRAGMENT,
     ev.DECODE_IPV6_TRUNCATED, ev.DECODE_IPV6_BAD_HEADER, ev.OTHER_NON_UDP),
    (ev.DECODE_UDP_TRUNCATED, ev.OTHER_NON_ROCE, ev.DECODE_UDP_BAD_LENGTH),
    (ev.DECODE_BTH_TRUNCATED, ev.DECODE_BTH_UNKNOWN_OPCODE, ev.DECODE_EXT_TRUNCATED,
     ev.DECODE_BAD_PADDING, ev.DECODE_PAYLOAD_UNEXPECTED),
)
NAIVE_EVENTS = {
    "eth.truncated": {ev.DECODE_ETH_TRUNCATED}, "vlan.truncated": {ev.DECODE_ETH_TRUNCATED},
    "eth.not_ip": {ev.OTHER_NON_IP},
    "ipv4.truncated": {ev.DECODE_IPV4_TRUNCATED},
    "ipv4.bad_header": {ev.DECODE_IPV4_BAD_HEADER, ev.DECODE_IPV4_TRUNCATED},
    "ipv4.fragment": {ev.DECODE_IPV4_FRAGMENT},
    "ipv6.truncated": {ev.DECODE_IPV6_TRUNCATED},
    "ipv6.bad_header": {ev.DECODE_IPV6_BAD_HEADER, ev.DECODE_IPV6_TRUNCATED},
    "ip.not_udp": {ev.OTHER_NON_UDP}, "udp.truncated": {ev.DECODE_UDP_TRUNCATED},
    "udp.not_roce": {ev.OTHER_NON_ROCE}, "udp.bad_length": {ev.DECODE_UDP_BAD_LENGTH},
    "bth.truncated": {ev.DECODE_BTH_TRUNCATED}, "bth.unknown_opcode": {ev.DECODE_BTH_UNKNOWN_OPCODE},
    "payload.bad_length": {ev.DECODE_BAD_PADDING, ev.DECODE_PAYLOAD_UNEXPECTED},
}
# Naive reasons that mean "the captured bytes end inside this layer".
CUT_REASONS = {"eth.truncated": 0, "vlan.truncated": 0, "ipv4.truncated": 1, "ipv4.bad_header": 1,
               "ipv6.truncated": 1, "ipv6.bad_header": 1, "udp.truncated": 2, "bth.truncated": 3}
BTH_READ = {ev.DECODE_OK, ev.DECODE_ICRC_BAD, *LAYERS[3][1:]}


def naive_event_set(reason: str) -> set[int]:
    return NAIVE_EVENTS.get(reason, {ev.DECODE_EXT_TRUNCATED} if reason.endswith(".truncated") else set())


def first_ethertype(frame: bytes) -> int | None:
    """The type after the 802.1Q/802.1ad tags, walked as the parser walks them."""
    pos = 12
    while len(frame) >= pos + 2:
        etype = struct.unpack("!H", frame[pos:pos + 2])[0]
        if etype not in (0x8100, 0x88A8):
            return etype
        pos += 4
    return None


def naive_positions(frame: bytes) -> tuple[dict, int, int]:
    """(IP fields, BTH offset, end of the UDP datagram) of a frame the naive decoder walks
    up to its BTH, found with the naive decoder's own IP functions."""
    pos, etype = 12, struct.unpack("!H", frame[12:14])[0]
    while etype in naive.VLAN_TPIDS:
        etype = struct.unpack("!H", frame[pos + 4:pos + 6])[0]
        pos += 4
    ip, _ = (naive._ipv4 if etype == 0x0800 else naive._ipv6)(frame, pos + 2)
    l4 = ip["l4_start"]
    return ip, l4 + 8, l4 + struct.unpack("!H", frame[l4 + 4:l4 + 6])[0]


def expected_events(frame: bytes, cut: bool) -> tuple[set[int], dict | None]:
    """The events stage 1 may give ``frame`` (its captured bytes), and the naive decoding
    its record must equal when it is accepted."""
    if first_ethertype(frame) == 0x9100:
        return {ev.OTHER_NON_IP}, None
    f, reason = naive.decode_frame(frame)
    if f is not None and f["opcode"] == CNP or reason == "payload.bad_length" and _opcode(frame) == CNP:
        return _cnp_events(frame), f
    if f is not None:
        return {ev.DECODE_OK, ev.DECODE_ICRC_BAD}, f
    allowed = naive_event_set(reason)
    if cut:
        allowed = allowed | {ev.DECODE_FRAME_TRUNCATED}
        if reason in CUT_REASONS:
            allowed |= {e for layer in LAYERS[CUT_REASONS[reason]:] for e in layer}
    return allowed, None


def _opcode(frame: bytes) -> int:
    return frame[naive_positions(frame)[1]]


def _cnp_events(frame: bytes) -> set[int]:
    _, bth, end = naive_positions(frame)
    pad = (frame[bth + 1] >> 4) & 3
    after_bth = end - 4 - (bth + 12)    # bytes between BTH and ICRC, pad included
    if after_bth < 16:
        return {ev.DECODE_EXT_TRUNCATED}
    if after_bth - pad < 16:
        return {ev.DECODE_BAD_PADDING}
    return {ev.DECODE_OK, ev.DECODE_ICRC_BAD} if after_bth - pad == 16 else {ev.DECODE_PAYLOAD_UNEXPECTED}


def ip16(text: str) -> bytes:
    addr = ipaddress.ip_address(text)
    return (ipaddress.IPv6Address(f"::ffff:{addr}") if addr.version == 4 else addr).packed


def check_record(rec, data: np.ndarray, frame: bytes, wirelen: int, verify_icrc: bool = True) -> None:
    """Assert that ``rec`` is what stage 1 must make of ``frame`` (its captured bytes)."""
    event = int(rec["event"])
    cut = len(frame) < wirelen
    allowed, f = expected_events(frame, cut)
    if not verify_icrc and ev.DECODE_ICRC_BAD in allowed:
        allowed = allowed - {ev.DECODE_ICRC_BAD}
    assert event in allowed, f"event {ev.NAMES[event]}, expected one of {[ev.NAMES[e] for e in allowed]}"
    assert bool(is_roce(rec)) == (event in BTH_READ) or event == ev.DECODE_FRAME_TRUNCATED
    if event == ev.DECODE_BTH_UNKNOWN_OPCODE and not cut:
        _check_unknown_opcode(rec, data, frame, verify_icrc)
    if event not in (ev.DECODE_OK, ev.DECODE_ICRC_BAD):
        assert event == ev.DECODE_BTH_UNKNOWN_OPCODE or rec["payload_crc"] == -1
        return
    if f["opcode"] == CNP:       # exactly the 16 reserved bytes: no payload (see the docstring)
        f = dict(f, payload=b"")
    _check_fields(rec, data, f, f["opcode"])
    ip_header = data[rec["l3_off"]:rec["l3_off"] + f["l4_start"] - f["l3_start"]].tobytes()
    assert ip_header == frame[f["l3_start"]:f["l4_start"]]
    assert rec["icrc"] == ((ICRC_OK if f["icrc_ok"] else ICRC_BAD) if verify_icrc else ICRC_UNCHECKED)
    assert (event == ev.DECODE_ICRC_BAD) == (verify_icrc and not f["icrc_ok"])
    _check_payload_crc(rec, bytes(f["payload"]))


def _check_payload_crc(rec, payload: bytes) -> None:
    """A good ICRC of a path-MTU payload comes with the payload's own CRC (zlib's); nothing
    else does."""
    assert rec["payload_crc"] == (zlib.crc32(payload) if rec["icrc"] == ICRC_OK and len(payload) in ROCE_MTUS else -1)


def _check_unknown_opcode(rec, data, frame: bytes, verify_icrc: bool) -> None:
    """BTH fields, everything after the BTH as payload, and the ICRC over the whole packet."""
    ip, bth, end = naive_positions(frame)
    opcode, flags, _, qp, psn = struct.unpack("!BBHII", frame[bth:bth + 12])
    pad = (flags >> 4) & 3
    assert (rec["opcode"], rec["padcnt"], rec["dest_qp"], rec["psn"]) == (opcode, pad, qp & 0xFFFFFF, psn & 0xFFFFFF)
    payload = data[rec["payload_off"]:rec["payload_off"] + rec["payload_len"]].tobytes()
    assert payload == frame[bth + 12:max(end - 4 - pad, bth + 12)]
    icrc_ok = naive.icrc(frame, ip["l3_start"], ip["ip_version"], end - 4) == struct.unpack("<I", frame[end - 4:end])[0]
    assert rec["icrc"] == ((ICRC_OK if icrc_ok else ICRC_BAD) if verify_icrc else ICRC_UNCHECKED)
    _check_payload_crc(rec, payload)


def _check_fields(rec, data, f: dict, opcode: int) -> None:
    got = dict(ip_version=int(rec["ip_version"]), src=bytes(rec["src_ip"]), dst=bytes(rec["dst_ip"]),
               opcode=int(rec["opcode"]), padcnt=int(rec["padcnt"]), ackreq=int(rec["ackreq"]),
               vlan=int(rec["vlan"]), sport=int(rec["udp_sport"]), qp=int(rec["dest_qp"]), psn=int(rec["psn"]),
               va=int(rec["reth_va"]), rkey=int(rec["reth_rkey"]), dma=int(rec["reth_len"]),
               imm=int(rec["imm"]), aeth=int(rec["aeth"]),
               payload=data[rec["payload_off"]:rec["payload_off"] + rec["payload_len"]].tobytes())
    want = dict(ip_version=f["ip_version"], src=ip16(f["ip_src"]), dst=ip16(f["ip_dst"]), opcode=opcode,
                padcnt=f["padcnt"], ackreq=f["ackreq"], vlan=f["vlans"][0] if f["vlans"] else 0,
                sport=f["udp_sport"], qp=f["dest_qp"], psn=f["psn"], va=f.get("reth_va", 0),
                rkey=f.get("reth_rkey", 0), dma=f.get("reth_dma_len", 0), imm=f.get("immdt_be", 0),
                aeth=(f["aeth_syndrome"] << 24 | f["aeth_msn"]) if "aeth_syndrome" in f else 0,
                payload=bytes(f["payload"]))
    assert got == want


def check_batch(batch: FrameBatch, records: np.ndarray, counters: np.ndarray, verify_icrc: bool = True) -> None:
    """Every record against the naive decoder; counters against the records."""
    assert counters.sum() == len(batch)
    assert np.array_equal(counters, np.bincount(records["event"], minlength=ev.N_EVENTS))
    assert np.array_equal(records["ts_ns"], batch.ts_ns)
    for i in range(len(batch)):
        try:
            check_record(records[i], batch.data, bytes(batch.frame(i)), int(batch.wirelens[i]), verify_icrc)
        except AssertionError as exc:
            raise AssertionError(f"frame {i} ({bytes(batch.frame(i)).hex()}): {exc}") from None


def read(path) -> FrameBatch:
    return FrameBatch.concat(list(PcapReader(path, max_frames=500)))


@pytest.mark.parametrize("name", ROCE_FRAMES)
def test_real_captures_equal_the_naive_decoder(name):
    batch = read(CAPTURES / name)
    assert [bytes(batch.frame(i)) for i in range(len(batch))] == [f for _, f in naive.read_capture(CAPTURES / name)]
    records, counters = decode_batch(batch)
    check_batch(batch, records, counters)
    roce = records[is_roce(records)]
    assert len(roce) == ROCE_FRAMES[name]
    bad = roce["icrc"] == ICRC_BAD
    assert bad.sum() == (7 if name == "rdma32.pcapng" else 0)
    assert set(roce["opcode"][bad]) <= {0xAA} and (roce["icrc"][~bad] == ICRC_OK).all()
    assert (roce["payload_crc"] >= 0).sum() > len(roce) // 10, "full-MTU packets come with their payload's CRC"

    unchecked, counters = decode_batch(batch, verify_icrc=False)
    check_batch(batch, unchecked, counters, verify_icrc=False)
    assert (unchecked["icrc"] == ICRC_UNCHECKED).all()


@pytest.mark.parametrize("n,protocol,ipv6,nqps,mtu", [
    (2, "LL", True, 1, 1024), (3, "Simple", False, 2, 4096), (3, "LL128", True, 1, 4096)])
def test_simulated_traffic_with_faults_equals_the_naive_decoder(tmp_path, n, protocol, ipv6, nqps, mtu):
    job = make_job(n=n, protocol=protocol, ipv6=ipv6, nqps=nqps, mtu=mtu)
    summary = simulate(tmp_path, job, faults=FAULTS)
    seen = np.zeros(ev.N_EVENTS, np.int64)
    for stream in summary.streams:
        batch = read(stream.path)
        records, counters = decode_batch(batch)
        check_batch(batch, records, counters)
        seen += counters
        assert is_roce(records).sum() >= stream.roce_frames - stream.faults["truncate"]
        # Deferred, every decode.ok record's ICRC is left to settle_icrc, which then makes
        # the records stage 1 makes itself.
        deferred, _ = decode_batch(batch, defer_icrc=True)
        checked = np.isin(records["event"], [ev.DECODE_OK, ev.DECODE_ICRC_BAD])
        assert np.array_equal(deferred["icrc"] == ICRC_DEFERRED, checked)
        settle_all(batch.data, deferred)
        assert deferred.tobytes() == records.tobytes()
    # The faults reached the decoder: cut frames and corrupted ones.
    assert seen[ev.DECODE_FRAME_TRUNCATED] > 0 and seen[ev.DECODE_ICRC_BAD] > 0


@numba.njit
def settle_all(data, records):
    """Stage 2's check of every ICRC stage 1 deferred (assemble makes it frame by frame)."""
    for i in range(len(records)):
        settle_icrc(data, records[i])


def test_vlan_tags_of_any_depth(tmp_path):
    job = make_job(n=2, protocol="LL", ipv6=False)
    summary = simulate(tmp_path, job, faults="truncate=0.05,corrupt=0.05")
    batch = read(summary.streams[0].path)
    frames, wirelens = [], []
    for i in range(len(batch)):
        frame, depth = bytes(batch.frame(i)), i % 4
        tags = b"".join(struct.pack("!HH", (0x88A8, 0x8100)[k % 2], (k * 1000 + i) % 4096) for k in range(depth))
        frames.append(frame[:12] + tags + frame[12:])
        wirelens.append(int(batch.wirelens[i]) + 4 * depth)
    tagged = FrameBatch.from_frames(frames, ts_ns=batch.ts_ns, wirelens=wirelens)
    records, counters = decode_batch(tagged)
    check_batch(tagged, records, counters)
    vids = np.array([(i % 4096) if i % 4 else 0 for i in range(len(batch))])
    ok = records["event"] == ev.DECODE_OK
    assert ok.sum() > len(batch) // 2 and np.array_equal(records["vlan"][ok], vids[ok])


# Hand-built frames, dpkt style: bytes in, exact record out.
ETH4 = bytes.fromhex("020000000002" "020000000001" "0800")
IP4 = bytes.fromhex("45000050" "00004000" "4011 0000" "c6120001" "c6120101")   # 80 bytes total
UDP = bytes.fromhex("c00012b7" "003c0000")                                        # 60 bytes
BTH_WRITE_ONLY_IMM = bytes.fromhex("0b" "00" "ffff" "00000102" "80000007")       # ackreq, PSN 7
RETH = bytes.fromhex("00007f0000010000" "12345678" "00000010")                   # 16 bytes to write
IMM = bytes.fromhex("10000000")
PAYLOAD = bytes(range(16))


def roce_frame(ip=IP4, udp=UDP, bth=BTH_WRITE_ONLY_IMM, rest=RETH + IMM + PAYLOAD):
    """An IPv4 RoCEv2 frame with its IP and UDP lengths set to fit and a correct ICRC."""
    udp = udp[:4] + struct.pack("!H", len(udp) + len(bth) + len(rest) + 4) + udp[6:]
    ip = ip[:2] + struct.pack("!H", len(ip) + len(udp) + len(bth) + len(rest) + 4) + ip[4:]
    body = ip + udp + bth + rest
    icrc = naive.icrc(ETH4 + body + b"\0\0\0\0", 14, 4, 14 + len(body))
    return ETH4 + body + struct.pack("<I", icrc)


def _decode(frames, wirelens=None):
    batch = FrameBatch.from_frames(frames, wirelens=wirelens)
    return batch, *decode_batch(batch)


def test_byte_literal_write_only_with_immediate():
    frame = roce_frame()
    assert len(frame) == 14 + 80
    batch, records, _ = _decode([frame])
    r = records[0]
    assert r["event"] == ev.DECODE_OK and r["icrc"] == ICRC_OK and r["ip_version"] == 4
    assert bytes(r["src_ip"]) == ipaddress.IPv6Address("::ffff:198.18.0.1").packed
    assert bytes(r["dst_ip"]) == ipaddress.IPv6Address("::ffff:198.18.1.1").packed
    assert (r["opcode"], r["dest_qp"], r["psn"], r["ackreq"], r["udp_sport"]) == (0x0B, 0x102, 7, 1, 0xC000)
    assert (r["reth_va"], r["reth_rkey"], r["reth_len"], r["imm"]) == (0x7F0000010000, 0x12345678, 16, 0x10000000)
    assert (r["payload_off"], r["payload_len"]) == (14 + 20 + 8 + 12 + 16 + 4, 16)
    assert batch.data[r["payload_off"]:r["payload_off"] + 16].tobytes() == PAYLOAD


def test_byte_literal_refusals():
    fragment = roce_frame(ip=IP4[:6] + b"\x20\x00" + IP4[8:])                          # MF set
    options = roce_frame(ip=b"\x46" + IP4[1:] + b"\x01\x01\x01\x01")                  # IHL 6, NOPs
    ipv6_ext = ETH4[:12] + b"\x86\xdd" + bytes.fromhex("60000000" "0008" "00" "40") + bytes(32) + bytes(8)
    not_roce = roce_frame(udp=bytes.fromhex("c0004791" "003c0000"))   # port 18321
    unknown = roce_frame(bth=b"\xaa" + BTH_WRITE_ONLY_IMM[1:])
    ack_with_payload = roce_frame(bth=b"\x11" + BTH_WRITE_ONLY_IMM[1:])
    big_pad = roce_frame(bth=b"\x11\x30" + BTH_WRITE_ONLY_IMM[2:], rest=b"\0\0\0\0" + b"\0\0")   # pad 3 > 2
    batch, records, counters = _decode([fragment, options, ipv6_ext, not_roce, unknown, ack_with_payload, big_pad])
    check_batch(batch, records, counters)
    assert [ev.NAMES[e] for e in records["event"]] == [
        "decode.ipv4_fragment", "decode.ok", "other.non_udp", "other.non_roce", "decode.bth_unknown_opcode",
        "decode.payload_unexpected", "decode.bad_padding"]
    # The ICRC covers any opcode: this 0xaa frame was given a correct one.
    assert records["icrc"][4] == ICRC_OK and list(is_roce(records)) == [0, 1, 0, 0, 1, 1, 1]
    assert records["payload_off"][1] - batch.offsets[1] == 14 + 24 + 8 + 12 + 20


def test_cut_frames_keep_what_was_captured():
    frame = roce_frame()
    bth_end = 14 + 20 + 8 + 12
    cuts = list(range(len(frame)))
    _, records, counters = _decode([frame[:k] for k in cuts], wirelens=[len(frame)] * len(cuts))
    assert (records["event"] == ev.DECODE_FRAME_TRUNCATED).all()
    assert list(is_roce(records)) == [k >= bth_end for k in cuts]
    roce = records[is_roce(records)]
    assert (roce["psn"] == 7).all() and (roce["dest_qp"] == 0x102).all() and (roce["payload_len"] == 16).all()
    assert (roce["icrc"] == ICRC_UNCHECKED).all()
    assert (roce["reth_len"] == [16 if k >= bth_end + 20 else 0 for k in cuts[bth_end:]]).all()
    # The same bytes with the wire length equal to them: the IP length is what is wrong.
    _, records, _ = _decode([frame[:k] for k in cuts])
    assert ev.DECODE_FRAME_TRUNCATED not in records["event"]


def test_threads_and_out_buffer_give_the_same_records():
    batch = read(CAPTURES / "allreduce+p2p.pcapng")
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one, c1 = decode_batch(batch)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        out = np.ones(len(batch) + 5, FRAME_DTYPE)
        two, c2 = decode_batch(batch, out=out)
    finally:
        numba.set_num_threads(threads)
    assert one.tobytes() == two.tobytes() and np.array_equal(c1, c2)
    assert np.shares_memory(two, out) and len(two) == len(batch)


def test_input_is_validated():
    batch = read(CAPTURES / "rdma32.pcapng")
    with pytest.raises(TypeError, match="FrameBatch"):
        decode_batch(batch.data)
    with pytest.raises(TypeError, match="FRAME_DTYPE"):
        decode_batch(batch, out=np.zeros(len(batch), np.int64))
    with pytest.raises(ValueError, match="needs 175 writeable rows"):
        decode_batch(batch, out=np.zeros(10, FRAME_DTYPE))
    with pytest.raises(ValueError, match="link type 101 is not Ethernet"):
        decode_batch(FrameBatch(batch.data, batch.offsets, batch.caplens, batch.wirelens, batch.ts_ns, 101))
    batch.offsets[3] = len(batch.data)     # corrupted after the batch was built
    with pytest.raises(ValueError, match="outside data"):
        decode_batch(batch)


NO_JIT_SCRIPT = """
import sys
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.parser.decode import decode_batch
records, counters = decode_batch(FrameBatch.concat(list(PcapReader(sys.argv[1]))))
sys.stdout.write(records.tobytes().hex() + " " + counters.tobytes().hex())
"""


@pytest.mark.slow
def test_without_jit_the_records_are_the_same():
    path = CAPTURES / "rdma32.pcapng"
    plain = run_without_jit(NO_JIT_SCRIPT, str(path), timeout=300)
    records, counters = decode_batch(read(path))
    assert plain.split() == [records.tobytes().hex(), counters.tobytes().hex()]
