"""Stages 1 and 2 of a locked stream over a batch in pieces that stay in the cache, in one
compiled loop.

With the ICRC checked in stage 1, every frame is read from memory whole by stage 1's threads
(``parser/decode.py``), and then read again by stage 2 (``parser/assemble.py``) and by the
payload copies after it (``parser/payload.py``). A batch of thousands of 4 KB frames has left
the cores' caches by then. Cut into pieces of about half a core's L2 cache per thread, each
piece is decoded, placed and copied before the next is read, and the second read finds the
piece in the cache.

With the ICRC checked in stage 2 (``defer_icrc``: a parser with at most a core to itself),
stage 1 reads each frame's headers alone, and stage 2 reads them again before it reads the
whole frame for the check. A batch of 8192 frames of 4 KB spans about 8192 pages, more than the core's
TLB and L2 cache keep between the two reads, so each frame's headers came from memory twice.
In pieces of half the L2 cache, decoded on the calling thread, stage 2 finds them in the
cache. One stream of GPT-2 small (``r0-egress`` of ``benchmarks.replay``'s capture) from the
page cache in batches of 8192 frames, on one thread of an AMD EPYC (Zen 3, 512 KiB of L2 per
core; 6 alternations): 0.401-0.405 s (median 0.481-0.485) in pieces against 0.462-0.479
(0.554-0.590) whole. The whole replay of 2 iterations: 1.35-1.81 s (median 1.51 over 9
replays) against 1.62-1.76 (median 1.69 over 5), alternated. A parallel region for each piece
cost more than it saved (in pieces of 128 frames, 2.3-2.6 thread-s for that replay's parse,
against 1.7-2.3 whole). Without the ICRC check, pieces gained nothing (0.233 s against 0.220
on one thread, 0.187 against 0.164 on two): stage 2 reads only the headers and the payload
it copies.

The cut used to be made in Python, one call of each stage per piece: some 25 us of calls for
every piece (stage 1's checks, allocations and dispatch: 13 us; stage 2's arguments: 10 us),
so pieces small enough for the L2 cost more than they saved. :func:`parse_pieces` runs the
loop compiled, with the stream's arguments unpacked once per batch. One stream of GPT-2 small
(``r0-egress`` of ``benchmarks.replay``'s capture: 432 k frames, 1.74 GB of payload), ICRC on,
the reader's batches of 65,536 frames, on a Xeon (family 6 model 207, 2 MiB of L2 per core;
medians of 8 alternations, each the best of 3): on 2 threads 0.175 s whole, 0.162-0.164 in
pieces of 1, 2 or 3 MiB; on one thread 0.307 s whole, 0.274 in pieces of 1 MiB. The counters
and every byte placed are the same. The loop runs without reference counting (``core/jit.py``):
with it, each piece's call of stage 2 took a reference to every array of the stream's tables,
state and slots, 1.6 per frame of an LL stream in pieces of half the L2 cache.

Stage 2 needs the records of every frame before it when a flow is still to be placed
(``parser/lockon.py`` reads them first), so the loop serves a stream whose data flows are all
placed; :class:`~gradtap.parser.stream.StreamParser` says when.
"""

from __future__ import annotations

from numba import njit

from gradtap.core.jit import JIT_NO_REFCOUNT
from gradtap.parser.assemble import DONE, NEED_ADVANCE, assemble
from gradtap.parser.decode import decode_parts, decode_run
from gradtap.parser.payload import copy_deferred


@njit(**JIT_NO_REFCOUNT)
def parse_pieces(data, offsets, caplens, wirelens, ts_ns, verify_icrc, decapsulate, recs, parts, start, piece,
                 t, state, slots, aside, slot0, counters):
    """Frames ``start:`` of a batch (``data`` and its per-frame arrays, checked by
    ``decode.check_batch``), ``piece`` frames at a time: stage 1 into ``recs`` (a
    ``FRAME_DTYPE`` row per frame; ``parts``, stage 1's counters from
    ``decode.part_counters``, are scratch, not read after: with one row, stage 1 runs on the
    calling thread, else in as many parts in parallel), stage 2 (``assemble``: the
    stream's tables, state, slots, aside, oldest slot and counters), then the payload copies it
    left pending. Returns ``assemble``'s ``(status, next_index)``: ``NEED_ADVANCE`` stops the
    loop at the frame that needs the oldest slot retired, for the caller to retire it and call
    again from there."""
    n = offsets.shape[0]
    i = start
    while i < n:
        stop = min(n, i + piece)
        if parts.shape[0] == 1:
            decode_run(data, offsets, caplens, wirelens, ts_ns, verify_icrc, decapsulate, recs, parts[0], i, stop)
        else:
            decode_parts(data, offsets[i:stop], caplens[i:stop], wirelens[i:stop], ts_ns[i:stop], verify_icrc,
                         decapsulate, recs[i:stop], parts)
        status, j = assemble(recs[:stop], i, data, t, state, slots, aside, slot0, counters)
        if slots.pending.count[0]:
            copy_deferred(slots.pending, data, slots.grads)
        if status == NEED_ADVANCE:
            return status, j
        i = stop
    return DONE, n
