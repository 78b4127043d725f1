"""``parser/inspect_flows.py``: the flow table equals a plain-dict twin (ids in order of first
appearance, per-flow frames and opcodes, flows and frames past the limit), through every
growth of its hash tables, and its memory follows what it holds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from gradtap.parser.inspect_flows import UNTRACKED_EXACT, FlowTable
from gradtap.wire.events import DECODE_OK
from gradtap.wire.frame_record import FRAME_DTYPE


def records(rng, n: int, flows: int, roce_share: float = 0.9) -> np.ndarray:
    """``n`` records over ``flows`` distinct keys (both IP versions, addresses and QPs that
    differ in one field only), some not RoCEv2, with random opcodes."""
    recs = np.zeros(n, FRAME_DTYPE)
    which = rng.integers(0, flows, n)
    recs["ip_version"] = np.where(which % 2, 6, 4)
    recs["src_ip"][:, 15] = which // 2 % 7
    recs["dst_ip"][:, 0] = which // 14 % 5
    recs["dest_qp"] = which // 70
    recs["opcode"] = rng.choice([0x06, 0x07, 0x0A, 0x11, 0xAA], n)
    recs["event"] = DECODE_OK + 1                   # no protocol sampling: no payload bytes to read
    recs["payload_off"] = np.where(rng.random(n) < roce_share, 60, -1)
    return recs


def twin(batches: list[np.ndarray], limit: int) -> tuple[dict, list, Counter, Counter]:
    """Plain Python: flow ids by first appearance (up to ``limit``), opcodes per flow, and
    the distinct flows and frames past the limit."""
    ids, ops, untracked_frames, untracked = {}, [], 0, set()
    for recs in batches:
        for r in recs:
            if r["payload_off"] < 0:
                continue
            key = (int(r["ip_version"]), bytes(r["src_ip"]), bytes(r["dst_ip"]), int(r["dest_qp"]))
            if key not in ids and len(ids) < limit:
                ids[key] = len(ids)
                ops.append(Counter())
            if key in ids:
                ops[ids[key]][str(int(r["opcode"]))] += 1
            else:
                untracked_frames += 1
                untracked.add(key)
    return ids, ops, untracked_frames, untracked


@pytest.mark.parametrize("limit", [1, 37, 300, 10_000])
def test_the_table_equals_its_twin_through_every_growth(limit):
    rng = np.random.default_rng(limit)
    batches = [records(rng, n, 2000) for n in (1, 700, 3000, 5000)]
    table = FlowTable(limit)
    for recs in batches:
        ids = table.assign(recs)
        table.accumulate(recs, ids, np.zeros(0, np.uint8))
        assert ((ids == -1) == (recs["payload_off"] < 0)).all()
    want_ids, want_ops, frames, untracked = twin(batches, limit)
    got = table.describe()
    assert len(got) == len(want_ids) == min(limit, len(want_ids) + len(untracked))
    assert [Counter(f["opcodes"]) for f in got] == want_ops
    assert [sum(f["opcodes"].values()) for f in got] == [f["frames"] for f in got]
    assert table.untracked == {"limit": limit, "flows": len(untracked), "frames": frames, "flows_exact": True}
    # Looking up without adding: known flows keep their ids, the others are -2.
    again = table.assign(batches[-1], insert=False)
    roce = batches[-1]["payload_off"] >= 0
    keys = [(int(r["ip_version"]), bytes(r["src_ip"]), bytes(r["dst_ip"]), int(r["dest_qp"])) for r in batches[-1]]
    want = [want_ids.get(k, -2) for k, ok in zip(keys, roce) if ok]
    assert [int(i) for i, ok in zip(again, roce) if ok] == want
    assert table.untracked["frames"] == frames          # a lookup counts nothing


def test_memory_follows_what_the_table_holds():
    rng = np.random.default_rng(1)
    table = FlowTable(65536)
    recs = records(rng, 3000, 40, roce_share=1.0)
    table.accumulate(recs, table.assign(recs), np.zeros(0, np.uint8))
    small = sum(a.nbytes for a in table.t)
    assert len(table) == 40 and small < 40_000          # not 65536 rows for 40 flows

    recs = np.zeros(200_000, FRAME_DTYPE)
    recs["dest_qp"] = np.arange(len(recs))
    recs["payload_off"] = 60
    table = FlowTable(65536)
    table.accumulate(recs, table.assign(recs), np.zeros(0, np.uint8))
    assert len(table) == 65536 and table.untracked["flows"] == 200_000 - 65536
    # Tracked: a 5-word key, 10 counters, a slot and an opcode entry (load <= 1/2 each, one
    # doubling of headroom); not tracked: a fingerprint (8 B at load <= 1/2, one doubling).
    assert sum(a.nbytes for a in table.t) <= 65536 * (40 + 80 + 2 * 8 * 2 + 2 * 16 * 2) + 134_464 * 8 * 2 * 2


def test_flows_past_the_exact_count_are_a_lower_bound():
    """The fingerprints of flows not tracked stop at UNTRACKED_EXACT (64 MiB); flows after
    that are still counted by their frames, and ``flows_exact`` says the count is a bound."""
    table = FlowTable(1)
    extra = 1000
    total = UNTRACKED_EXACT + 1 + extra
    for lo in range(0, total, 1 << 18):
        recs = np.zeros(min(1 << 18, total - lo), FRAME_DTYPE)
        recs["dest_qp"] = np.arange(lo, lo + len(recs)) & 0xFFFFFF
        recs["src_ip"][:, 0] = np.arange(lo, lo + len(recs)) >> 24
        recs["payload_off"] = 60
        table.assign(recs)
    assert table.untracked == {"limit": 1, "flows": UNTRACKED_EXACT, "frames": total - 1, "flows_exact": False}
    assert table.t.untracked.nbytes == 2 * UNTRACKED_EXACT * 8
