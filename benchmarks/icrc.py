"""ICRC throughput on one thread, against zlib, a table-driven Numba CRC and memcpy.

Frames are real RoCEv2 frames from the captures (1102-byte RDMA WRITE MIDDLE at MTU 1024,
4174-byte at MTU 4096), tiled into a batch much larger than the caches. Each contender
CRCs every frame of the batch in place:

- ``gradtap.wire.icrc.icrc_frame``: masked prefix + ISA-L ``crc32_gzip_refl`` (PCLMULQDQ), or,
  on a host with 256-bit ``vpclmulqdq`` (AVX-512 or not), gradtap's fold for whole 128-byte
  blocks (``wire/crc_fold.py``; the row says which), called per frame from a Numba loop;
- ``gradtap.wire.icrc.icrc_and_payload_crc``: the same ICRC with the payload's own CRC made
  beside it (a CRC call for the payload alone and a shift by table), as the parser checks each
  frame; its target is to cost no more than 5% over the ICRC alone;
- ``zlib.crc32`` per frame from Python (the peer tool; no masking, so it is flattered);
- a byte-at-a-time table-driven CRC-32 in Numba (Sarwate), the classic scalar way.

Throughput is frame bytes per second (GB/s = 1e9 B/s); memcpy bandwidth comes from
``benchmarks._bandwidth`` in the same run. Run: ``python -m benchmarks.icrc``.
"""

import argparse
import os
import time
import zlib
from pathlib import Path

import numpy as np
from numba import njit

from benchmarks._bandwidth import memcpy_bandwidth
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.core.jit import JIT
from gradtap.parser.decode import decode_batch
from gradtap.wire.crc_fold import FOLDS
from gradtap.wire.icrc import ICRC_LEN, icrc_and_payload_crc, icrc_frame, locate_icrc

CAPTURES = Path(__file__).resolve().parents[2] / "shared" / "captures"
SOURCES = {1102: "iter_40000_p2p_iter10.pcapng", 4174: "iter_40000_p2p_iter10_3.pcapng"}
BATCH_BYTES = 64 << 20
REPEATS = 5
# What "fast enough" means: the ICRC must not be what limits the parser, which touches each
# frame byte about once; and PCLMUL folding should beat the scalar ways by a wide margin.
TARGETS = {"memcpy_1t": 1.0, "zlib": 5.0, "table": 10.0, "icrc": 0.95}
ICRC_ROW = f"icrc ({'256-bit fold' if FOLDS else 'ISA-L'}, Numba)"


def _make_table() -> np.ndarray:
    table = np.zeros(256, np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table[i] = c
    return table


_TABLE = _make_table()


@njit(**JIT)
def _icrc_batch(data, offsets, l3s, ends):
    """Frames whose stored ICRC matches."""
    good = 0
    for i in range(len(offsets)):
        base = offsets[i]
        crc = icrc_frame(data, base + l3s[i], True, base + ends[i])
        stored = np.uint32(0)
        for k in range(ICRC_LEN):
            stored |= np.uint32(data[base + ends[i] - ICRC_LEN + k]) << np.uint32(8 * k)
        good += crc == stored
    return good


@njit(**JIT)
def _icrc_payload_batch(data, offsets, l3s, ends, payload_offs, payload_lens):
    """Frames whose stored ICRC matches and whose payload CRC was made."""
    good = 0
    for i in range(len(offsets)):
        base = offsets[i]
        crc, payload_crc = icrc_and_payload_crc(data, base + l3s[i], True, base + payload_offs[i], payload_lens[i],
                                                base + ends[i])
        stored = np.int64(0)
        for k in range(ICRC_LEN):
            stored |= np.int64(data[base + ends[i] - ICRC_LEN + k]) << (8 * k)
        good += crc == stored and payload_crc >= 0
    return good


@njit(**JIT)
def _table_batch(data, offsets, caplens, table):
    """XOR of the table-driven CRC-32 of every frame (keeps the work observable)."""
    acc = np.uint32(0)
    for i in range(len(offsets)):
        crc = np.uint32(0xFFFFFFFF)
        for k in range(offsets[i], offsets[i] + caplens[i]):
            crc = table[(crc ^ data[k]) & 0xFF] ^ (crc >> np.uint32(8))
        acc ^= ~crc
    return acc


def _batch(length: int) -> tuple[FrameBatch, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A ~BATCH_BYTES batch of the capture's frames of this length, with their l3 offsets,
    ends, and payloads' offsets and lengths (within each frame)."""
    source = read_pcap(CAPTURES / SOURCES[length])
    frames = [bytes(source.frame(i)) for i in range(len(source)) if source.caplens[i] == length]
    copies = BATCH_BYTES // (length * len(frames)) + 1
    batch = FrameBatch.from_frames(frames * copies)
    where = [locate_icrc(f) for f in frames]
    assert all(is_ipv6 for _, is_ipv6, _ in where)
    once = FrameBatch.from_frames(frames)
    records, _ = decode_batch(once)
    l3s = np.array([w[0] for w in where] * copies, np.int64)
    ends = np.array([w[2] for w in where] * copies, np.int64)
    payload_offs = np.tile(records["payload_off"] - once.offsets, copies).astype(np.int64)
    payload_lens = np.tile(records["payload_len"], copies).astype(np.int64)
    return batch, l3s, ends, payload_offs, payload_lens


def _best(fn) -> float:
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs "
          f"(other work on the machine lowers every figure)")
    memcpy = {n: memcpy_bandwidth(n) for n in (1, 2)}
    print(f"memcpy bandwidth: 1 thread {memcpy[1]:.2f} GB/s, 2 threads {memcpy[2]:.2f} GB/s")
    for length in SOURCES:
        batch, l3s, ends, payload_offs, payload_lens = _batch(length)
        nbytes = batch.nbytes
        views = [batch.frame(i) for i in range(len(batch))]
        assert _icrc_batch(batch.data, batch.offsets, l3s, ends) == len(batch)
        assert _icrc_payload_batch(batch.data, batch.offsets, l3s, ends, payload_offs, payload_lens) == len(batch)
        rates = {
            ICRC_ROW: nbytes / _best(
                lambda: _icrc_batch(batch.data, batch.offsets, l3s, ends)) / 1e9,
            "icrc + payload CRC": nbytes / _best(
                lambda: _icrc_payload_batch(batch.data, batch.offsets, l3s, ends, payload_offs, payload_lens)) / 1e9,
            "zlib.crc32 per frame": nbytes / _best(
                lambda: [zlib.crc32(v) for v in views]) / 1e9,
            "table-driven Numba": nbytes / _best(
                lambda: _table_batch(batch.data, batch.offsets, batch.caplens, _TABLE)) / 1e9,
        }
        icrc = rates[ICRC_ROW]
        print(f"\n{length}-byte frames, {len(batch)} frames, {nbytes / 1e6:.0f} MB, 1 thread")
        for name, rate in rates.items():
            print(f"  {name:24s} {rate:7.2f} GB/s  {length / rate:8.1f} ns/frame")
        ratios = {"memcpy_1t": icrc / memcpy[1], "zlib": icrc / rates["zlib.crc32 per frame"],
                  "table": icrc / rates["table-driven Numba"], "icrc": rates["icrc + payload CRC"] / icrc}
        print(f"  icrc / memcpy(1 thread) {ratios['memcpy_1t']:5.2f}x   "
              f"icrc / memcpy(2 threads) {icrc / memcpy[2]:5.2f}x")
        print(f"  icrc / zlib {ratios['zlib']:5.2f}x   icrc / table-driven {ratios['table']:5.2f}x   "
              f"icrc + payload CRC / icrc {ratios['icrc']:5.2f}x")
        for key, target in TARGETS.items():
            verdict = "met" if ratios[key] >= target else "NOT met"
            what = "icrc + payload CRC / icrc" if key == "icrc" else f"icrc / {key}"
            print(f"  target {what} >= {target:g}x: {verdict}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    main()
