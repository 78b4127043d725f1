"""The merger's arenas: one per iteration, reused only once given back, and never more kept
than the bounds say."""

import numpy as np

from gradtap.merger.arenas import FINISHED, KEEP, Arenas


def test_an_iteration_keeps_its_arena_and_a_later_one_reuses_it_only_once_given_back():
    arenas = Arenas(64)
    a = arenas.of(0)
    assert arenas.of(0) is a and a.dtype == np.uint8 and a.shape == (64,)
    arenas.finish(0)
    b = arenas.of(1)
    assert b is not a, "finished but not given back: still the sink's"
    assert [x is a for x in arenas.finished()] == [True] and arenas.finished() == []
    arenas.give_back(a)
    assert arenas.of(2) is a and arenas.made == 2


def test_spare_and_finished_arenas_are_bounded():
    arenas = Arenas(8)
    for g in range(FINISHED + 3):
        arenas.of(g)
        arenas.finish(g)
    finished = arenas.finished()
    assert len(finished) == FINISHED, "an arena nobody gives back is dropped"
    for arena in finished:
        arenas.give_back(arena)
    reused = [arenas.of(100 + k) for k in range(KEEP + 1)]
    assert sum(any(r is f for f in finished) for r in reused) == KEEP
    arenas.finish(12345)                             # an iteration that took none: nothing to give back
    assert arenas.finished() == []
