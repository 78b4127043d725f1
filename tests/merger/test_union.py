"""The union of streams' copies equals its plain twin, and disagreements are reported."""

import numpy as np
import pytest

from gradtap.merger.union import BucketBlocks, union
from tests.merger import naive_union


def blocks_of(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return BucketBlocks(np.arange(100, 100 + len(sizes)), starts, np.asarray(sizes, np.int64))


def test_union_fills_holes_from_other_streams():
    blocks = blocks_of([4, 4, 4])
    truth = np.arange(12, dtype=np.uint8)
    a = ("a", truth.copy(), np.array([True, False, True]))
    b = ("b", truth.copy(), np.array([False, True, True]))
    u = union(blocks, [a, b], 12)
    assert u.complete and u.mismatches == () and u.data.tobytes() == truth.tobytes()


def test_missing_block_is_not_covered():
    blocks = blocks_of([4, 4])
    u = union(blocks, [("a", np.zeros(8, np.uint8), np.array([True, False]))], 8)
    assert not u.complete and list(u.covered) == [True, False]


def test_mismatch_names_streams_and_block_and_majority_wins():
    blocks = blocks_of([4, 4])
    good = np.arange(8, dtype=np.uint8)
    bad = good.copy()
    bad[5] ^= 1
    copies = [("a", good, np.array([True, True])), ("b", bad, np.array([True, True])),
              ("c", good, np.array([True, True]))]
    u = union(blocks, copies, 8)
    assert u.complete and u.data.tobytes() == good.tobytes()
    (m,) = u.mismatches
    assert m.block == 101 and m.groups == (("a", "c"), ("b",)) and m.resolved


def test_a_tie_leaves_the_block_uncovered():
    blocks = blocks_of([4])
    a = np.zeros(4, np.uint8)
    b = np.ones(4, np.uint8)
    u = union(blocks, [("a", a, np.array([True])), ("b", b, np.array([True]))], 4)
    assert not u.complete and not u.mismatches[0].resolved


def test_a_stream_outvoted_in_the_bucket_loses_its_ties():
    # r0 misplaced a flow: wrong in block 0 (where r1 and r2 outvote it) and in block 1,
    # which only r1 covers besides it. Leaving r0 out would give r1's block 1: so must the union.
    blocks = blocks_of([4, 4, 4])
    good = np.arange(12, dtype=np.uint8)
    wrong = good.copy()
    wrong[[0, 4]] ^= 0xFF
    copies = [("r0", wrong, np.array([True, True, False])), ("r1", good, np.array([True, True, True])),
              ("r2", good, np.array([True, False, True]))]
    u = union(blocks, copies, 12)
    assert u.complete and u.data.tobytes() == good.tobytes()
    first, second = u.mismatches
    assert first.resolved and first.distrusted == ()
    assert second.block == 101 and second.resolved and second.distrusted == ("r0",)


def test_a_tie_between_streams_both_outvoted_stays_uncovered():
    blocks = blocks_of([4, 4, 4])
    good = np.arange(12, dtype=np.uint8)
    a, b = good.copy(), good.copy()
    a[[0, 8]] ^= 1
    b[[4, 8]] ^= 2
    copies = [("a", a, np.array([True, True, True])), ("b", b, np.array([True, True, True])),
              ("c", good, np.array([True, True, False]))]
    u = union(blocks, copies, 12)
    assert list(u.covered) == [True, True, False]
    assert not u.mismatches[2].resolved


@pytest.mark.parametrize("scratch", [False, True], ids=["fresh", "scratch"])
@pytest.mark.parametrize("seed", range(30))
def test_union_equals_its_plain_twin(seed, scratch):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, size=rng.integers(1, 12))
    blocks = blocks_of(sizes)
    total = int(sizes.sum())
    truth = rng.integers(0, 256, total, dtype=np.uint8)
    copies = []
    for s in range(rng.integers(1, 5)):
        data = truth.copy()
        if rng.random() < 0.5:     # a wrong stream: wrong in one to three places
            for _ in range(rng.integers(1, 4)):
                data[rng.integers(0, total)] ^= 1 << int(rng.integers(0, 8))
        copies.append((f"s{s}", data, rng.random(len(sizes)) < 0.7))
    # A reused buffer holds the last bucket's bytes: garbage, wherever the union is not written.
    spare = np.full(total + 5, 0xAB, np.uint8) if scratch else None
    u = union(blocks, copies, total, spare)
    if scratch and u.complete:
        data = u.data
        assert any(np.shares_memory(data, c) for _, c, _ in copies) or np.shares_memory(data, spare)
    ranges = list(zip(blocks.start.tolist(), blocks.nbytes.tolist()))
    merged, covered, mismatches = naive_union.union(ranges, [(n, d.tobytes(), list(c)) for n, d, c in copies])
    assert list(u.covered) == covered
    for j, value in enumerate(merged):
        if value is not None:
            start, n = ranges[j]
            assert u.data[start:start + n].tobytes() == value
    assert [(int(m.block) - 100, [list(g) for g in m.groups]) for m in u.mismatches] == \
        [(j, [list(g) for g in groups]) for j, groups in mismatches]


def test_a_bucket_whole_from_one_stream_is_that_streams_copy_and_others_use_the_scratch():
    blocks = blocks_of([4, 4])
    truth = np.arange(8, dtype=np.uint8)
    a, b = ("a", truth.copy(), np.array([True, True])), ("b", truth.copy(), np.array([False, True]))
    spare = np.zeros(16, np.uint8)
    assert union(blocks, [a, b], 8, spare).data is a[1]
    c = ("c", truth.copy(), np.array([False, True]))
    d = union(blocks, [("a", truth.copy(), np.array([True, False])), c], 8, spare).data
    assert np.shares_memory(d, spare) and d.tobytes() == truth.tobytes()
    with pytest.raises(ValueError, match="scratch"):
        union(blocks, [a], 8, np.zeros(4, np.uint8))
