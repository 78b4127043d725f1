"""One gradient per iteration, shared by the streams' parsers (``parser/shared_gradient.py``,
``parser/aside.py``): the first copy of a unit is written, later ones are compared in
place, a differing one is kept aside for the vote, one with no room left disputes its
block, and a copy placed while the claiming stream is still writing is compared once the
threads are idle (or, with no room left, dropped uncompared). Threads racing for the same
units write each exactly once.

The placing kernel is driven directly here, with Simple packets of 64 bytes, one per block,
so that every case is set up exactly; the pipeline-level checks (every merged gradient equal
to the simulator's truth, a lying stream outvoted whichever stream claims first) are in
``tests/gradtap/test_buffers.py`` and ``tests/gradtap/test_replay.py``."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from numba import config, njit

from gradtap.parser.aside import ASIDE_DTYPE, kept, new_aside, reconcile
from gradtap.parser.assemble import Slots, _own_copy_differs, _place
from gradtap.parser.payload import Deferred, copy_deferred, defer_payload
from gradtap.parser.shared_gradient import GradientPool
from gradtap.parser.stream import AssembledIteration
from gradtap.wire import events as ev
from gradtap.wire.ll128 import LL128_LINE_BYTES
from gradtap.wire.protocol import Protocol

PACKET = 64
BLOCKS = 16
NBYTES = PACKET * BLOCKS


def stream_slots(shared, pending: Deferred | None = None) -> Slots:
    """One stream's single slot over the iteration gradient ``shared``; ``pending``: room for
    the copies it leaves for later (none: it copies as it places)."""
    return Slots(grads=(shared.grad,), claim=(shared.claim,), written=(shared.written,),
                 disputed=(shared.disputed,), crc=(shared.crc,), got=np.zeros((1, len(shared.claim)), np.int32),
                 seen=np.zeros((1, 8), np.uint8), start_ns=np.zeros(1, np.int64), end_ns=np.zeros(1, np.int64),
                 pending=Deferred.room(0) if pending is None else pending)


def packet(k: int, value: int) -> np.ndarray:
    return np.full(PACKET, value, np.uint8)


def place(slots, aside, k, data, payload_crc=-1):
    return _place(data, 0, PACKET, Protocol.SIMPLE, k * PACKET, 0, NBYTES, slots, aside, 0, 0, k, payload_crc)


def crc(data: np.ndarray) -> int:
    """A payload's CRC-32, as stage 1 records it with a good ICRC (here computed by zlib)."""
    return zlib.crc32(data.tobytes())


@pytest.fixture
def shared():
    return GradientPool(NBYTES, BLOCKS, 1).enter(0)


def test_the_first_copy_is_written_and_an_equal_one_is_only_marked(shared):
    a, b = stream_slots(shared), stream_slots(shared)
    aa, ab = new_aside(PACKET), new_aside(PACKET)
    assert place(a, aa, 3, packet(3, 7)) == ev.DATA_WRITTEN
    assert (shared.grad[3 * PACKET:4 * PACKET] == 7).all() and shared.claim[3] == shared.written[3] == 1
    shared.grad[3 * PACKET] = 7            # b's compare reads the shared bytes: prove it does not write them
    assert place(b, ab, 3, packet(3, 7)) == ev.DATA_WRITTEN
    assert a.got[0, 3] == b.got[0, 3] == 1 and ab.used[0] == 0 and not shared.grad[:3 * PACKET].any()


def test_copies_with_crcs_are_compared_by_them_and_the_stored_bytes_are_not_read(shared):
    """A unit written with its payload's CRC is known by it: a later copy with a CRC is
    compared with that, not with the stored bytes (which this test alters, unseen), and one
    with another CRC differs; a copy without one compares the bytes, and so sees the
    alteration. A unit written without a CRC is compared by its bytes, whatever the later
    copy carries."""
    a, b, c, d = (stream_slots(shared) for _ in range(4))
    seven, nine = packet(3, 7), packet(3, 9)
    assert place(a, new_aside(PACKET), 3, seven, crc(seven)) == ev.DATA_WRITTEN
    assert shared.crc[3] == crc(seven) and (shared.crc[np.arange(BLOCKS) != 3] == -1).all()
    shared.grad[3 * PACKET] = 8                                # not what a wrote: only the bytes show it
    assert place(b, new_aside(PACKET), 3, seven, crc(seven)) == ev.DATA_WRITTEN and b.got[0, 3] == 1
    assert place(c, new_aside(PACKET), 3, nine, crc(nine)) == ev.DATA_SET_ASIDE and c.got[0, 3] == 0
    assert place(d, new_aside(PACKET), 3, seven) == ev.DATA_SET_ASIDE and d.got[0, 3] == 0
    assert not _own_copy_differs(seven, 0, PACKET, Protocol.SIMPLE, 3 * PACKET, 0, NBYTES, b, new_aside(PACKET),
                                 0, 0, 3, crc(seven))
    assert _own_copy_differs(nine, 0, PACKET, Protocol.SIMPLE, 3 * PACKET, 0, NBYTES, b, new_aside(PACKET),
                             0, 0, 3, crc(nine))
    e, f = stream_slots(shared), stream_slots(shared)
    assert place(e, new_aside(PACKET), 4, packet(4, 1)) == ev.DATA_WRITTEN and shared.crc[4] == -1
    shared.grad[4 * PACKET] = 2
    assert place(f, new_aside(PACKET), 4, packet(4, 1), crc(packet(4, 1))) == ev.DATA_SET_ASIDE


def test_a_packet_longer_than_its_message_is_known_by_its_bytes(shared):
    """A Simple packet whose payload runs past its message's bytes (only they are written)
    is not known by its payload's CRC: that covers bytes the gradient does not hold."""
    a, b = stream_slots(shared), stream_slots(shared)
    data = packet(0, 5)
    last = BLOCKS - 1
    short = last * PACKET + PACKET // 2                # the message ends halfway into the packet
    for slots, expect in ((a, ev.DATA_WRITTEN), (b, ev.DATA_WRITTEN)):
        assert _place(data, 0, PACKET, Protocol.SIMPLE, last * PACKET, 0, short, slots, new_aside(PACKET), 0, 0, last,
                      crc(data)) == expect
    assert shared.crc[last] == -1 and b.got[0, last] == 1


def test_a_stream_alone_compares_with_its_copies_still_pending(shared):
    """A parser alone leaves each first copy for later (``parser/payload.py``). Another copy
    of a unit still pending is compared with the pending one's bytes in the batch: an equal
    copy is found equal and a differing one differs, with nothing copied yet."""
    pending = Deferred.room(4, 1, BLOCKS)
    a, aa = stream_slots(shared, pending), new_aside(PACKET)
    data = np.concatenate([packet(2, 7), packet(3, 8), packet(3, 9), packet(2, 7), packet(2, 5)])

    def place_at(at, k):
        return _place(data, at, PACKET, Protocol.SIMPLE, k * PACKET, 0, NBYTES, a, aa, 0, 0, k, -1)

    def own_copy_differs(at, k):
        return _own_copy_differs(data, at, PACKET, Protocol.SIMPLE, k * PACKET, 0, NBYTES, a, aa, 0, 0, k, -1)

    assert place_at(0, 2) == place_at(PACKET, 3) == ev.DATA_WRITTEN
    assert pending.count[0] == 2 and not shared.grad.any(), "placed, published, not yet copied"
    assert a.got[0, 2] == a.got[0, 3] == 1 and shared.written[2] == shared.written[3] == 1
    assert not own_copy_differs(3 * PACKET, 2) and own_copy_differs(4 * PACKET, 2) and own_copy_differs(2 * PACKET, 3)
    assert place_at(PACKET, 3) == ev.DATA_WRITTEN and place_at(2 * PACKET, 3) == ev.DATA_DUPLICATE_CONFLICT
    assert pending.count[0] == 2 and not shared.grad.any()
    copy_deferred(pending, data, a.grads)
    assert pending.count[0] == 0 and pending.op_of[0, 2] == 0 and pending.op_of[0, 3] == 1
    assert (shared.grad[2 * PACKET:3 * PACKET] == 7).all() and (shared.grad[3 * PACKET:4 * PACKET] == 8).all()
    assert not own_copy_differs(3 * PACKET, 2) and own_copy_differs(4 * PACKET, 2), "copied: compared in place"


def test_deferred_copies_land_where_they_were_placed_on_every_thread():
    """``copy_deferred`` (non-temporal stores, in runs over every thread) against slice
    assignment: copies of random lengths and places, into two slots, from one batch."""
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    grads = (np.zeros(1 << 19, np.uint8), np.zeros(1 << 19, np.uint8))
    expect = tuple(g.copy() for g in grads)
    pending = Deferred.room(256, 2, 256)
    for j, block in enumerate(rng.permutation(256)):            # disjoint places within 2 KiB each
        n, src, slot = int(rng.integers(0, 2001)), int(rng.integers(0, len(data) - 2048)), j % 2
        dest = int(block) * 2048 + int(rng.integers(0, 48))
        assert defer_payload(pending, src, n, Protocol.SIMPLE, 0, slot, int(block), dest, n)
        expect[slot][dest:dest + n] = data[src:src + n]
    assert not defer_payload(pending, 0, 8, Protocol.SIMPLE, 0, 0, 0, 0, 8), "no room left"
    copy_deferred(pending, data, grads)
    assert pending.count[0] == 0
    assert all(np.array_equal(g, e) for g, e in zip(grads, expect))
    assert not defer_payload(pending, 0, 64, Protocol.LL, 0, 0, 0, 0, 64), "only Simple's bytes move as they are"
    assert not defer_payload(pending, 0, 8, Protocol.SIMPLE, 0, 2, 0, 0, 8), "a slot it has no room for"
    assert not defer_payload(Deferred.room(8), 0, 8, Protocol.SIMPLE, 0, 0, 0, 0, 8)


def _place_batches(batches, pending):
    """One stream places ``batches`` of (block, value, duplicate) packets as the kernel
    would: a duplicate (its PSN seen already) is compared with the stream's own copy, any
    other packet placed; the copies left pending are made after each batch. What it did:
    each packet's outcome, then the shared and per-stream state."""
    shared = GradientPool(NBYTES, BLOCKS, 1).enter(0)
    slots, aside = stream_slots(shared, pending), new_aside(PACKET, capacity=4)
    outcomes = []
    for packets in batches:
        data = np.concatenate([packet(k, v) for k, v, _ in packets])
        for i, (k, _, duplicate) in enumerate(packets):
            if duplicate:
                outcomes.append(bool(_own_copy_differs(data, i * PACKET, PACKET, Protocol.SIMPLE, k * PACKET, 0, NBYTES,
                                                       slots, aside, 0, 0, k, -1)))
            else:
                outcomes.append(int(_place(data, i * PACKET, PACKET, Protocol.SIMPLE, k * PACKET, 0, NBYTES, slots,
                                           aside, 0, 0, k, -1)))
        if pending.count[0]:
            copy_deferred(pending, data, slots.grads)
    return outcomes, (shared.grad, shared.claim, shared.written, shared.disputed, slots.got, aside.used)


@pytest.mark.parametrize("seed", range(12))
def test_a_stream_alone_places_random_batches_as_one_that_copies_in_place(seed):
    """Random batches of one stream's packets, with repeats of blocks (equal and differing,
    placed again or compared as duplicates, in the same batch or a later one): leaving the
    copies pending gives every outcome and every byte of state that copying in place gives."""
    rng = np.random.default_rng(seed)
    batches = [[(int(rng.integers(0, BLOCKS)), int(rng.integers(1, 4)), bool(rng.random() < 0.3))
                for _ in range(int(rng.integers(1, 24)))] for _ in range(int(rng.integers(1, 5)))]
    inline = _place_batches(batches, Deferred.room(0))
    deferred = _place_batches(batches, Deferred.room(32, 1, BLOCKS))
    assert deferred[0] == inline[0]
    for a, b in zip(deferred[1], inline[1]):
        assert np.array_equal(a, b)


def test_a_differing_copy_is_kept_aside_and_shown_to_the_vote(shared):
    a, c = stream_slots(shared), stream_slots(shared)
    aa, ac = new_aside(PACKET), new_aside(PACKET)
    place(a, aa, 5, packet(5, 1))
    assert place(c, ac, 5, packet(5, 2)) == ev.DATA_SET_ASIDE
    assert c.got[0, 5] == 0 and ac.used[0] == 1 and (shared.grad[5 * PACKET:6 * PACKET] == 1).all()
    need = np.ones(BLOCKS, np.int32)
    mine = AssembledIteration("c", 0, 0, shared.grad, c.got[0].copy(), need, aside=kept(ac, 0, free=True),
                              disputed=shared.disputed)
    data, covered = mine.bucket(0, NBYTES, np.arange(BLOCKS), need)
    assert np.flatnonzero(covered).tolist() == [5]
    assert (data[5 * PACKET:6 * PACKET] == 2).all(), "the stream's own bytes, laid over the shared ones"
    assert not mine.bucket(0, NBYTES, np.arange(6, BLOCKS), need[6:])[1].any()
    assert (shared.grad[5 * PACKET:6 * PACKET] == 1).all() and ac.used[0] == 0
    theirs = AssembledIteration("a", 0, 0, shared.grad, a.got[0].copy(), need, disputed=shared.disputed)
    data, covered = theirs.bucket(0, NBYTES, np.arange(BLOCKS), need)
    assert np.shares_memory(data, shared.grad), "a stream that kept nothing aside shows the shared bytes as they are"


def test_a_differing_copy_with_no_room_disputes_its_block_for_every_stream(shared):
    a, c = stream_slots(shared), stream_slots(shared)
    place(a, new_aside(PACKET), 2, packet(2, 1))
    assert place(c, new_aside(PACKET, capacity=0), 2, packet(2, 9)) == ev.DATA_ASIDE_FULL
    assert shared.disputed[2] == 1 and c.got[0, 2] == 0
    need = np.ones(BLOCKS, np.int32)
    a_holds = AssembledIteration("a", 0, 0, shared.grad, a.got[0].copy(), need, disputed=shared.disputed)
    assert not a_holds.bucket(0, NBYTES, np.arange(BLOCKS), need)[1][2], "a disputed block counts as covered"


def test_a_copy_of_a_unit_still_being_written_with_no_room_is_dropped_not_disputed(shared):
    """Nothing says such a copy differs: the claiming stream's copy still covers the unit, and
    the iteration stays recoverable (a dispute would lose it)."""
    b = stream_slots(shared)
    shared.claim[4] = 1                    # another stream has claimed block 4 and is still writing it
    assert place(b, new_aside(PACKET, capacity=0), 4, packet(4, 3)) == ev.DATA_UNCHECKED
    assert shared.disputed[4] == 0 and b.got[0, 4] == 0 and shared.written[4] == 0


def test_a_pending_unit_of_a_frame_counted_as_another_event_is_not_recounted(shared):
    """A frame's event is counted once. Its first pending unit stands for the frame as
    ``data.written`` until reconcile finds it differs; a frame that ends in another event
    (here its second LL128 line differs and finds no room) leaves reconcile nothing to move."""
    b = stream_slots(shared)
    shared.claim[0] = 0b11                  # another stream claimed both lines of block 0 ...
    shared.written[0] = 0b10                # ... and wrote the second: zeros, unlike b's sevens
    aside = new_aside(LL128_LINE_BYTES, capacity=1)
    frame = np.full(2 * LL128_LINE_BYTES, 7, np.uint8)
    assert _place(frame, 0, len(frame), Protocol.LL128, 0, 0, NBYTES, b, aside, 0, 0, 0, -1) == ev.DATA_ASIDE_FULL
    assert aside.used[0] == 1 and aside.rec[0]["pending"] == 1 and shared.disputed[0] == 0b10
    shared.written[0] = 0b11                # the first line is written now, zeros too
    assert reconcile(aside, b.grads, b.written, b.got) == 0, "the frame was counted as data.aside_full"
    assert aside.rec[0]["pending"] == 0, "the differing line stays aside for the vote"


@pytest.mark.parametrize("equal", [True, False])
def test_a_copy_placed_while_the_claimant_writes_is_compared_once_idle(shared, equal):
    b = stream_slots(shared)
    ab = new_aside(PACKET)
    shared.claim[6] = 1                    # another stream has claimed block 6 and is writing it
    counters = np.zeros(ev.N_EVENTS, np.int64)
    counters[place(b, ab, 6, packet(6, 4))] += 1
    assert counters[ev.DATA_WRITTEN] == 1 and ab.used[0] == 1 and ab.rec[0]["pending"] == 1 and b.got[0, 6] == 0
    shared.grad[6 * PACKET:7 * PACKET] = 4 if equal else 5
    shared.written[6] = 1                  # ... and has published it
    differing = reconcile(ab, b.grads, b.written, b.got)
    if equal:
        assert differing == 0 and b.got[0, 6] == 1 and ab.used[0] == 0
    else:
        assert differing == 1 and b.got[0, 6] == 0 and ab.used[0] == 1 and ab.rec[0]["pending"] == 0


def test_pending_copies_of_a_retired_iteration_are_compared_like_those_held(shared):
    """Copied out with their iteration (``kept``), pending copies are compared by
    ``AsideCopies.reconciled`` as ``reconcile`` compares them in the stream's area: one equal to
    the written unit is dropped and covered, one that differs stays (compared), one whose unit
    is not written yet stays pending; the copies left keep their own bytes."""
    b = stream_slots(shared)
    ab = new_aside(PACKET)
    shared.claim[[2, 7, 9]] = 1            # another stream claimed blocks 2, 7 and 9 and is writing them
    for k, value in ((2, 4), (7, 5), (9, 6)):
        assert place(b, ab, k, packet(k, value)) == ev.DATA_WRITTEN
    copies = kept(ab, 0, free=True)
    assert len(copies) == 3 and copies.rec["pending"].all() and ab.used[0] == 0
    got = b.got[0].copy()
    shared.grad[2 * PACKET:3 * PACKET] = 4     # equal to b's copy
    shared.grad[7 * PACKET:8 * PACKET] = 8     # not b's
    shared.written[[2, 7]] = 1                 # block 9 is not written yet
    left, differing = copies.reconciled(shared.grad, shared.written, got)
    assert differing == 1 and got[2] == 1 and got[7] == got[9] == 0
    assert left.rec["block"].tolist() == [7, 9] and left.rec["pending"].tolist() == [0, 1]
    assert left.rec["slot"].tolist() == [0, 0]
    need = np.ones(BLOCKS, np.int32)
    view = AssembledIteration("b", 0, 0, shared.grad, got, need, aside=left, disputed=shared.disputed)
    data, covered = view.bucket(0, NBYTES, np.arange(BLOCKS), need)
    assert (data[7 * PACKET:8 * PACKET] == 5).all() and (data[9 * PACKET:10 * PACKET] == 6).all()
    assert np.flatnonzero(covered).tolist() == [2, 7, 9]
    assert copies.reconciled(shared.grad, shared.written, got)[1] == 1, "the original copies are unchanged"
    none_pending, moved = left.reconciled(shared.grad, np.zeros_like(shared.written), got)
    assert none_pending.rec["block"].tolist() == [7, 9] and moved == 0


def test_a_second_copy_is_compared_with_the_streams_own_first(shared):
    a, c = stream_slots(shared), stream_slots(shared)
    ac = new_aside(PACKET)
    place(a, new_aside(PACKET), 1, packet(1, 1))
    place(c, ac, 1, packet(1, 2))          # c's first copy differs from a's: kept aside
    same = _own_copy_differs(packet(1, 2), 0, PACKET, Protocol.SIMPLE, PACKET, 0, NBYTES, c, ac, 0, 0, 1, -1)
    other = _own_copy_differs(packet(1, 1), 0, PACKET, Protocol.SIMPLE, PACKET, 0, NBYTES, c, ac, 0, 0, 1, -1)
    assert not same and other, "c's retransmission is compared with c's own copy, not with a's"
    assert not _own_copy_differs(packet(1, 1), 0, PACKET, Protocol.SIMPLE, PACKET, 0, NBYTES, a, new_aside(PACKET),
                                 0, 0, 1, -1)


@njit(nogil=True)
def _place_all(data, crcs, slots, aside, counters):
    for k in range(slots.got.shape[1]):
        counters[_place(data, k * PACKET, PACKET, Protocol.SIMPLE, k * PACKET, 0, data.shape[0], slots, aside, 0, 0,
                        k, crcs[k])] += 1


@pytest.mark.skipif(config.DISABLE_JIT, reason="threads race only in compiled code (nogil)")
@pytest.mark.parametrize("by_crc", [False, True])
def test_racing_streams_write_every_unit_once_and_all_cover_it(by_crc):
    """Every stream finds every other copy equal, whether by the bytes or by the CRCs (each
    published with its unit: one read before it would be -1, and the bytes compared)."""
    blocks = 1 << 12
    data = np.random.default_rng(1).integers(0, 256, blocks * PACKET, dtype=np.uint8)
    crcs = np.array([crc(data[k * PACKET:(k + 1) * PACKET]) if by_crc else -1 for k in range(blocks)], np.int64)
    for trial in range(8):
        shared = GradientPool(blocks * PACKET, blocks, 1).enter(0)
        streams = [stream_slots(shared) for _ in range(3)]
        asides = [new_aside(PACKET, capacity=blocks) for _ in streams]
        counters = [np.zeros(ev.N_EVENTS, np.int64) for _ in streams]
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: _place_all(data, crcs, streams[s], asides[s], counters[s]), range(3)))
        for s in range(3):
            reconcile(asides[s], streams[s].grads, streams[s].written, streams[s].got)
        assert np.array_equal(shared.grad, data) and (shared.written == 1).all(), trial
        assert np.array_equal(shared.crc, crcs), trial
        assert all((s.got == 1).all() for s in streams) and all(a.used[0] == 0 for a in asides), trial
        assert [int(c[ev.DATA_WRITTEN]) for c in counters] == [blocks] * 3, trial


def test_the_pool_shares_by_iteration_and_reuses_what_is_done():
    pool = GradientPool(NBYTES, BLOCKS, 2)
    first = [pool.enter(0), pool.enter(1)]
    assert pool.enter(0) is first[0] and pool.fresh == 0
    first[0].grad[:] = 3
    first[0].claim[:] = 1
    pool.leave(first[0])
    pool.leave(first[0])                   # both parsers have moved past iteration 0
    assert pool.enter(2) is not first[0] and pool.fresh == 1, "not reused before its consumer is done"
    pool.done(first[0], 0)
    again = pool.enter(3)
    assert again is first[0] and not again.claim.any() and (again.grad == 3).all(), \
        "reused with its bitmaps cleared, its bytes left as they are"
    pool.done(again, 0)                    # a late done for the iteration it served before: ignored
    assert not again.consumed
    assert ASIDE_DTYPE.itemsize % 8 == 0
