"""Merging a DP group's mirror streams when they arrive at several CPU nodes.

Each node runs a :class:`GroupMerger` over its own streams; together the nodes of the group
(``merger/group_link.py``) merge every bucket as one merger holding every stream would, and
each bucket goes to the node that owns it (``workload/shards.py``), which steps that shard
of the replica. Per iteration and bucket, in order, the nodes:

1. **exchange coverage**: every node sends every peer, per stream of its own, the bucket's
   coverage bitmap and a keyed 16-byte digest of each block it covers (``merger/digest.py``,
   under a key drawn afresh at every rendezvous);
2. **send the owner what it lacks**: from those, every node derives the same fetch list
   (:func:`fetch_mask`): a block that no stream of the owner covers comes from one of the
   streams that do, taken in turn block by block (in the job's stream order), so that the
   sending is spread over the nodes; and every remote copy of a block whose copies' digests
   differ comes too. Blocks all copies agree on, the owner already holds,
   travel nowhere. At a mirror loss of 1e-6 that is nearly nothing but the digests.

The owner then merges its own copies and the fetched ones with ``merger/union.py``, the
local merger's rule: a copy fetched for a disagreeing block is there with every other copy
of it, so the duplicate cross-check and the majority vote (outvoted streams included) see
what they would see with every stream local, and a block whose copies agree is the same
bytes whichever copy is taken. The merged bucket is therefore the single merger's, bit for
bit (up to a digest collision, which untrusted traffic cannot aim at without the key).

**Lockstep.** The rounds happen in the same order on every node: the buckets of an
iteration in launch order, then the iteration's *finish* round, iterations in order. A node
joins a bucket's round when its own streams complete the bucket, or when the iteration has
settled by its own streams (each retired it, or none placed a frame of it for ``settle_ns``
by the capture's clock: the local merger's settle rule), or is due by them (the local
merger's deadline). A node that joins early waits in the round for its peers to complete,
settle or reach their deadline, up to the group's timeout: the rounds agree by construction,
and the last iteration before a pause is merged once the pause is ``settle_ns`` long, not
when the next iteration's traffic comes. The finish round shares what each
node saw (buckets left incomplete, blocks contradicted after hand-off, mismatches,
coverage), so every node tells its sink the same :class:`IterationReport`.

**A node lost.** A round that fails (a peer's process died, or it did not answer within the
group's timeout: :class:`~gradtap.merger.group_link.PeerGone`), or a peer at another
iteration or bucket (:class:`GroupDesync`), makes the iteration unrecoverable: the sink
hears it with ``lost_peers`` naming the peers, and the group is broken; later iterations
are skipped (the replica is stale until resynchronised), and nothing waits for the peer.
"""

from __future__ import annotations

import json
import logging
import struct

import numpy as np

from gradtap.core.errors import ConfigError
from gradtap.core.memory import prefaulted
from gradtap.merger.digest import DIGEST_BYTES, DigestKey, block_digests
from gradtap.merger.group_link import GroupBroken, GroupLink
from gradtap.merger.merger import Merger, Sink
from gradtap.merger.union import BlockMismatch, BucketBlocks, Scratch, union
from gradtap.workload.shards import Shards
from gradtap.workload.wire_plan import WirePlan

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<qqI")      # trainer's iteration, bucket, streams
_STREAM = struct.Struct("<H")        # name length


class GroupDesync(GroupBroken):
    """Peers of the mirror group are at another iteration or bucket than this node."""


class Coverage:
    """One node's coverage of one bucket: per stream of its own, the covered blocks and the
    digest of each (zeros where not covered)."""

    def __init__(self, streams: list[str], covered: np.ndarray, digests: np.ndarray):
        self.streams = streams                    # names
        self.covered = covered                    # bool[streams, k]
        self.digests = digests                    # uint8[streams, k, DIGEST_BYTES]

    @classmethod
    def of(cls, blocks: BucketBlocks, copies: list[tuple[str, np.ndarray, np.ndarray]], key: DigestKey) -> "Coverage":
        """The coverage of ``copies`` (name, bucket bytes, covered blocks), each covered block's
        digest under the group's ``key`` (``merger/digest.py``: every block in one call)."""
        k = len(blocks.index)
        covered = np.zeros((len(copies), k), bool)
        digests = np.zeros((len(copies), k, DIGEST_BYTES), np.uint8)
        for s, (_, data, cov) in enumerate(copies):
            covered[s] = cov
            digests[s] = block_digests(data, blocks.start, blocks.nbytes, cov, key)
        return cls([name for name, _, _ in copies], covered, digests)

    def encode(self, iteration: int, bucket: int) -> bytes:
        parts = [_HEADER.pack(iteration, bucket, len(self.streams))]
        for s, name in enumerate(self.streams):
            raw = name.encode()
            parts += [_STREAM.pack(len(raw)), raw, np.packbits(self.covered[s]).tobytes(),
                      self.digests[s][self.covered[s]].tobytes()]
        return b"".join(parts)

    @classmethod
    def decode(cls, message: bytes, k: int, rank: int) -> tuple[int, int, "Coverage"]:
        """``(iteration, bucket, coverage)`` of peer ``rank``'s message; ``GroupDesync`` when
        it is not one."""
        try:
            iteration, bucket, n = _HEADER.unpack_from(message, 0)
            at = _HEADER.size
            names, covered, digests = [], np.zeros((n, k), bool), np.zeros((n, k, DIGEST_BYTES), np.uint8)
            for s in range(n):
                (length,) = _STREAM.unpack_from(message, at)
                at += _STREAM.size
                names.append(message[at:at + length].decode())
                at += length
                bits = np.frombuffer(message, np.uint8, (k + 7) // 8, at)
                covered[s] = np.unpackbits(bits, count=k).astype(bool)
                at += len(bits)
                m = int(covered[s].sum())
                digests[s][covered[s]] = np.frombuffer(message, np.uint8, m * DIGEST_BYTES, at).reshape(m, -1)
                at += m * DIGEST_BYTES
            if at != len(message):
                raise ValueError(f"{len(message) - at} bytes left over")
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise GroupDesync({rank: f"malformed coverage message ({exc})"}, "a coverage round") from None
        return iteration, bucket, cls(names, covered, digests)


def fetch_mask(cov: np.ndarray, digests: np.ndarray, at_owner: np.ndarray) -> np.ndarray:
    """``bool[streams, k]``: the copies the bucket's owner must fetch.

    ``cov``/``digests``: every stream of the group in the job's stream order; ``at_owner``:
    ``bool[streams]``, the streams the owner holds. Every remote copy of a block whose
    covered copies' digests differ; for a block j the owner's streams do not cover, the copy
    of the (j mod c)-th of the c streams covering it (their copies agree: any one will do, and
    taking them in turn spreads the sending over the nodes)."""
    first = np.argmax(cov, axis=0)                                   # first covering stream per block
    k = cov.shape[1]
    ref = digests[first, np.arange(k)]                               # [k, DIGEST_BYTES]
    differ = (cov & (digests != ref[None]).any(axis=2)).any(axis=0)
    owner_has = (cov & at_owner[:, None]).any(axis=0)
    turn = np.arange(k) % np.maximum(cov.sum(axis=0), 1)             # which covering stream's turn
    chosen = cov & (np.cumsum(cov, axis=0) - 1 == turn[None])
    return ~at_owner[:, None] & cov & (differ[None] | (~owner_has[None] & chosen))


class GroupMerger(Merger):
    """The local :class:`Merger` of this node's ``streams``, merging with the group's other
    nodes over ``link``; ``order`` is every stream of the job, in the job's order; bucket
    ``b`` goes to ``sink`` only on the node ``shards.owner[b]``."""

    def __init__(self, plan: WirePlan, streams: list[str], sink: Sink, link: GroupLink, shards: Shards,
                 order: list[str], first_iteration: int | None = 0, settle_ns: int = 0):
        unknown = [s for s in streams if s not in order]
        if unknown:
            raise ConfigError(f"mirror group: streams {unknown} are not streams of the job ({', '.join(order)})")
        if shards.world != link.world or len(shards.owner) != len(plan.bucket_numels):
            raise ConfigError(f"mirror group: shards for {shards.world} nodes and {len(shards.owner)} buckets; "
                              f"the group has {link.world} nodes and the plan {len(plan.bucket_numels)} buckets")
        if shards.placement and sorted(streams) != sorted(shards.placement[link.rank]):
            raise ConfigError(f"mirror group: this node (rank {link.rank}) captures {sorted(streams)}, but "
                              f"mirror_group.streams[{link.rank}] lists {sorted(shards.placement[link.rank])}; give "
                              "this node the streams its spec lists, or correct the list (the same on every node)")
        super().__init__(plan, sorted(streams, key=order.index), sink, first_iteration, settle_ns)
        # Where merged buckets are assembled, one at a time (the sink takes each at once, and a
        # node's own streams rarely cover a bucket alone): mapped and faulted in here, once.
        self._scratch = prefaulted(max((hi - lo for lo, hi in self.byte_range), default=0))
        self.link, self.shards, self.order = link, shards, list(order)
        self.broken: GroupBroken | None = None
        self._current: int | None = None         # the ordinal whose round is under way

    # -- driving ----------------------------------------------------------------------------
    def advance(self, now_ns: int = -1) -> None:
        self._guarded(lambda: super(GroupMerger, self).advance(now_ns))

    def close(self):
        self._guarded(lambda: super(GroupMerger, self).close())
        while self.iterations:          # broken: nothing more can be merged
            self._skip(min(self.iterations))
        return self.finished

    def _guarded(self, step) -> None:
        if self.broken is not None:
            self._drop()
            return
        try:
            step()
        except GroupBroken as exc:
            self.broken = exc
            log.error("%s", exc)
            self._lost(exc)

    def _advance(self) -> None:
        if self.iterations and self.next not in self.iterations:
            self.next = max(self.next, min(self.iterations))
        while self.next in self.iterations:
            g = self.next
            if not self.numbered(g):
                if self.first is None and not self._due(g):
                    return
                self._skip(g)
                continue
            it = self.iterations[g]
            # Settled (the local merger's notion: every own stream retired it, or none placed a
            # frame of it for settle_ns): its own streams will bring no more of it, so waiting
            # for the deadline (the next iteration's traffic) would gain nothing.
            ready = self._due(g) or self._settled(g)
            for b in np.flatnonzero(~it.handed):
                if not ready and (self._incomplete(g, int(b)) or not self._local(g, int(b)).complete):
                    return
                self._exchange(g, int(b))
            if ready:
                self._finish(g)
            else:
                return

    def _local(self, g: int, b: int):
        return self._union(g, b)[0]

    def _assembly(self, g: int, b: int) -> Scratch:
        return lambda: self._scratch[:self._nbytes(b)]      # the node's own union is never handed

    def _nbytes(self, b: int) -> int:
        return self.byte_range[b][1] - self.byte_range[b][0]

    # -- one bucket ---------------------------------------------------------------------------
    def _exchange(self, g: int, b: int) -> None:
        """The two rounds of bucket ``b`` of ordinal ``g``; the owner merges and hands it."""
        self._current = g
        it, blocks, iteration = self.iterations[g], self.buckets[b], self.first + g
        copies = self._copies(g, b)
        it.handed[b] = True                    # exchanged: not to be taken up again
        it.cover[b] = [(s, covered.copy()) for s, _, covered in copies]
        mine = Coverage.of(blocks, copies, self.link.digest_key)
        during = f"iteration {iteration} bucket {b}"
        views = self._coverage(self.link.all_gather(self.shards.fingerprint + mine.encode(iteration, b),
                                                    f"{during} coverage"), iteration, b, len(blocks.index))
        names = [n for r in range(self.link.world) for n in views[r].streams]
        rank_of = {n: r for r in range(self.link.world) for n in views[r].streams}
        group = sorted(names, key=self.order.index)
        row = {n: (views[rank_of[n]], views[rank_of[n]].streams.index(n)) for n in group}
        cov = np.stack([v.covered[s] for v, s in row.values()]) if group else np.zeros((0, len(blocks.index)), bool)
        dig = np.stack([v.digests[s] for v, s in row.values()]) if group else \
            np.zeros((0, len(blocks.index), DIGEST_BYTES), np.uint8)
        owner = self.shards.owner[b]
        fetch = fetch_mask(cov, dig, np.array([rank_of[n] == owner for n in group], bool)) if group else cov
        wanted = {n: fetch[i] for i, n in enumerate(group)}
        if self.link.rank != owner:
            local = {name: data for name, data, _ in copies}
            payload = b"".join(local[n][blocks.start[j]:blocks.start[j] + blocks.nbytes[j]].tobytes()
                               for n in self.streams for j in np.flatnonzero(wanted[n]))
            self.link.exchange({owner: payload}, f"{during} blocks", peers=[owner], kind="blocks")
            return
        got = self.link.exchange({}, f"{during} blocks", peers=self.link.peers, kind="blocks")
        fetched = self._fetched(got, views, wanted, b)
        local = {name: (data, covered) for name, data, covered in copies}
        merged = [(n, *local[n]) if n in local else (n, *fetched[n]) for n in group if n in local or n in fetched]
        u = union(blocks, merged, self._nbytes(b), self._scratch)
        if u.complete:
            self._hand(g, b, u)
        else:
            report = self._report(g)
            report.missing_blocks[b] = int((~u.covered).sum())
            report.mismatches.extend(u.mismatches)

    def _coverage(self, messages: list[bytes], iteration: int, b: int, k: int) -> list[Coverage]:
        views, seen = [], {}
        mark = self.shards.fingerprint
        for r, message in enumerate(messages):
            if message[:len(mark)] != mark:
                raise GroupDesync({r: "shards the buckets otherwise (the nodes' mirror_group.streams differ; they "
                                      "must be the same list on every node)"}, f"iteration {iteration} bucket {b}")
            at_iteration, at_bucket, view = Coverage.decode(message[len(mark):], k, r)
            if (at_iteration, at_bucket) != (iteration, b):
                raise GroupDesync({r: f"at iteration {at_iteration} bucket {at_bucket}"},
                                  f"iteration {iteration} bucket {b} (this node, rank {self.link.rank})")
            for n in view.streams:
                if n not in self.order or n in seen:
                    raise GroupDesync({r: f"announces stream {n!r}, "
                                          + ("not a stream of the job" if n not in self.order
                                             else f"which rank {seen[n]} holds")},
                                      f"iteration {iteration} bucket {b}")
                seen[n] = r
            views.append(view)
        return views

    def _fetched(self, got: dict[int, bytes], views: list[Coverage], wanted: dict[str, np.ndarray],
                 b: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The remote copies the owner received: per stream, the bucket with the fetched blocks
        in place (zeros elsewhere) and which blocks those are."""
        blocks, out = self.buckets[b], {}
        for r, message in got.items():
            size = sum(int(blocks.nbytes[wanted[n]].sum()) for n in views[r].streams)
            if len(message) != size:
                raise GroupDesync({r: f"sent {len(message)} bytes of blocks, {size} were due"}, f"bucket {b} blocks")
            at = 0
            for n in views[r].streams:
                if not wanted[n].any():
                    continue
                data = np.zeros(self._nbytes(b), np.uint8)
                for j in np.flatnonzero(wanted[n]):
                    lo, nb = int(blocks.start[j]), int(blocks.nbytes[j])
                    data[lo:lo + nb] = np.frombuffer(message, np.uint8, nb, at)
                    at += nb
                out[n] = (data, wanted[n].copy())
        return out

    # -- one iteration ------------------------------------------------------------------------
    def _finish(self, g: int) -> None:
        """Iteration g is due: exchange what is left of it, then agree on its report."""
        if not self.numbered(g):
            self._skip(g)
            return
        it = self.iterations.get(g)
        if it is None:
            self.next = g + 1
            return
        for b in np.flatnonzero(~it.handed):
            self._exchange(g, int(b))
        self._current = g
        report = self._report(g)
        mine = {"iteration": report.iteration, "missing": report.missing_blocks,
                "contradicted": self._contradicted(g), "coverage": self._stream_coverage(g),
                "mismatches": [[m.block, m.groups, m.resolved, m.distrusted] for m in report.mismatches]}
        parts = self.link.all_gather(json.dumps(mine).encode(), f"iteration {report.iteration} finish")
        report.mismatches.clear()
        for r, part in enumerate(parts):
            theirs = self._summary(part, r, report.iteration)
            for key, into in (("missing", report.missing_blocks), ("contradicted", report.contradicted_blocks)):
                for b, n in theirs[key].items():
                    into[int(b)] = into.get(int(b), 0) + int(n)
            report.coverage.update(theirs["coverage"])
            report.mismatches.extend(BlockMismatch(int(m[0]), tuple(tuple(x) for x in m[1]), bool(m[2]),
                                                   tuple(m[3])) for m in theirs["mismatches"])
        report.mismatches.sort(key=lambda m: m.block)
        report.coverage = {s: report.coverage[s] for s in self.order if s in report.coverage}
        report.recovered = not report.missing_blocks and not report.contradicted_blocks
        self._close_out(g)

    def _summary(self, part: bytes, rank: int, iteration: int) -> dict:
        try:
            theirs = json.loads(part)
            if theirs["iteration"] != iteration:
                raise GroupDesync({rank: f"finishing iteration {theirs['iteration']}"}, f"iteration {iteration} finish")
            for key in ("missing", "contradicted", "coverage", "mismatches"):
                theirs[key]           # noqa: B018 (present)
        except (ValueError, KeyError, TypeError) as exc:
            raise GroupDesync({rank: f"malformed finish message ({exc})"}, f"iteration {iteration} finish") from None
        return theirs

    def _close_out(self, g: int) -> None:
        """Ordinal g is done: forget it and tell the sink."""
        self.next = max(self.next, g + 1)
        self._last_ns.pop(g, None)
        report = self._report(g)
        del self.iterations[g]
        for views in self._views.values():
            views.pop(g, None)
        self.finished.append(report)
        self.sink.iteration_done(self.first + g, report)

    def _lost(self, exc: GroupBroken) -> None:
        """A round failed: the iteration under way is unrecoverable (the sink hears which peers
        are gone), and every later one is dropped."""
        g = self._current
        if g is not None and g in self.iterations:
            report = self._report(g)
            report.recovered = False
            report.lost_peers.update(exc.peers)
            self._close_out(g)
        self._drop()

    def _drop(self) -> None:
        while self.iterations:
            self._skip(min(self.iterations))
