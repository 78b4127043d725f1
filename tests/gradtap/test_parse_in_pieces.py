"""How a round spreads the streams' parsing over the cores (``gradtap.pipeline.parse_in_pieces``):
with more streams than threads each batch is cut in even pieces, a stream's pieces are parsed
in order and never on two threads at once, every frame exactly once; a stream whose parse
raises stops, the others finish, and the error comes out after them. The pipeline built on
it replays bit for bit (``test_buffers.py``, ``test_replay.py``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gradtap.capture.frames import FrameBatch
from gradtap.pipeline import parse_in_pieces


def batch(n: int, first_ts: int) -> FrameBatch:
    """``n`` one-byte frames whose timestamps number them from ``first_ts``."""
    return FrameBatch.from_frames([b"x"] * n, ts_ns=np.arange(first_ts, first_ts + n))


class Recorder:
    """A parse callback that records which frames each stream saw, in which order, and how
    many calls ran at once. Each call sleeps, ``slow`` streams longer, so that overlaps show
    and streams fall out of step."""

    def __init__(self, fail: str | None = None, slow: tuple[str, ...] = ("s0",)):
        self.seen: dict[str, list[int]] = {}
        self.pieces: dict[str, int] = {}
        self.active: set[str] = set()
        self.most = 0
        self.fail, self.slow = fail, slow
        self._lock = threading.Lock()

    def __call__(self, name: str, piece: FrameBatch):
        with self._lock:
            assert name not in self.active, f"stream {name} parsed on two threads at once"
            self.active.add(name)
            self.most = max(self.most, len(self.active))
        try:
            time.sleep(0.03 if name in self.slow else 0.005)
            if name == self.fail:
                raise RuntimeError(f"{name}: planted")
            self.seen.setdefault(name, []).extend(piece.ts_ns.tolist())
            self.pieces[name] = self.pieces.get(name, 0) + 1
            return name, [f"{name}:{int(piece.ts_ns[0])}"]
        finally:
            with self._lock:
                self.active.discard(name)


@pytest.mark.parametrize("streams,threads,pieces", [(3, 2, 2), (5, 2, 2), (5, 4, 4), (2, 2, 1), (1, 2, 1),
                                                    (4, 2, 1), (6, 4, 2)])
def test_each_stream_is_parsed_in_order_once_on_at_most_the_threads_given(streams, threads, pieces):
    work = [(f"s{k}", batch(100 + k, 1000 * k)) for k in range(streams)]
    parse = Recorder()
    with ThreadPoolExecutor(threads) as pool:
        out = parse_in_pieces(pool, threads, work, parse)
    assert [name for name, _ in out] == [name for name, _ in work]
    for (name, b), (_, returned) in zip(work, out):
        assert parse.seen[name] == b.ts_ns.tolist(), f"{name}: frames lost, repeated or out of order"
        assert parse.pieces[name] == pieces
        assert returned == [f"{name}:{int(b.ts_ns[len(b) * k // pieces])}" for k in range(pieces)]
    assert parse.most == min(threads, streams), "the threads did not all work at once"


def test_a_stream_that_raises_stops_and_the_error_comes_after_the_others():
    work = [(f"s{k}", batch(64, 1000 * k)) for k in range(3)]
    parse = Recorder(fail="s0", slow=("s1", "s2"))
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(RuntimeError, match="s0: planted"):
            parse_in_pieces(pool, 2, work, parse)
        assert not parse.active, "a thread was still parsing when the error came out"
    assert "s0" not in parse.seen, "s0 went on after its error"
    for name, b in work[1:]:
        assert parse.seen[name] == b.ts_ns.tolist()


def test_a_batch_shorter_than_the_cut_is_not_parsed_in_empty_pieces():
    work = [(f"s{k}", batch(1, 1000 * k)) for k in range(3)]
    parse = Recorder()
    with ThreadPoolExecutor(2) as pool:
        parse_in_pieces(pool, 2, work, parse)
    assert parse.pieces == {"s0": 1, "s1": 1, "s2": 1}
    assert parse.seen == {"s0": [0], "s1": [1000], "s2": [2000]}
