"""pcap/pcapng: the reader against tshark on the real captures and on hand-built files
covering every format variant, batching bounds, writer round trips (checked by tshark and
scapy too), and errors on malformed files."""

import json
import logging
import struct
import subprocess

import numpy as np
import pytest
from scapy.utils import rdpcap

from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import MAX_CAPLEN, PcapngWriter, PcapReader, PcapWriter, detect_format, \
    read_pcap
from gradtap.capture.ring import FrameRing
from gradtap.core.errors import CaptureError
from tests.golden import CAPTURES as GOLDEN_CAPTURES

CAPTURES = sorted(GOLDEN_CAPTURES.glob("*.pcapng"))
FRAME_COUNTS = {"allreduce+p2p.pcapng": 837, "allreduce_addstep.pcapng": 404,
                "iter_40000_p2p_iter10.pcapng": 1417, "iter_40000_p2p_iter10_3.pcapng": 665,
                "rdma32.pcapng": 175}


def _epoch_ns(text: str) -> int:
    if not text:
        return 0  # tshark prints nothing for a frame without a timestamp (SPB)
    sec, _, frac = text.partition(".")
    return int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])


def tshark_meta(path) -> list[tuple[int, int, int]]:
    """(frame.len, frame.cap_len, time in ns) per frame, as tshark reports them."""
    out = subprocess.run(["tshark", "-r", str(path), "-T", "fields", "-e", "frame.len",
                          "-e", "frame.cap_len", "-e", "frame.time_epoch"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split("\t") for line in out.splitlines()]
    return [(int(wire), int(cap), _epoch_ns(ts)) for wire, cap, ts in rows]


def tshark_bytes(path) -> list[bytes]:
    out = subprocess.run(["tshark", "-r", str(path), "-T", "json", "-x", "-j", "frame"],
                         capture_output=True, text=True, check=True).stdout
    return [bytes.fromhex(p["_source"]["layers"]["frame_raw"][0]) for p in json.loads(out)]


def ours_meta(batch: FrameBatch) -> list[tuple[int, int, int]]:
    return list(zip(batch.wirelens.tolist(), batch.caplens.tolist(), batch.ts_ns.tolist()))


def frames_of(batch: FrameBatch) -> list[bytes]:
    return [bytes(batch.frame(i)) for i in range(len(batch))]


@pytest.mark.tshark
@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_real_captures_match_tshark(path):
    with PcapReader(path) as reader:
        batch = FrameBatch.concat(list(reader))
        assert reader.format == "pcapng" and reader.truncated == 0
    assert len(batch) == FRAME_COUNTS[path.name]
    assert ours_meta(batch) == tshark_meta(path)


@pytest.mark.parametrize("path", CAPTURES[:3], ids=lambda p: p.name)
def test_batches_respect_bounds_and_concatenate_to_the_whole(path):
    whole = read_pcap(path)
    with PcapReader(path, max_frames=100, max_bytes=MAX_CAPLEN) as reader:
        batches = list(reader)
    assert len(batches) > 1
    for b in batches:
        assert len(b) <= 100 and len(b.data) <= MAX_CAPLEN
    joined = FrameBatch.concat(batches)
    assert ours_meta(joined) == ours_meta(whole) and frames_of(joined) == frames_of(whole)


# --- hand-built files ----------------------------------------------------------------

def _block(order, btype, body):
    body += bytes(-len(body) % 4)
    n = 12 + len(body)
    return struct.pack(order + "II", btype, n) + body + struct.pack(order + "I", n)


def _opt(order, code, value):
    return struct.pack(order + "HH", code, len(value)) + value + bytes(-len(value) % 4)


def shb(order):
    return _block(order, 0x0A0D0D0A, struct.pack(order + "IHHq", 0x1A2B3C4D, 1, 0, -1))


def idb(order, tsresol=None, tsoffset=None, linktype=1, snaplen=0):
    opts = b""
    if tsresol is not None:
        opts += _opt(order, 9, bytes([tsresol]))
    if tsoffset is not None:
        opts += _opt(order, 14, struct.pack(order + "q", tsoffset))
    opts += _opt(order, 0, b"") if opts else b""
    return _block(order, 1, struct.pack(order + "HHI", linktype, 0, snaplen) + opts)


def epb(order, iface, ts, data, wirelen=None):
    head = struct.pack(order + "IIIII", iface, ts >> 32, ts & 0xFFFFFFFF, len(data),
                       wirelen or len(data))
    return _block(order, 6, head + data)


def spb(order, data):
    return _block(order, 3, struct.pack(order + "I", len(data)) + data)


def opb(order, iface, ts, data):
    head = struct.pack(order + "HHIIII", iface, 0, ts >> 32, ts & 0xFFFFFFFF, len(data),
                       len(data))
    return _block(order, 2, head + data)


def frame(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).bytes(n)


LE, BE = "<", ">"
VARIANTS = (
    shb(LE) + idb(LE) + idb(LE, tsresol=0x80 | 20) + _block(LE, 4, bytes(8))  # NRB skipped
    + epb(LE, 0, 1701949583809539, frame(60)) + epb(LE, 1, (1701949583 << 20) | 123457,
                                                    frame(61), wirelen=1500)
    + spb(LE, frame(62)) + _block(LE, 5, bytes(12))  # ISB skipped
    + opb(LE, 0, 1701949583809540, frame(63)) + _block(LE, 0x1234, bytes(8))  # unknown: skipped
    # A second section, big-endian, with its own interfaces.
    + shb(BE) + idb(BE, tsresol=3, tsoffset=100) + idb(BE, tsresol=12, snaplen=64)
    + epb(BE, 0, 1701949583809, frame(64)) + epb(BE, 1, 1000123456789, frame(65))
)


@pytest.mark.tshark
def test_pcapng_variants_match_tshark(tmp_path):
    path = tmp_path / "variants.pcapng"
    path.write_bytes(VARIANTS)
    batch = read_pcap(path)
    assert ours_meta(batch) == tshark_meta(path)
    assert frames_of(batch) == tshark_bytes(path) == [frame(n) for n in range(60, 66)]
    assert batch.ts_ns[1] == 1701949583 * 10**9 + 123457 * 10**9 // 2**20  # 2^-20 s units
    assert batch.ts_ns[4] == (1701949583 + 100) * 10**9 + 809 * 10**6  # ms + if_tsoffset


def classic(order: str, nanosecond: bool, records, linktype=1) -> bytes:
    magic = 0xA1B23C4D if nanosecond else 0xA1B2C3D4
    out = struct.pack(order + "IHHiIII", magic, 2, 4, 0, 0, 65535, linktype)
    for sec, frac, data, wirelen in records:
        out += struct.pack(order + "IIII", sec, frac, len(data), wirelen) + data
    return out


@pytest.mark.tshark
@pytest.mark.parametrize("order", [LE, BE], ids=["le", "be"])
@pytest.mark.parametrize("nanosecond", [False, True], ids=["us", "ns"])
def test_classic_pcap_variants_match_tshark(tmp_path, order, nanosecond):
    records = [(1701949583, 999999 if not nanosecond else 999999999, frame(70), 70),
               (1701949584, 1, frame(80), 1400), (0, 0, b"", 0)]
    path = tmp_path / "classic.pcap"
    path.write_bytes(classic(order, nanosecond, records))
    assert detect_format(path) == "pcap"
    batch = read_pcap(path)
    assert ours_meta(batch) == tshark_meta(path)
    assert frames_of(batch) == [r[2] for r in records]


# --- writers -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample() -> FrameBatch:
    """Real frames plus odd lengths, big times, and a frame longer than the test snaplen."""
    real = read_pcap(CAPTURES[-1])
    extra = [frame(n, 5) for n in (1, 2, 3, 5, 9000)]
    ts = np.concatenate([real.ts_ns, [0, 1, 10**9 - 1, 4294967295 * 10**9 + 999_999_999,
                                      1_700_000_000_123_456_789]])
    return FrameBatch.from_frames(frames_of(real) + extra, ts,
                                  np.concatenate([real.wirelens, [1, 2, 3, 5, 9100]]))


@pytest.mark.parametrize("kind", ["pcap-ns", "pcap-us", "pcapng"])
def test_writer_round_trip(tmp_path, sample, kind):
    path = tmp_path / f"out.{kind.split('-')[0]}"
    writer = PcapngWriter(path) if kind == "pcapng" else \
        PcapWriter(path, nanosecond=kind == "pcap-ns")
    with writer:
        writer.write_batch(sample)
    back = read_pcap(path)
    ts = sample.ts_ns if kind != "pcap-us" else sample.ts_ns // 1000 * 1000
    assert back.ts_ns.tolist() == ts.tolist()
    assert back.wirelens.tolist() == sample.wirelens.tolist()
    assert frames_of(back) == frames_of(sample)
    # write() frame by frame gives the very same file.
    single = tmp_path / "single"
    writer = PcapngWriter(single) if kind == "pcapng" else \
        PcapWriter(single, nanosecond=kind == "pcap-ns")
    with writer:
        for i in range(len(sample)):
            writer.write(sample.frame(i), int(sample.ts_ns[i]), int(sample.wirelens[i]))
    assert single.read_bytes() == path.read_bytes()


def test_writer_snaplen_and_chunking(tmp_path, sample, monkeypatch):
    monkeypatch.setattr(PcapWriter, "_CHUNK", 3000)  # forces many kernel calls
    with PcapWriter(tmp_path / "cut.pcap", snaplen=100) as writer:
        writer.write_batch(sample)
        writer.write_batch(sample)
        assert writer.frames == 2 * len(sample)
    back = read_pcap(tmp_path / "cut.pcap")
    assert back.caplens.tolist() == 2 * np.minimum(sample.caplens, 100).tolist()
    assert back.wirelens.tolist() == 2 * sample.wirelens.tolist()
    assert frames_of(back)[:len(sample)] == [f[:100] for f in frames_of(sample)]


def test_writer_rejects_bad_times_and_snaplen(tmp_path):
    with PcapWriter(tmp_path / "a.pcap") as writer:
        with pytest.raises(ValueError, match="timestamps"):
            writer.write(b"x", -1)
        with pytest.raises(ValueError, match="timestamps"):
            writer.write(b"x", 1 << 32 << 30)
    with pytest.raises(ValueError, match="snaplen"):
        PcapngWriter(tmp_path / "b.pcapng", snaplen=0)


@pytest.mark.tshark
@pytest.mark.parametrize("kind", ["pcap", "pcapng"])
def test_written_files_read_identically_by_tshark_and_scapy(tmp_path, sample, kind):
    path = tmp_path / f"out.{kind}"
    with (PcapngWriter(path) if kind == "pcapng" else PcapWriter(path)) as writer:
        writer.write_batch(sample)
    assert tshark_meta(path) == ours_meta(sample)
    assert tshark_bytes(path) == frames_of(sample)
    packets = rdpcap(str(path))
    assert [bytes(p) for p in packets] == frames_of(sample)
    assert [int(p.time * 10**9) for p in packets] == sample.ts_ns.tolist()
    assert [p.wirelen for p in packets] == sample.wirelens.tolist()


# --- errors --------------------------------------------------------------------------

def _read_error(tmp_path, content: bytes, name="bad.pcapng") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CaptureError) as info:
        read_pcap(path)
    assert str(path) in str(info.value)
    return str(info.value)


GOOD = shb(LE) + idb(LE) + epb(LE, 0, 5, frame(60))


@pytest.mark.parametrize("content, message", [
    (b"", "byte 0: not a pcap or pcapng file"),
    (b"garbage garbage garbage garbage", "byte 0: not a pcap or pcapng file"),
    (classic(LE, True, [])[:20], "byte 0: pcap file header needs 24 bytes"),
    (classic(LE, True, [(0, 0, frame(60), 60)], linktype=113), "byte 20: link type 113"),
    (classic(BE, False, [(0, 0, frame(60), 60)])[:32] + struct.pack(">I", MAX_CAPLEN + 1)
     + bytes(100), f"byte 24: record captured length {MAX_CAPLEN + 1} exceeds"),
    (shb(LE) + idb(LE, linktype=101), "link type 101 is not Ethernet"),
    (GOOD + struct.pack("<II", 6, 30) + bytes(40), f"byte {len(GOOD)}: block type 0x6 has "
                                                   f"invalid length 30"),
    (GOOD + epb(LE, 0, 5, frame(8))[:-4] + struct.pack("<I", 99) + GOOD[-20:],
     f"byte {len(GOOD)}: block type 0x6: trailer disagrees"),
    (GOOD + epb(LE, 1, 5, frame(8)), f"byte {len(GOOD)}: block type 0x6 names an interface"),
    (shb(LE) + spb(LE, frame(8)), "names an interface not described by an IDB"),
    (GOOD + _block(LE, 6, struct.pack("<IIIII", 0, 0, 0, 64, 64) + frame(8)),
     "captured length exceeds its block"),
    (shb(LE)[:8] + struct.pack("<I", 0x11223344) + shb(LE)[12:], "byte 8: section header "
                                                                  "byte-order magic"),
    (shb(LE)[:12] + struct.pack("<H", 2) + shb(LE)[14:], "pcapng version 2"),
])
def test_malformed_files_raise_capture_error(tmp_path, content, message):
    assert message in _read_error(tmp_path, content)


@pytest.mark.parametrize("kind", ["pcap", "pcapng", "pcapng-idb"])
def test_truncated_last_record_is_counted_and_ends_reading(tmp_path, kind, caplog):
    if kind == "pcap":
        head = classic(LE, True, [(1, 2, frame(60), 60), (3, 4, frame(70), 70)])
        last = len(head) - 16 - 70
    else:
        head = GOOD + (epb(LE, 0, 6, frame(70)) if kind == "pcapng" else idb(LE, tsresol=9))
        last = len(GOOD)
    for cut in range(last + 1, len(head)):
        path = tmp_path / f"cut{cut}.{kind[:6]}"
        path.write_bytes(head[:cut])
        with caplog.at_level(logging.WARNING, logger="gradtap.capture.pcap"):
            caplog.clear()
            with PcapReader(path) as reader:
                batch = FrameBatch.concat(list(reader))
            assert reader.truncated == 1 and reader.stats()["frames"] == 1
        assert frames_of(batch) == [frame(60)]
        assert f"byte {last}" in caplog.text and "cut off" in caplog.text


def test_reader_arguments_are_validated():
    with pytest.raises(ValueError, match="max_bytes"):
        PcapReader(CAPTURES[0], max_bytes=1000)
    with pytest.raises(ValueError, match="max_frames"):
        PcapReader(CAPTURES[0], max_frames=0)


def test_frame_batch_validates_its_arrays():
    ok = FrameBatch.from_frames([b"abc", b"de"], [1, 2])
    assert frames_of(ok) == [b"abc", b"de"] and ok.nbytes == 5 and ok.offsets.tolist() == [0, 3]
    with pytest.raises(TypeError, match="caplens must be a 1-D int32"):
        FrameBatch(ok.data, ok.offsets, ok.caplens.astype(np.int64), ok.wirelens, ok.ts_ns)
    with pytest.raises(ValueError, match="reach outside"):
        FrameBatch(ok.data, ok.offsets + 1, ok.caplens, ok.wirelens, ok.ts_ns)
    with pytest.raises(ValueError, match="disagree"):
        FrameBatch(ok.data, ok.offsets, ok.caplens, ok.wirelens, ok.ts_ns[:1])
    assert len(FrameBatch.concat([])) == 0


def test_a_frame_batch_is_cut_into_bursts_at_its_pauses():
    batch = FrameBatch.from_frames([b"a", b"b", b"c", b"d", b"e"], [0, 10, 500, 510, 2000])
    parts = batch.bursts(100)
    assert [frames_of(p) for p in parts] == [[b"a", b"b"], [b"c", b"d"], [b"e"]]
    assert all(p.data is batch.data and p.lasting for p in parts)
    assert [frames_of(p) for p in batch.bursts(10)] == [[b"a"], [b"b"], [b"c"], [b"d"], [b"e"]]
    assert [frames_of(p) for p in batch.bursts(10_000)] == [frames_of(batch)]
    assert FrameBatch.from_frames([]).bursts(1) == []


def test_a_frame_batch_is_cut_into_even_pieces_none_empty():
    batch = FrameBatch.from_frames([b"a", b"b", b"c", b"d", b"e"], [0, 1, 2, 3, 4])
    assert [frames_of(p) for p in batch.pieces(2)] == [[b"a", b"b"], [b"c", b"d", b"e"]]
    assert [frames_of(p) for p in batch.pieces(3)] == [[b"a"], [b"b", b"c"], [b"d", b"e"]]
    assert [frames_of(p) for p in batch.pieces(1)] == [frames_of(batch)]
    assert [frames_of(p) for p in batch.pieces(8)] == [[b"a"], [b"b"], [b"c"], [b"d"], [b"e"]]
    assert all(p.data is batch.data and p.lasting for p in batch.pieces(2))
    assert FrameBatch.from_frames([]).pieces(2) == []


def test_a_frame_batch_tail_and_frames_share_its_data():
    batch = FrameBatch.from_frames([b"abc", b"de", b"fghi"], [1, 2, 3], wirelens=[10, 20, 30])
    rest = batch.tail(1)
    assert frames_of(rest) == [b"de", b"fghi"] and rest.ts_ns.tolist() == [2, 3] and rest.data is batch.data
    assert len(batch.tail(3)) == 0
    middle = batch.frames(1, 2)
    assert frames_of(middle) == [b"de"] and middle.wirelens.tolist() == [20] and middle.data is batch.data
    assert middle.lasting and not FrameBatch(batch.data, batch.offsets, batch.caplens, batch.wirelens,
                                             batch.ts_ns).frames(0, 1).lasting


def test_owned_copies_only_what_does_not_last(tmp_path):
    """A pcap reader's batch (the file's mapping, or its own copy) lasts as long as it is held,
    so a parser holding frames while it locks on keeps it as it is; a ring's batch is a view of
    slots the source overwrites once released, so owned() copies it, and the copy lasts."""
    path = CAPTURES[0]
    with PcapReader(path, max_frames=50, copy=False) as reader:
        batch = next(iter(reader))
        assert batch.lasting
        held = batch.owned(10)
        assert held.data is batch.data and frames_of(held) == frames_of(batch)[10:]
    with PcapReader(path, max_frames=50) as reader:
        assert next(iter(reader)).lasting
    ring = FrameRing.create(64, 2048, hugepages="off")
    try:
        ring.push(FrameBatch.from_frames(frames_of(batch)[:40]))
        view = ring.read(40, timeout=0)
        assert not view.lasting
        copy = view.owned(5)
        assert copy.lasting and copy.data is not view.data and frames_of(copy) == frames_of(batch)[5:40]
        ring.release()
        ring.push(FrameBatch.from_frames([b"\xff" * 60] * 40))     # the released slots are written again
        assert frames_of(copy) == frames_of(batch)[5:40]
    finally:
        ring.close()
