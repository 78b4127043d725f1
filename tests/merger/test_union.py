"""The union of streams' copies equals its plain twin, and disagreements are reported; streams that
share one gradient are merged as their whole copies would be."""

import numpy as np
import pytest

from gradtap.merger.union import BucketBlocks, merge_held, union
from gradtap.parser.aside import aside_put, kept, new_aside
from gradtap.parser.stream import AssembledIteration
from gradtap.wire.protocol import Protocol
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


UNIT = 16          # bytes of a unit, one per block, in the shared-gradient tests below


def held_streams(rng, shared: np.ndarray, lo: int, hi: int, streams: int) -> list:
    """Streams placing into one shared gradient (``parser/shared_gradient.py``), each covering
    a random set of the blocks of ``[lo, hi)`` with the shared bytes, and keeping some units
    aside (``parser/aside.py``): copies that differ from the shared bytes (some equal to
    another stream's, so that votes are won and tied), one equal to them, and pending ones."""
    k, first = (hi - lo) // UNIT, lo // UNIT
    blocks = len(shared) // UNIT
    lies = [rng.integers(0, 256, UNIT, dtype=np.uint8) for _ in range(2)]
    held = []
    for s in range(streams):
        got = np.zeros(blocks, np.int32)
        got[first:first + k] = rng.random(k) < 0.6
        aside = new_aside(UNIT, capacity=k)
        for j in np.flatnonzero(rng.random(k) < 0.3):
            if got[first + j]:
                continue
            unit = shared[lo + j * UNIT:lo + (j + 1) * UNIT].copy()
            kind = rng.integers(0, 4)
            if kind < 2:
                unit = lies[kind].copy()
            elif kind == 2:
                unit[rng.integers(0, UNIT)] ^= 1
            aside_put(aside, 0, first + j, 1, int(rng.random() < 0.2), 0, int(Protocol.SIMPLE), j * UNIT, lo, hi - lo,
                      unit, 0, UNIT)
        held.append((f"s{s}", AssembledIteration(f"s{s}", 0, 0, shared, got, np.ones(blocks, np.int32),
                                                 aside=kept(aside, 0, free=True),
                                                 disputed=(rng.random(blocks) < 0.02).astype(np.int32))))
    return held


@pytest.mark.parametrize("seed", range(40))
def test_a_shared_gradient_is_merged_as_the_whole_copies_are(seed):
    """``merge_held`` compares only the blocks where some stream kept units aside; the
    reference builds every stream's whole copy of the bucket (the shared bytes with its units
    laid over) and merges those with ``union``, which ``test_union_equals_its_plain_twin``
    holds to the plain twin. Both give the same coverage, disagreements and bytes."""
    rng = np.random.default_rng(seed)
    total = UNIT * int(rng.integers(6, 40))
    shared = rng.integers(0, 256, total, dtype=np.uint8)
    lo = UNIT * int(rng.integers(0, 3))
    hi = total - UNIT * int(rng.integers(0, 3))
    k = (hi - lo) // UNIT
    blocks = BucketBlocks(np.arange(lo // UNIT, hi // UNIT), np.arange(k) * UNIT, np.full(k, UNIT))
    need = np.ones(k, np.int32)
    held = held_streams(rng, shared, lo, hi, int(rng.integers(1, 5)))
    before = shared.copy()
    spare = np.full(hi - lo + 3, 0xAB, np.uint8)             # a scratch longer than the bucket
    u, covers = merge_held(blocks, lo, hi, need, held, lambda: spare)
    ref = union(blocks, [(s, *a.bucket(lo, hi, blocks.index, need)) for s, a in held], hi - lo)
    assert u.complete == ref.complete
    assert u.covered.tolist() == ref.covered.tolist()
    assert u.mismatches == ref.mismatches
    for j in np.flatnonzero(ref.covered):
        assert u.data[j * UNIT:(j + 1) * UNIT].tobytes() == ref.data[j * UNIT:(j + 1) * UNIT].tobytes()
    assert [s for s, _ in covers] == [s for s, _ in held]
    for (_, c), (_, a) in zip(covers, held):
        assert c.tolist() == a.bucket(lo, hi, blocks.index, need)[1].tolist()
    assert np.array_equal(shared, before), "the shared gradient is only read"
    if not ref.mismatches and all(len(a.aside) == 0 for _, a in held):
        assert np.shares_memory(u.data, shared), "nothing aside: the bucket is the shared bytes"


def test_a_vote_that_keeps_the_shared_bytes_hands_them_without_a_copy():
    """A stream outvoted where it kept its copy aside: the shared bytes win, and the merged
    bucket is the shared gradient itself; where the shared bytes lose, it is assembled in the
    scratch buffer."""
    shared = np.arange(4 * UNIT, dtype=np.uint8)
    blocks = BucketBlocks(np.arange(4), np.arange(4) * UNIT, np.full(4, UNIT))
    need = np.ones(4, np.int32)

    def stream(name, got, lie_at=()):
        aside = new_aside(UNIT)
        for j in lie_at:
            aside_put(aside, 0, j, 1, 0, 0, int(Protocol.SIMPLE), j * UNIT, 0, len(shared), np.full(UNIT, 7, np.uint8),
                      0, UNIT)
        return name, AssembledIteration(name, 0, 0, shared, np.array(got, np.int32), need, aside=kept(aside, 0, True))

    spare, asked = np.zeros(len(shared), np.uint8), []

    def scratch():
        asked.append(True)
        return spare

    outvoted = [stream("a", [1, 1, 1, 1]), stream("b", [1, 1, 1, 1]), stream("liar", [1, 0, 1, 1], lie_at=[1])]
    u, _ = merge_held(blocks, 0, len(shared), need, outvoted, scratch)
    assert u.complete and np.shares_memory(u.data, shared)
    assert not asked, "nothing is assembled: no buffer is asked for"
    assert [(m.block, m.groups, m.resolved) for m in u.mismatches] == [(1, (("a", "b"), ("liar",)), True)]
    winning = [stream("a", [1, 0, 1, 1], lie_at=[1]), stream("b", [1, 0, 1, 1], lie_at=[1]), stream("c", [1, 1, 1, 1])]
    u, _ = merge_held(blocks, 0, len(shared), need, winning, scratch)
    assert u.complete and np.shares_memory(u.data, spare) and asked
    assert (u.data[UNIT:2 * UNIT] == 7).all() and np.array_equal(np.delete(u.data, np.s_[UNIT:2 * UNIT]),
                                                                    np.delete(shared, np.s_[UNIT:2 * UNIT]))
