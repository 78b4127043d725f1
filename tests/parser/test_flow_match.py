"""Which flow a record belongs to (``parser/flow_match.py``), against slow twins.

The kernels must equal ``tests/naive.py``'s ``write_flow`` and ``write_between`` (a struct
decoder, then plain comparisons of the addresses' 16-byte forms) on every frame of the real
NCCL captures of ``../shared/captures``. On records of random bytes, which stage 1 never
writes but which a kernel must survive, they must equal the NumPy expressions lock-on used
before them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradtap.capture.pcap import PcapReader
from gradtap.core.errors import GradtapError
from gradtap.parser.decode import decode_batch
from gradtap.parser.flow_match import ELSEWHERE, pair_keys, record_flows
from gradtap.parser.stream_tables import ip16, stream_tables
from gradtap.wire import events as ev
from gradtap.wire.frame_record import FRAME_DTYPE
from gradtap.wire.headers.opcodes import KIND_WRITE, OPCODE_KIND
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import load_job
from tests import naive
from tests.golden import CAPTURES

ROOT = Path(__file__).resolve().parents[2]
REAL = sorted(CAPTURES.glob("*.pcapng"))


def tables(flows: list[tuple[int, str, str]]):
    """A stream's tables (``configs/small.yaml``'s rank 0) holding exactly ``flows``."""
    job = load_job(ROOT / "configs" / "small.yaml")
    t = stream_tables(job, job_plan(job), job.mirrors[0])
    return t._replace(qpn=np.array([q for q, _, _ in flows], np.uint32).reshape(-1),
                      src_ip=np.array([ip16(s) for _, s, _ in flows], np.uint8).reshape(-1, 16),
                      dst_ip=np.array([ip16(d) for _, _, d in flows], np.uint8).reshape(-1, 16))


def pairs_array(pairs: list[tuple[str, str]]) -> np.ndarray:
    return np.array([np.r_[ip16(s), ip16(d)] for s, d in pairs], np.uint8).reshape(-1, 32)


def decoded(path: Path) -> tuple[np.ndarray, list[dict | None]]:
    """Stage 1's records of a capture (ICRC checked) and the naive decoder's fields of each frame."""
    with PcapReader(path) as reader:
        recs = np.concatenate([decode_batch(b, verify_icrc=True)[0].copy() for b in reader])
    fields = [naive.decode_frame(frame)[0] for _, frame in naive.read_capture(path)]
    assert len(recs) == len(fields)
    return recs, fields


@pytest.mark.parametrize("path", REAL, ids=[p.name for p in REAL])
def test_each_real_frame_gets_the_flow_and_the_pair_the_naive_decoder_gives(path):
    recs, fields = decoded(path)
    seen = sorted({(f["dest_qp"], f["ip_src"], f["ip_dst"]) for f in fields
                   if f is not None and f["opcode"] in naive.RDMA_WRITES})
    assert seen, f"{path.name} holds RDMA WRITEs"
    # Every flow seen but the last, the last one's QPN between the wrong addresses, and a
    # QPN nobody uses: frames of a flow left out, or reversed, belong to none.
    q, src, dst = seen[-1]
    flows = seen[:-1] + [(q, dst, src), (0xABCDE, src, dst)]
    got = record_flows(recs, tables(flows))
    assert got.tolist() == [naive.write_flow(f, flows) for f in fields]
    assert (got >= 0).any()

    pairs = sorted({(s, d) for _, s, d in seen})[::-1]
    for asked in pairs, pairs[:-1]:         # every pair, and all but one: its writes are ELSEWHERE
        got = pair_keys(recs, pairs_array(asked))
        want = [naive.write_between(f, asked) for f in fields]
        assert got.tolist() == [p << 24 | f["dest_qp"] if p >= 0 else ELSEWHERE if _a_write(f) else -1
                                for p, f in zip(want, fields)]
    assert ELSEWHERE in got.tolist()


def _a_write(fields: dict | None) -> bool:
    """Whether the naive decoder's frame is a whole RDMA WRITE (its ICRC right), between any hosts."""
    return fields is not None and fields["opcode"] in naive.RDMA_WRITES and \
        naive.write_between(fields, [(fields["ip_src"], fields["ip_dst"])]) == 0


def _numpy_flows(recs, t):
    """Lock-on's record flows before the kernel (one reduction per flow), the first flow of
    two that match winning, as in stage 2 (lock-on's took the last; no two learnt flows share
    a QPN and addresses)."""
    out = np.full(len(recs), -1, np.int64)
    ok = (recs["event"] == ev.DECODE_OK) & (OPCODE_KIND[recs["opcode"]] == KIND_WRITE)
    for f in range(len(t.qpn)):
        hit = ok & (recs["dest_qp"] == t.qpn[f])
        hit &= (recs["src_ip"] == t.src_ip[f]).all(axis=1) & (recs["dst_ip"] == t.dst_ip[f]).all(axis=1)
        out[hit & (out < 0)] = f
    return out


def _numpy_keys(recs, pairs):
    ok = (recs["event"] == ev.DECODE_OK) & (OPCODE_KIND[recs["opcode"]] == KIND_WRITE)
    key = np.where(ok, ELSEWHERE, -1).astype(np.int64)
    for p, ends in enumerate(pairs):
        hit = ok & (recs["src_ip"] == ends[:16]).all(axis=1) & (recs["dst_ip"] == ends[16:]).all(axis=1)
        key[hit] = (p << 24) | recs["dest_qp"][hit].astype(np.int64)
    return key


@pytest.mark.parametrize("seed", range(4))
def test_records_of_random_bytes_get_what_the_numpy_expressions_gave(seed):
    rng = np.random.default_rng(seed)
    addresses = ["10.0.0.1", "10.0.0.2", "fe80::1", "::ffff:10.0.0.1"]   # the last is the first, mapped
    flows = [(int(rng.integers(1 << 24)), *rng.choice(addresses, 2, replace=False)) for _ in range(6)]
    flows.append(flows[0])                                   # a flow twice: the first index wins
    n = 20_000
    recs = np.frombuffer(rng.bytes(n * FRAME_DTYPE.itemsize), FRAME_DTYPE).copy()
    # Bias the bytes toward matches: decoded writes, the flows' QPNs and addresses.
    recs["event"][rng.random(n) < 0.7] = ev.DECODE_OK
    some = rng.random(n) < 0.7
    recs["opcode"][some] = rng.choice([0x06, 0x07, 0x08, 0x0A, 0x0B, 0x11, 0x26], some.sum())
    pick = rng.integers(len(flows), size=n)
    for k, (q, s, d) in enumerate(flows):
        mine = (pick == k) & (rng.random(n) < 0.8)
        recs["dest_qp"][mine & (rng.random(n) < 0.8)] = q
        recs["src_ip"][mine & (rng.random(n) < 0.9)] = ip16(s)
        recs["dst_ip"][mine & (rng.random(n) < 0.9)] = ip16(d)
    t = tables(flows)
    got = record_flows(recs, t)
    assert np.array_equal(got, _numpy_flows(recs, t))
    assert (got >= 0).sum() > n // 10

    pairs = np.unique(pairs_array([(s, d) for _, s, d in flows]), axis=0)   # as the learner's: each once
    got = pair_keys(recs, pairs)
    assert np.array_equal(got, _numpy_keys(recs, pairs))
    assert (got >= 0).sum() > n // 10

    # A strided view (every other record) is matched as a copy of it would be.
    assert np.array_equal(record_flows(recs[::2], t), _numpy_flows(recs[::2], t))


def test_no_flows_no_pairs_no_records():
    recs = np.zeros(5, FRAME_DTYPE)
    assert record_flows(recs, tables([])).tolist() == [-1] * 5
    assert pair_keys(recs, np.zeros((0, 32), np.uint8)).tolist() == [-1] * 5
    assert record_flows(recs[:0], tables([(1, "10.0.0.1", "10.0.0.2")])).tolist() == []


def test_pairs_of_the_wrong_shape_are_refused_with_what_was_given():
    with pytest.raises(GradtapError, match=r"uint8\[P, 32\]"):
        pair_keys(np.zeros(1, FRAME_DTYPE), np.zeros((2, 16), np.uint8))
