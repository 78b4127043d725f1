"""Header layouts: byte literals, scapy's encodings, round trips, derived constants, the
opcode table, and field-by-field agreement with tshark on the real captures."""

import importlib
import socket
import subprocess

import numpy as np
import pytest
from scapy.contrib.roce import AETH as ScapyAETH
from scapy.contrib.roce import BTH as ScapyBTH
from scapy.contrib.roce import _bth_opcodes as scapy_opcodes
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Dot1Q, Ether

from gradtap.capture.pcap import read_pcap
from gradtap.wire.headers import aeth, atomiceth, bth, cnp, deth, eth, ieth, immdt, ipv4, ipv6, \
    opcodes, reth, udp
from gradtap.wire.headers.layout import Bits, Layout
from gradtap.wire.icrc import locate_icrc
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURES = sorted(GOLDEN_CAPTURES.glob("*.pcapng"))
MAC1, MAC2 = bytes.fromhex("020000000001"), bytes.fromhex("020000000002")
V4A, V4B = (socket.inet_pton(socket.AF_INET, a) for a in ("10.0.0.1", "10.0.0.2"))
V6A, V6B = (socket.inet_pton(socket.AF_INET6, a) for a in ("fe80::1", "fe80::2"))

# (module pack, unpack, fields, the bytes they must give, scapy's encoding or None)
CASES = {
    "eth": (eth.pack, eth.unpack, dict(dst=MAC1, src=MAC2, type=eth.ETHERTYPE_IPV6),
            "020000000001" "020000000002" "86dd",
            lambda: bytes(Ether(dst="02:00:00:00:00:01", src="02:00:00:00:00:02", type=0x86DD))),
    "vlan": (eth.pack_vlan, eth.unpack_vlan, dict(pcp=5, dei=1, vid=0x123, type=0x0800),
             "b123" "0800", lambda: bytes(Dot1Q(prio=5, dei=1, vlan=0x123, type=0x0800))),
    "ipv4": (ipv4.pack, ipv4.unpack,
             dict(dscp=26, ecn=2, total_length=1084, ident=0x1234, flags=2, ttl=64, src=V4A,
                  dst=V4B),
             "456a043c" "12344000" "40111011" "0a000001" "0a000002",
             lambda: bytes(IP(tos=0x6A, len=1084, id=0x1234, flags=2, ttl=64, proto=17,
                              src="10.0.0.1", dst="10.0.0.2"))),
    "ipv6": (ipv6.pack, ipv6.unpack,
             dict(dscp=26, ecn=1, flow_label=0x12345, payload_length=1048, hop_limit=64,
                  src=V6A, dst=V6B),
             "66912345" "04181140" + V6A.hex() + V6B.hex(),
             lambda: bytes(IPv6(tc=0x69, fl=0x12345, plen=1048, nh=17, hlim=64, src="fe80::1",
                                dst="fe80::2"))),
    "udp": (udp.pack, udp.unpack, dict(sport=0xC000, length=1056), "c000" "12b7" "0420" "0000",
            lambda: bytes(UDP(sport=0xC000, dport=4791, len=1056, chksum=0))),
    "bth": (bth.pack, bth.unpack,
            dict(opcode=0x06, se=1, padcnt=2, becn=1, destqp=0x672, ackreq=1, psn=0x123456),
            "06a0ffff" "40000672" "80123456",
            lambda: bytes(ScapyBTH(opcode=6, solicited=1, padcount=2, becn=1, dqpn=0x672,
                                   ackreq=1, psn=0x123456, icrc=0))[:12]),
    "reth": (reth.pack, reth.unpack, dict(va=0x7F4429420000, rkey=0x23E198, dma_length=40000),
             "00007f4429420000" "0023e198" "00009c40", None),
    "aeth": (aeth.pack, aeth.unpack, dict(syndrome=0x60, msn=0x102), "60000102",
             lambda: bytes(ScapyAETH(syndrome=0x60, msn=0x102))),
    "immdt": (immdt.pack, immdt.unpack, dict(imm=0x409C0000), "409c0000", None),
    "ieth": (ieth.pack, ieth.unpack, dict(rkey=0xDEADBEEF), "deadbeef", None),
    "deth": (deth.pack, deth.unpack, dict(qkey=0x80010000, srcqp=1), "80010000" "00000001",
             None),
    "atomiceth": (atomiceth.pack, atomiceth.unpack,
                  dict(va=0x1000, rkey=7, swap_add=5, compare=9),
                  "0000000000001000" "00000007" "0000000000000005" "0000000000000009", None),
    "atomicacketh": (atomiceth.pack_ack, atomiceth.unpack_ack,
                     dict(orig_data=0x0102030405060708), "0102030405060708", None),
    "cnp": (cnp.pack, cnp.unpack, {}, "00" * 16, None),
}


@pytest.mark.parametrize("name", CASES)
def test_pack_matches_literal_and_scapy_and_unpacks_back(name):
    pack, unpack, fields, literal, scapy_bytes = CASES[name]
    raw = pack(**fields)
    assert raw.hex() == literal
    if scapy_bytes is not None:
        assert raw == scapy_bytes()
    parsed = unpack(b"\xee" + raw, 1)
    assert {k: parsed[k] for k in fields} == fields
    assert pack(**parsed) == raw


def test_derived_constants():
    assert (bth.BTH_LEN, bth.BTH_OFF_OPCODE, bth.BTH_OFF_DESTQP, bth.BTH_OFF_PSN) == (12, 0, 4, 8)
    assert (bth.BTH_PSN_MASK, bth.BTH_PSN_SHIFT, bth.BTH_SIZE_PSN) == (0xFFFFFF, 0, 4)
    assert (bth.BTH_ACKREQ_MASK, bth.BTH_ACKREQ_SHIFT) == (0x80000000, 31)
    assert (bth.BTH_PADCNT_MASK, bth.BTH_PADCNT_SHIFT, bth.BTH_OFF_PADCNT) == (0x30, 4, 1)
    assert bth.BTH_FECN_MASK | bth.BTH_BECN_MASK | bth.BTH_RESV6_MASK == 0xFF000000
    assert (ipv4.IPV4_OFF_TTL, ipv4.IPV4_OFF_CHECKSUM, ipv4.IPV4_OFF_SRC) == (8, 10, 12)
    assert (ipv4.IPV4_IHL_MASK, ipv4.IPV4_OFF_DSCP, ipv4.IPV4_ECN_MASK) == (0x0F, 1, 0x03)
    assert (ipv6.IPV6_LEN, ipv6.IPV6_OFF_HOP_LIMIT, ipv6.IPV6_FLOW_LABEL_MASK) == (40, 7, 0xFFFFF)
    assert (ipv6.IPV6_DSCP_MASK, ipv6.IPV6_SIZE_SRC) == (0x0FC00000, 16)
    assert (udp.UDP_LEN, udp.UDP_OFF_CHECKSUM, eth.ETH_LEN, eth.VLAN_LEN) == (8, 6, 14, 4)
    assert (reth.RETH_LEN, reth.RETH_OFF_DMA_LENGTH, aeth.AETH_MSN_MASK) == (16, 12, 0xFFFFFF)
    assert (aeth.AETH_SYNDROME_TYPE_MASK, aeth.AETH_SYNDROME_TYPE_SHIFT) == (0x60, 5)
    assert (deth.DETH_LEN, atomiceth.ATOMICETH_LEN, atomiceth.ATOMICACKETH_LEN) == (8, 28, 8)


def test_aeth_syndrome_layout():
    assert aeth.SYNDROME.unpack(bytes([0x60 | 2])) == {
        "resv": 0, "type": aeth.SYNDROME_NAK, "value": aeth.NAK_REMOTE_ACCESS_ERROR}
    assert aeth.SYNDROME.unpack(b"\x1f")["type"] == aeth.SYNDROME_ACK


def test_layout_rejects_bad_tables_and_values():
    with pytest.raises(ValueError, match="do not fill"):
        Layout("X", "test", ((Bits(("a", 3), ("b", 4)), "B", 0),))
    with pytest.raises(ValueError, match="integer format"):
        Layout("X", "test", ((Bits(("a", 8)), "1s", 0),))
    with pytest.raises(ValueError, match="declared twice"):
        Layout("X", "test", (("a", "B", 0), ("a", "B", 0)))
    with pytest.raises(ValueError, match=r"BTH.psn = 16777216 does not fit; allowed 0..0xffffff"):
        bth.pack(psn=1 << 24)
    with pytest.raises(ValueError, match="has no field"):
        bth.pack(qp=1)
    with pytest.raises(ValueError, match="6 bytes"):
        eth.pack(dst=b"\x00")
    with pytest.raises(ValueError, match="needs 12 bytes"):
        bth.unpack(bytes(11))


def test_ipv4_checksum_verifies_to_zero():
    header = ipv4.pack(total_length=60, ttl=3, src=V4A, dst=V4B)
    assert ipv4.checksum(header) == 0


def test_opcode_table_agrees_with_scapy_and_rxe():
    ours = {code: op.name for code, op in opcodes.OPCODES.items()}
    theirs = {code: name for code, name in scapy_opcodes.items() if not name.startswith("RD_")}
    assert {code: ours.get(code) for code in theirs} == theirs
    # scapy 2.8.0 lacks the two RC SEND with Invalidate opcodes.
    assert set(ours) - set(theirs) == {0x16, 0x17}
    # Extension header bytes after BTH, per Linux rxe_opcode.c's .length - RXE_BTH_BYTES.
    expect = {0x00: 0, 0x06: 16, 0x07: 0, 0x09: 4, 0x0A: 16, 0x0B: 20, 0x0C: 16, 0x0D: 4,
              0x0E: 0, 0x11: 4, 0x12: 12, 0x13: 28, 0x14: 28, 0x16: 4, 0x2B: 20, 0x64: 8,
              0x65: 12, 0x81: 16}
    assert {code: int(opcodes.OPCODE_EXT_LEN[code]) for code in expect} == expect
    assert opcodes.OPCODE_IMMDT_OFF[0x0B] == 16 and opcodes.OPCODE_RETH_OFF[0x0B] == 0
    assert opcodes.OPCODE_ATOMICACKETH_OFF[0x12] == 4 and opcodes.OPCODE_AETH_OFF[0x12] == 0
    assert opcodes.OPCODE_IMMDT_OFF[0x65] == 8 and opcodes.OPCODE_DETH_OFF[0x65] == 0
    assert opcodes.OPCODE_VALID[0xAA] == 0 and opcodes.OPCODE_RETH_OFF[0x07] == -1
    assert opcodes.OPCODE_PAYLOAD[0x11] == 0 and opcodes.OPCODE_PAYLOAD[0x07] == 1
    assert opcodes.OPCODE_POSITION[0x09] == opcodes.POS_LAST
    assert opcodes.OPCODE_KIND[0x0B] == opcodes.KIND_WRITE
    assert opcodes.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE == 0x09 and opcodes.CNP == 0x81
    assert opcodes.name(0xAA) == "UNKNOWN_0xaa"


TSHARK_FIELDS = ("infiniband.bth.opcode", "infiniband.bth.se", "infiniband.bth.m",
                 "infiniband.bth.padcnt", "infiniband.bth.tver", "infiniband.bth.p_key",
                 "infiniband.bth.destqp", "infiniband.bth.a", "infiniband.bth.psn",
                 "infiniband.reth.va", "infiniband.reth.r_key", "infiniband.reth.dmalen",
                 "infiniband.immdt", "infiniband.aeth.syndrome", "infiniband.aeth.msn",
                 "infiniband.deth.q_key", "infiniband.deth.srcqp")


def _extension(frame: bytes, ext: int, opcode: int, layout):
    """The extension header ``layout`` of this opcode, unpacked, or None if absent."""
    offset = int(getattr(opcodes, f"OPCODE_{layout.name}_OFF")[opcode])
    return layout.unpack(frame, ext + offset) if offset >= 0 else None


def _ours(frame: bytes) -> tuple:
    """Our decode of a RoCEv2 frame, in TSHARK_FIELDS order ('' where absent)."""
    l3, is_ipv6, _ = locate_icrc(frame)
    at = l3 + (ipv6.IPV6_LEN if is_ipv6 else ipv4.unpack(frame, l3)["ihl"] * 4) + udp.UDP_LEN
    b = bth.unpack(frame, at)
    row = (b["opcode"], b["se"], b["m"], b["padcnt"], b["tver"], b["pkey"], b["destqp"],
           b["ackreq"], b["psn"])
    if not opcodes.OPCODE_VALID[b["opcode"]]:
        return row
    ext = at + bth.BTH_LEN
    r, i, a, d = (_extension(frame, ext, b["opcode"], layout)
                  for layout in (reth.RETH, immdt.IMMDT, aeth.AETH, deth.DETH))
    return row + ((r["va"], r["rkey"], r["dma_length"]) if r else ("",) * 3) \
        + ((i["imm"].to_bytes(4, "big").hex(),) if i else ("",)) \
        + ((a["syndrome"], a["msn"]) if a else ("",) * 2) \
        + ((d["qkey"], d["srcqp"]) if d else ("",) * 2)


def _tshark_row(values: list[str]) -> tuple:
    """tshark's text -> ints, except ImmDt which it prints as hex bytes."""
    return tuple(v if field == "infiniband.immdt" or v == "" else int(v, 0)
                 for field, v in zip(TSHARK_FIELDS, values))


@pytest.mark.tshark
@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_fields_agree_with_tshark(path):
    cmd = ["tshark", "-r", str(path), "-T", "fields", "-E", "occurrence=f"]
    for field in ("frame.number",) + TSHARK_FIELDS:
        cmd += ["-e", field]
    lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    batch = read_pcap(path)
    checked = 0
    for line in lines:
        number, *values = line.split("\t")
        if not values[0]:
            continue  # tshark saw no BTH: not a RoCEv2 frame
        ours = _ours(bytes(batch.frame(int(number) - 1)))
        # For an opcode outside the table only the BTH is comparable.
        assert ours == _tshark_row(values)[:len(ours)], f"frame {number}"
        checked += 1
    assert checked > 100


WRITTEN_OUT = {"immdt": ("IMMDT",), "eth": ("ETH", "VLAN"), "cnp": ("CNP_BODY",), "ipv4": ("IPV4",),
               "deth": ("DETH",), "ieth": ("IETH",), "aeth": ("AETH", "SYNDROME"), "udp": ("UDP",),
               "atomiceth": ("ATOMICETH", "ATOMICACKETH"), "ipv6": ("IPV6",), "bth": ("BTH",),
               "reth": ("RETH",), "gre": ("GRE", "GRE_CHECKSUM", "GRE_KEY", "GRE_SEQ"),
               "erspan": ("ERSPAN2", "ERSPAN3", "ERSPAN3_SUBHEADER")}


@pytest.mark.parametrize("module,layouts", sorted(WRITTEN_OUT.items()))
def test_written_out_constants_equal_their_layout_tables(module, layouts):
    mod = importlib.import_module(f"gradtap.wire.headers.{module}")
    for layout in layouts:
        for name, value in getattr(mod, layout).constants().items():
            assert getattr(mod, name) == value, f"{module}.{name}"


def test_written_out_opcode_names_equal_the_opcode_table():
    from gradtap.wire.headers import opcodes
    for op in opcodes.OPCODES.values():
        assert getattr(opcodes, op.name) == op.code
    for name, array in opcodes._flatten().items():
        assert np.array_equal(getattr(opcodes, name), array)
