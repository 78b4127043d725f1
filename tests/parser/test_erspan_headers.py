"""GRE and ERSPAN header layouts (``wire/headers/gre.py``, ``erspan.py``): byte literals,
scapy's encodings and round trips (their written-out constants are held equal to their tables
in ``tests/wire/test_headers.py``, with every other header's)."""

import pytest
from scapy.contrib.erspan import ERSPAN_II, ERSPAN_III, ERSPAN_PlatformSpecific
from scapy.layers.l2 import GRE

from gradtap.wire.headers import erspan, gre

# (pack, unpack, fields, the bytes they must give, scapy's encoding)
CASES = {
    "gre_seq": (gre.pack, gre.unpack, dict(seq=0x01020304, proto=gre.GRE_PROTO_ERSPAN2), "100088be" "01020304",
                lambda: bytes(GRE(seqnum_present=1, sequence_number=0x01020304, proto=0x88BE))),
    "gre_all": (gre.pack, gre.unpack, dict(checksum=0xBEEF, key=7, seq=9, proto=gre.GRE_PROTO_ERSPAN3),
                "b00022eb" "beef0000" "00000007" "00000009",
                lambda: bytes(GRE(chksum_present=1, chksum=0xBEEF, key_present=1, key=7, seqnum_present=1,
                                  sequence_number=9, proto=0x22EB))),
    "gre_type1": (gre.pack, gre.unpack, dict(proto=gre.GRE_PROTO_ERSPAN2), "000088be",
                  lambda: bytes(GRE(proto=0x88BE))),
    "erspan2": (erspan.pack2, erspan.unpack2, dict(vlan=0x123, cos=5, en=3, t=1, session=0x2AB, index=0xABCDE),
                "1123" "beab" "000abcde",
                lambda: bytes(ERSPAN_II(vlan=0x123, cos=5, en=3, t=1, session_id=0x2AB, index=0xABCDE))),
    "erspan3": (erspan.pack3, erspan.unpack3,
                dict(vlan=0xFFF, cos=1, bso=2, t=0, session=1023, timestamp=0xDEADBEEF, sgt=0x1234, p=1, ft=0,
                     hw=0x3F, d=1, gra=1, o=1),
                "2fff" "33ff" "deadbeef" "1234" "83fb",
                lambda: bytes(ERSPAN_III(vlan=0xFFF, cos=1, bso=2, t=0, session_id=1023, timestamp=0xDEADBEEF,
                                         sgt_other=0x1234, p=1, ft=0, hw=0x3F, d=1, gra=1, o=1))[:12]),
    "subheader": (erspan.pack_subheader, erspan.unpack_subheader, dict(platform_id=3, info=0x1234_5678_9ABC),
                  "0c00123456789abc",
                  lambda: bytes(ERSPAN_PlatformSpecific(platf_id=3, info1=0x1234, info2=0x56789ABC))),
}


@pytest.mark.parametrize("name", CASES)
def test_pack_matches_literal_and_scapy_and_unpacks_back(name):
    pack, unpack, fields, literal, scapy_bytes = CASES[name]
    raw = pack(**fields)
    assert raw.hex() == literal
    assert raw == scapy_bytes()
    parsed = unpack(b"\xee" + raw, 1)
    assert {k: parsed[k] for k in fields} == fields


def test_gre_optional_words_and_length():
    head = gre.unpack(gre.pack(key=5, seq=6))
    assert (head["c"], head["k"], head["s"], head["checksum"], head["key"], head["seq"], head["length"]) == \
        (0, 1, 1, None, 5, 6, 12)
    assert gre.unpack(gre.pack())["length"] == gre.GRE_LEN == 4
    with pytest.raises(ValueError, match="needs 4 bytes"):
        gre.unpack(gre.pack(seq=1)[:6], 3)


def test_header_lengths_and_versions():
    assert (erspan.ERSPAN2_LEN, erspan.ERSPAN3_LEN, erspan.ERSPAN3_SUB_LEN) == (8, 12, 8)
    assert erspan.unpack2(erspan.pack2())["version"] == erspan.ERSPAN_VERSION_II == 1
    assert erspan.unpack3(erspan.pack3())["version"] == erspan.ERSPAN_VERSION_III == 2
    # The fields Wireshark's packet-erspan.c masks: session 0x03ff, T 0x0400, FT 0x7c00, O 0x0001.
    assert (erspan.ERSPAN2_SESSION_MASK, erspan.ERSPAN2_T_MASK, erspan.ERSPAN3_FT_MASK, erspan.ERSPAN3_O_MASK) == \
        (0x03FF, 0x0400, 0x7C00, 0x0001)
    assert (gre.GRE_R_MASK, gre.GRE_VERSION_MASK, gre.IPPROTO_GRE) == (0x4000, 0x0007, 47)

