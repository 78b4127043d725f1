"""Stage 1 on GRE/ERSPAN-encapsulated mirror traffic (``parser/decode.py`` with ``decapsulate``).

The properties: an encapsulated frame decodes exactly as the Ethernet frame it carries decodes
alone (payload offsets moved by the headers in front), with the GRE sequence number and the
ERSPAN session id beside; tshark, fed pcaps that scapy encapsulated, reads every field as we do;
each malformation of the encapsulation has its own event; without ``decapsulate`` GRE stays
``other.non_udp``. :func:`check_erspan_record` (reused by ``test_erspan_fuzz.py``) compares a
record with :func:`naive_open`, a struct-based reading of the outer headers written from
RFC 2784/2890 and draft-foschiano-erspan-03, and the inner frame with ``tests/naive.py``
through ``test_decode.check_record``.
"""

from __future__ import annotations

import ipaddress
import shutil
import struct
import subprocess

import numpy as np
import pytest
from scapy.contrib.erspan import ERSPAN_II, ERSPAN_III, ERSPAN_PlatformSpecific
from scapy.layers.inet import IP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import GRE, Dot1Q, Ether
from scapy.packet import Raw

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader, PcapWriter
from gradtap.parser.decode import decode_batch, is_roce
from gradtap.wire import events as ev
from gradtap.wire.frame_record import ICRC_OK
from gradtap.wire.headers import opcodes as op
from tests import naive
from tests.core.no_jit import run_without_jit
from tests.parser.test_decode import CAPTURES, check_record, first_ethertype, roce_frame, settle_all

GRE_EVENTS = {"gre_truncated": ev.DECODE_GRE_TRUNCATED, "gre_unsupported": ev.DECODE_GRE_UNSUPPORTED,
              "erspan_truncated": ev.DECODE_ERSPAN_TRUNCATED, "erspan_bad_version": ev.DECODE_ERSPAN_BAD_VERSION,
              "erspan_unsupported": ev.DECODE_ERSPAN_UNSUPPORTED, "frame_truncated": ev.DECODE_FRAME_TRUNCATED}
OUTER_V4 = dict(src="192.0.2.1", dst="192.0.2.2")
OUTER_V6 = dict(src="2001:db8::1", dst="2001:db8::2")


# ------------------------------------------------------------------------------------------
# The slow twin: the outer headers by struct, one rule of the specifications at a time.
# ------------------------------------------------------------------------------------------

def naive_open(frame: bytes, wirelen: int):
    """How an encapsulated frame must decode.

    Returns ``None`` when the outer frame is not an intact IP packet of protocol 47 (it then
    decodes as any plain frame), ``("event", name, fields)`` when it stops in GRE/ERSPAN, or
    ``("inner", inner bytes, inner cut, fields)``; ``fields`` holds what the record's
    ``erspan_type``, ``erspan_session`` and ``gre_seq`` must be.
    """
    cut = len(frame) < wirelen
    etype = first_ethertype(frame)
    if etype not in (0x0800, 0x86DD):
        return None
    pos = 12
    while struct.unpack("!H", frame[pos:pos + 2])[0] in (0x8100, 0x88A8):
        pos += 4
    l3 = pos + 2
    if etype == 0x0800:
        if len(frame) < l3 + 20:
            return None
        vihl, _, total, _, frag, _, proto = struct.unpack("!BBHHHBB", frame[l3:l3 + 10])
        hlen = (vihl & 15) * 4
        if vihl >> 4 != 4 or hlen < 20 or total < hlen or len(frame) < l3 + hlen or frag & 0x3FFF:
            return None
        ip_end, gre = l3 + total, l3 + hlen
    else:
        if len(frame) < l3 + 40 or frame[l3] >> 4 != 6:
            return None
        plen, proto = struct.unpack("!HB", frame[l3 + 4:l3 + 7])
        ip_end, gre = l3 + 40 + plen, l3 + 40
    if proto != 47 or (ip_end > len(frame) and not cut):
        return None
    fields = {"erspan_type": 0, "erspan_session": -1, "gre_seq": -1}

    def short(end: int, name: str):
        """The event when a header ending at ``end`` does not fit, or None."""
        if end > ip_end:
            return "event", name, fields
        if end > len(frame):
            return "event", "frame_truncated", fields
        return None

    if stop := short(gre + 4, "gre_truncated"):
        return stop
    flags, proto = struct.unpack("!HH", frame[gre:gre + 4])
    c, r, k, s, version = flags >> 15, (flags >> 14) & 1, (flags >> 13) & 1, (flags >> 12) & 1, flags & 7
    if version or r or proto not in (0x88BE, 0x22EB):
        return "event", "gre_unsupported", fields
    hdr_end = gre + 4 + 4 * (c + k + s)
    if stop := short(hdr_end, "gre_truncated"):
        return stop
    if s:
        fields["gre_seq"] = struct.unpack("!I", frame[hdr_end - 4:hdr_end])[0]
    truncated = False
    if proto == 0x88BE and not s:
        fields["erspan_type"], inner = 1, hdr_end
    else:
        three = proto == 0x22EB
        fields["erspan_type"] = 3 if three else 2
        inner = hdr_end + (12 if three else 8)
        if stop := short(inner, "erspan_truncated"):
            return stop
        word0, word1 = struct.unpack("!HH", frame[hdr_end:hdr_end + 4])
        if word0 >> 12 != (2 if three else 1):
            return "event", "erspan_bad_version", fields
        fields["erspan_session"] = word1 & 0x3FF
        truncated = bool(word1 & 0x0400)
        if three:
            (last,) = struct.unpack("!H", frame[hdr_end + 10:hdr_end + 12])
            if (last >> 10) & 0x1F != 0:
                return "event", "erspan_unsupported", fields
            if last & 1:
                inner += 8
                if stop := short(inner, "erspan_truncated"):
                    return stop
    return "inner", frame[inner:min(len(frame), ip_end)], (cut and ip_end > len(frame)) or truncated, fields


def check_erspan_record(rec, data: np.ndarray, frame: bytes, wirelen: int, verify_icrc: bool = True) -> None:
    """Assert that ``rec`` is what stage 1 with ``decapsulate`` must make of ``frame``."""
    opened = naive_open(frame, wirelen)
    if opened is None:
        check_record(rec, data, frame, wirelen, verify_icrc)
        fields = {"erspan_type": 0, "erspan_session": -1, "gre_seq": -1}
    elif opened[0] == "event":
        _, name, fields = opened
        assert ev.NAMES[rec["event"]] == f"decode.{name}"
        assert not is_roce(rec)
    else:
        _, inner, inner_cut, fields = opened
        check_record(rec, data, inner, len(inner) + inner_cut, verify_icrc)
    assert {k: int(rec[k]) for k in fields} == fields


def decode_one(frame: bytes, wirelen: int | None = None, decapsulate: bool = True):
    batch = FrameBatch.from_frames([frame], wirelens=None if wirelen is None else [wirelen])
    records, counters = decode_batch(batch, decapsulate=decapsulate)
    assert counters.sum() == 1 and counters[records[0]["event"]] == 1
    return batch, records[0]


# ------------------------------------------------------------------------------------------
# Encapsulations, built by scapy (an independent encoder).
# ------------------------------------------------------------------------------------------

def wrap(inner: bytes, kind: str, seq: int = 0, session: int = 0) -> bytes:
    """``inner`` as a switch would send it: ``kind`` names the encapsulation."""
    eth = Ether(dst="02:00:00:fe:00:02", src="02:00:00:fe:00:01")
    if kind == "erspan2":
        head = eth / IP(**OUTER_V4) / GRE(seqnum_present=1, sequence_number=seq, proto=0x88BE) / \
            ERSPAN_II(session_id=session, vlan=7, index=0x12345)
    elif kind == "erspan3":
        head = eth / IP(**OUTER_V4) / GRE(seqnum_present=1, sequence_number=seq, proto=0x22EB) / \
            ERSPAN_III(session_id=session, timestamp=seq * 1000, p=1, gra=1, hw=5, d=1)
    elif kind == "erspan3_subheader":
        head = eth / IP(**OUTER_V4) / GRE(seqnum_present=1, sequence_number=seq, proto=0x22EB) / \
            ERSPAN_III(session_id=session, o=1) / ERSPAN_PlatformSpecific(platf_id=3, info1=9, info2=seq)
    elif kind == "erspan2_ipv6_key_checksum":
        head = eth / IPv6(**OUTER_V6) / GRE(chksum_present=1, key_present=1, key=0xABC, seqnum_present=1,
                                            sequence_number=seq, proto=0x88BE) / ERSPAN_II(session_id=session)
    elif kind == "erspan2_outer_vlan":
        head = eth / Dot1Q(vlan=100) / IP(**OUTER_V4) / GRE(seqnum_present=1, sequence_number=seq,
                                                            proto=0x88BE) / ERSPAN_II(session_id=session)
    elif kind == "erspan1":
        head = eth / IP(**OUTER_V4) / GRE(proto=0x88BE)
    else:
        raise ValueError(kind)
    return bytes(head / Raw(inner))


KINDS = ("erspan2", "erspan3", "erspan3_subheader", "erspan2_ipv6_key_checksum", "erspan2_outer_vlan", "erspan1")


def inner_corpus() -> list[bytes]:
    """RoCEv2 frames to encapsulate: one per (opcode, pad count) of every real capture (IPv6,
    0xaa included), an IPv4 WRITE ONLY with immediate, and the same with a VLAN tag."""
    chosen: dict[tuple, bytes] = {}
    for path in sorted(CAPTURES.glob("*.pcapng")):
        for _, frame in naive.read_capture(path):
            f, reason = naive.decode_frame(frame)
            if f is not None or reason == "bth.unknown_opcode":
                _, rec = decode_one(frame, decapsulate=False)
                chosen.setdefault((int(rec["opcode"]), int(rec["padcnt"])), frame)
    v4 = roce_frame()
    return [*chosen.values(), v4, v4[:12] + struct.pack("!HH", 0x8100, 0x0321) + v4[12:]]


@pytest.fixture(scope="module")
def corpus() -> list[bytes]:
    return inner_corpus()


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------

def test_byte_literals_type_ii_and_iii():
    inner = roce_frame()
    outer = bytes.fromhex("020000fe0002" "020000fe0001" "0800")
    ip = lambda n: bytes.fromhex("4500") + struct.pack("!H", 20 + n) + bytes.fromhex(  # noqa: E731
        "00000000" "402f0000" "c0000201" "c0000202")
    gre2 = bytes.fromhex("100088be" "0000002a")                 # S, ERSPAN II, sequence 42
    erspan2 = bytes.fromhex("1000" "0005" "00000000")           # version 1, session 5
    gre3 = bytes.fromhex("100022eb" "ffffffff")                 # S, ERSPAN III, sequence 2**32 - 1
    erspan3 = bytes.fromhex("2000" "03ff" "00000000" "0000" "8000")   # version 2, session 1023, P
    two = outer + ip(8 + 8 + len(inner)) + gre2 + erspan2 + inner
    three = outer + ip(8 + 12 + len(inner)) + gre3 + erspan3 + inner
    plain = decode_one(inner, decapsulate=False)[1]
    for frame, head, kind, session, seq in ((two, 14 + 20 + 8 + 8, 2, 5, 42),
                                            (three, 14 + 20 + 8 + 12, 3, 1023, 0xFFFFFFFF)):
        _, r = decode_one(frame)
        assert r["event"] == ev.DECODE_OK
        assert (r["erspan_type"], r["erspan_session"], r["gre_seq"], r["icrc"]) == (kind, session, seq, ICRC_OK)
        assert (r["opcode"], r["dest_qp"], r["psn"], r["reth_len"], r["imm"]) == (0x0B, 0x102, 7, 16, 0x10000000)
        assert bytes(r["src_ip"]) == ipaddress.IPv6Address("::ffff:198.18.0.1").packed and r["ip_version"] == 4
        assert (r["payload_off"], r["payload_len"]) == (plain["payload_off"] + head, 16)


@pytest.mark.parametrize("kind", KINDS)
def test_an_encapsulated_frame_decodes_as_the_frame_it_carries(corpus, kind):
    frames = [wrap(f, kind, seq=i, session=i % 1024) for i, f in enumerate(corpus)]
    batch = FrameBatch.from_frames(frames)
    records, counters = decode_batch(batch, decapsulate=True)
    plain_batch = FrameBatch.from_frames(corpus)
    plain, plain_counters = decode_batch(plain_batch)
    assert np.array_equal(counters, plain_counters)
    # The ICRC left to stage 2 is checked over the inner frame's headers, as stage 1 does.
    deferred, _ = decode_batch(batch, decapsulate=True, defer_icrc=True)
    settle_all(batch.data, deferred)
    assert deferred.tobytes() == records.tobytes()
    shift = np.array([len(f) - len(c) for f, c in zip(frames, corpus)]) + batch.offsets - plain_batch.offsets
    roce = is_roce(plain)
    assert np.array_equal(records["payload_off"][roce], plain["payload_off"][roce] + shift[roce])
    udp = plain["l3_off"] >= 0
    assert np.array_equal(records["l3_off"][udp], plain["l3_off"][udp] + shift[udp])
    inner_fields = [n for n in plain.dtype.names if n not in ("payload_off", "l3_off", "erspan_type",
                                                              "erspan_session", "gre_seq")]
    assert all(np.array_equal(records[n], plain[n]) for n in inner_fields)
    seq = kind != "erspan1"
    assert (records["erspan_type"] == {"erspan1": 1, "erspan3": 3, "erspan3_subheader": 3}.get(kind, 2)).all()
    assert np.array_equal(records["gre_seq"], np.arange(len(frames)) if seq else np.full(len(frames), -1))
    assert np.array_equal(records["erspan_session"], np.arange(len(frames)) % 1024 if seq else np.full(len(frames), -1))
    for i, frame in enumerate(frames):
        check_erspan_record(records[i], batch.data, frame, len(frame))


def test_without_decapsulate_gre_is_not_udp_and_plain_frames_decode_either_way(corpus):
    frames = [wrap(corpus[0], kind) for kind in KINDS]
    _, counters = decode_batch(FrameBatch.from_frames(frames))
    assert counters[ev.OTHER_NON_UDP] == len(frames)
    plain = FrameBatch.from_frames(corpus)
    one, c1 = decode_batch(plain)
    two, c2 = decode_batch(plain, decapsulate=True)
    assert one.tobytes() == two.tobytes() and np.array_equal(c1, c2)
    # GRE inside an encapsulated frame is not opened again.
    nested = wrap(wrap(corpus[0], "erspan2"), "erspan3")
    assert decode_one(nested)[1]["event"] == ev.OTHER_NON_UDP


def _edit(frame: bytes, at: int, raw: bytes) -> bytes:
    return frame[:at] + raw + frame[at + len(raw):]


def test_each_malformation_of_the_encapsulation_has_its_event(corpus):
    inner = corpus[-2]
    two, three = wrap(inner, "erspan2", seq=3, session=9), wrap(inner, "erspan3", seq=4, session=10)
    sub = wrap(inner, "erspan3_subheader")
    gre = 14 + 20

    def ip_total(frame: bytes, total: int) -> bytes:
        return _edit(frame, 14 + 2, struct.pack("!H", total))

    cases = {
        "gre_truncated": [ip_total(two, 20 + 3), ip_total(two, 20 + 6)],          # base header; sequence number
        "gre_unsupported": [_edit(two, gre, b"\x10\x01"), _edit(two, gre, b"\x50\x00"),   # version 1; routing bit
                            _edit(two, gre + 2, b"\x08\x00"), _edit(two, gre + 2, b"\x65\x58")],  # IPv4; TEB
        "erspan_truncated": [ip_total(two, 20 + 8 + 7), ip_total(three, 20 + 8 + 11), ip_total(sub, 20 + 8 + 19)],
        "erspan_bad_version": [_edit(two, gre + 8, b"\x20"), _edit(three, gre + 8, b"\x10"), _edit(two, gre + 8, b"\x00")],
        "erspan_unsupported": [_edit(three, gre + 8 + 10, b"\x88\x00")],          # FT = 2, an IP packet
        "frame_truncated": [two[:gre + 6], three[:gre + 8 + 11], sub[:gre + 8 + 12 + 7]],
    }
    for name, frames in cases.items():
        for frame in frames:
            wirelen = len(two) if name == "frame_truncated" else len(frame)
            batch, rec = decode_one(frame, wirelen)
            assert ev.NAMES[rec["event"]] == f"decode.{name}", (name, frame.hex())
            check_erspan_record(rec, batch.data, frame, wirelen)
    # Headers read before the stop stay in the record.
    assert decode_one(_edit(two, gre + 8, b"\x20"))[1]["gre_seq"] == 3
    assert decode_one(_edit(three, gre + 8 + 10, b"\x88\x00"))[1]["erspan_session"] == 10


def test_truncation_by_the_switch_and_by_the_capture(corpus):
    inner = corpus[-2]
    t_set = bytearray(wrap(inner[:-10], "erspan2"))            # the switch cut 10 bytes and says so (T)
    t_set[14 + 20 + 8 + 2] |= 0x04
    assert decode_one(bytes(t_set))[1]["event"] == ev.DECODE_FRAME_TRUNCATED
    t_set[14 + 20 + 8 + 2] &= ~0x04 & 0xFF                     # the same without T: the inner lengths lie
    assert decode_one(bytes(t_set))[1]["event"] == ev.DECODE_IPV4_TRUNCATED
    frame = wrap(inner, "erspan3")
    cut = decode_one(frame[:-1], len(frame))[1]                # the capture cut the ICRC's last byte
    assert cut["event"] == ev.DECODE_FRAME_TRUNCATED and is_roce(cut) and cut["erspan_type"] == 3
    # An Ethernet trailer after the outer datagram is not part of the inner frame.
    assert decode_one(frame + bytes(6))[1]["event"] == ev.DECODE_OK


TSHARK_FIELDS = ("frame.number", "gre.sequence_number", "erspan.spanid", "erspan.version", "ip.src", "ip.dst",
                 "ipv6.src", "ipv6.dst", "udp.srcport", "infiniband.bth.opcode", "infiniband.bth.padcnt",
                 "infiniband.bth.a", "infiniband.bth.destqp", "infiniband.bth.psn", "infiniband.reth.va",
                 "infiniband.reth.r_key", "infiniband.reth.dmalen", "infiniband.immdt", "infiniband.aeth.syndrome",
                 "infiniband.aeth.msn", "data.data", "infiniband.payload", "infiniband.invariant.crc")


GSI_QPN = 1
ETHERTYPE_LOOKALIKES = (b"\x08\x00", b"\x86\xdd", b"\x08\x06")


def tshark_fields(path) -> list[dict[str, str]]:
    """tshark's ``-T fields`` rows; the last occurrence of a field (the inner packet's)."""
    cmd = ["tshark", "-r", str(path), "-T", "fields", "-E", "occurrence=l", "-E", "separator=|"]
    for field in TSHARK_FIELDS:
        cmd += ["-e", field]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    return [dict(zip(TSHARK_FIELDS, line.split("|"))) for line in out.splitlines()]


def _hex_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def compare_with_tshark(path, records, data) -> int:
    """Every field stage 1 decodes equals tshark's reading; returns the RoCEv2 frames compared."""
    rows = tshark_fields(path)
    assert len(rows) == len(records)
    compared = 0
    for rec, row in zip(records, rows):
        where = f"frame {row['frame.number']}"
        kind = int(rec["erspan_type"])
        assert row["gre.sequence_number"] == ("" if rec["gre_seq"] < 0 else str(rec["gre_seq"])), where
        assert row["erspan.spanid"] == ("" if rec["erspan_session"] < 0 else str(rec["erspan_session"])), where
        assert row["erspan.version"] == {2: "1", 3: "2"}.get(kind, ""), where
        if not is_roce(rec):
            continue
        family = "ip" if rec["ip_version"] == 4 else "ipv6"
        src, dst = (ipaddress.IPv6Address(bytes(rec[k])) for k in ("src_ip", "dst_ip"))
        if rec["ip_version"] == 4:
            src, dst = src.ipv4_mapped, dst.ipv4_mapped
        assert (row[f"{family}.src"], row[f"{family}.dst"]) == (str(src), str(dst)), where
        opcode = int(rec["opcode"])
        assert int(row["udp.srcport"]) == rec["udp_sport"], where
        assert [int(row[f"infiniband.bth.{f}"], 0) for f in ("opcode", "padcnt", "a", "destqp", "psn")] == \
            [opcode, rec["padcnt"], rec["ackreq"], rec["dest_qp"], rec["psn"]], where
        if rec["event"] == ev.DECODE_BTH_UNKNOWN_OPCODE:
            compared += 1
            continue                      # tshark reads no further than the BTH either
        reth = [row[f"infiniband.reth.{f}"] for f in ("va", "r_key", "dmalen")]
        if op.OPCODE_RETH_OFF[opcode] >= 0:
            assert [int(v, 0) for v in reth] == [rec["reth_va"], rec["reth_rkey"], rec["reth_len"]], where
        else:
            assert reth == [""] * 3, where
        immdt = row["infiniband.immdt"]
        assert (_hex_bytes(immdt) if immdt else None) == (
            int(rec["imm"]).to_bytes(4, "big") if op.OPCODE_IMMDT_OFF[opcode] >= 0 else None), where
        if op.OPCODE_AETH_OFF[opcode] >= 0:
            assert (int(row["infiniband.aeth.syndrome"], 0), int(row["infiniband.aeth.msn"], 0)) == \
                (rec["aeth"] >> 24, rec["aeth"] & 0xFFFFFF), where
        off, n = int(rec["payload_off"]), int(rec["payload_len"])
        payload = _hex_bytes(row["data.data"] or row["infiniband.payload"])
        ours = data[off:off + n].tobytes()
        if not payload and rec["dest_qp"] == GSI_QPN:
            compared += 1                 # tshark dissects a datagram to QP 1 as a MAD: no payload, no ICRC
            continue
        if ours[2:4] == b"\0\0" and ours[:2] in ETHERTYPE_LOOKALIKES:
            # tshark's guess "IBA Payload - appears to be EtherType encapsulated" shows all
            # but the last 6 bytes (the ICRC check below pins the end).
            ours = ours[:len(ours) - 6]
        assert payload == ours, where
        icrc_at = off + n + int(rec["padcnt"])
        assert int(row["infiniband.invariant.crc"], 0) == int.from_bytes(data[icrc_at:icrc_at + 4].tobytes(), "big"), where
        compared += 1
    return compared


@pytest.mark.tshark
@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark is not installed (bin/test installs it)")
def test_scapy_encapsulated_pcap_agrees_with_tshark(tmp_path, corpus):
    frames = [wrap(f, kind, seq=1000 * k + i, session=(37 * k + i) % 1024)
              for k, kind in enumerate(KINDS) for i, f in enumerate(corpus)]
    batch = FrameBatch.from_frames(frames)
    path = tmp_path / "erspan.pcap"
    with PcapWriter(path) as w:
        w.write_batch(batch)
    records, counters = decode_batch(batch, decapsulate=True)
    assert counters[ev.DECODE_OK] + counters[ev.DECODE_BTH_UNKNOWN_OPCODE] == len(frames)
    assert compare_with_tshark(path, records, batch.data) == len(frames)


NO_JIT_SCRIPT = """
import sys
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import PcapReader
from gradtap.parser.decode import decode_batch
batch = FrameBatch.concat(list(PcapReader(sys.argv[1])))
wirelens = batch.wirelens.copy()
wirelens[::3] += 1                                  # every third frame counts as cut by the capture
records, counters = decode_batch(FrameBatch(batch.data, batch.offsets, batch.caplens, wirelens, batch.ts_ns,
                                            batch.linktype), decapsulate=True)
sys.stdout.write(records.tobytes().hex() + " " + counters.tobytes().hex())
"""


@pytest.mark.slow
def test_without_jit_the_records_are_the_same(tmp_path, corpus):
    frames = [wrap(f, kind, seq=i) for kind in KINDS for i, f in enumerate(corpus[::4])]
    frames += [f[:len(f) * k // 7] for f in frames[::5] for k in range(1, 7)]
    path = tmp_path / "erspan.pcap"
    with PcapWriter(path) as w:
        w.write_batch(FrameBatch.from_frames(frames))
    plain = run_without_jit(NO_JIT_SCRIPT, str(path), timeout=600)
    batch = FrameBatch.concat(list(PcapReader(path)))
    wirelens = batch.wirelens.copy()
    wirelens[::3] += 1
    records, counters = decode_batch(FrameBatch(batch.data, batch.offsets, batch.caplens, wirelens, batch.ts_ns,
                                                batch.linktype), decapsulate=True)
    assert plain.split() == [records.tobytes().hex(), counters.tobytes().hex()]
