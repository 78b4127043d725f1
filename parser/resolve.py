"""Reading from the wire what a job spec leaves to it: ``nccl.era: auto`` and ``nccl.protocol: auto``.

A wire plan needs the NCCL era (it fixes how a call's elements split over channels and QPs,
the CTS size and ImmDt's byte order) and each bucket's protocol (NCCL's tuner picks one per
call, by size). When the job leaves them to the wire, each stream is watched before any plan
exists, and the first stream to show a whole iteration that only one reading fits decides for
the job:

1. **Era families.** The CTS size (32 bytes up to 2.19, 64 from 2.20) and ImmDt's byte order
   (the message size, big-endian from 2.29), pooled over every stream, rule out eras as
   ``gradtap discover`` does. Eras that send identically (2.20 and 2.21, …) are one family.
2. **Each packet's protocol**, from its payload (``parser/line_format.py``): LL's flag pairs,
   LL128's flag words, or neither (Simple).
3. **A whole iteration per flow.** Writes between the ring's addresses are grouped by wire
   flow (addresses and QPN, whatever the NIC numbered it) and cut into iterations at the
   pauses between them. A flow's PSNs run on across iterations, so a whole iteration's
   packets lie between the flow's last packet before the pause that opens it and its first
   packet after the pause that closes it: its length is at most that distance (less when the
   next iteration began without a pause; what follows must then begin the same iteration).
4. **The fit.** For each era family, one plan per protocol gives the packets each bucket puts
   on each planned flow of the stream; the three counts differ (LL sends twice the bytes,
   LL128 16/15, and small calls use fewer channels per protocol). Walking a wire flow's
   iteration bucket by bucket, each bucket takes the protocol whose packets there are all of
   that protocol, and the walk must end within the iteration. A bucket that puts no packet on
   a flow is left open there, for another flow to decide. An assignment fits when every
   planned data flow of the stream is some wire flow's walk; flows that fit none are other
   traffic (point-to-point, other jobs).

The job is resolved when exactly one assignment fits and the eras that fit it send the same
plan (the newest is taken, and all are named). Otherwise the stream tries its next iteration;
after :data:`ITERATIONS` it has failed, with what fitted and the field to set.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from gradtap.core.errors import PlanError
from gradtap.parser.line_format import UNDECIDED, packet_protocols
from gradtap.parser.stream_tables import ip16
from gradtap.wire import events as ev
from gradtap.wire.headers.opcodes import KIND_WRITE, OPCODE_KIND, OPCODE_RETH_OFF
from gradtap.wire.protocol import Protocol
from gradtap.wire.psn import psn_delta
from gradtap.workload.layout import job_buckets
from gradtap.workload.nccl import ERAS
from gradtap.workload.spec import SUPPORTED_ERAS, JobSpec
from gradtap.workload.wire_plan import DATA, WirePlan, build_plan

log = logging.getLogger(__name__)

ITERATIONS = 4             # iterations a stream is given to decide (its first may have begun before the capture)
MAX_PACKETS = 1 << 24      # write packets between the ring's addresses kept per stream (33 B each: ~550 MiB)
MAX_FLOWS = 1024           # wire flows of one iteration looked at (the busiest): a hostile capture's many are not
START_SLACK = 64           # PSNs a flow's iteration may begin before its first packet seen (mirror loss)
WALKS = 16                 # assignments one walk keeps (more means the flow says little)
IMM_SAMPLES = 256          # decisive ImmDt comparisons kept
IDS_SEEN = 8               # ImmDt not the size, and 4 times as often as the size: request IDs
WRITE_ONLY, WRITE_ONLY_IMM, WRITE_FIRST, WRITE_LAST_IMM = 0x0A, 0x0B, 0x06, 0x09
OPEN = -1                  # an assignment's bucket that a flow does not show
PROTOCOLS = (Protocol.SIMPLE, Protocol.LL, Protocol.LL128)


@dataclass(frozen=True)
class Resolution:
    """What the wire decided, and the job with it filled in."""

    job: JobSpec
    stream: str                       # the stream that decided
    eras: tuple[str, ...]             # every era that fits equally (the job takes the newest)
    protocols: tuple[str, ...]        # per bucket, in launch order

    def as_event(self) -> dict:
        return {"stream": self.stream, "era": self.job.nccl.era, "eras": list(self.eras),
                "protocols": list(self.protocols), "summary": self.describe()}

    def describe(self) -> str:
        runs: list[list] = []
        for p in self.protocols:
            if runs and runs[-1][0] == p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        eras = self.eras[0] if len(self.eras) == 1 else f"{self.eras[0]}-{self.eras[-1]} (identical on this wire)"
        buckets = ", ".join(f"{n} x {p}" for p, n in runs)
        return f"stream {self.stream}: NCCL era {eras}, bucket protocols {buckets}"


EraKey = tuple


def _family(era: str) -> EraKey:
    """What of an era shapes a job's plan and what the resolver reads: eras with the same key
    send the same traffic for any job (they differ in CTS fields the parser does not read, or
    not at all), so one of them stands for all."""
    facts = ERAS[era]
    return (dataclasses.replace(facts, releases="", cts_fields=(), ooo_rq=False), facts.cts_bytes)


@dataclass
class _Packets:
    """Growable columns of the write packets between the ring's addresses, in arrival order."""

    key: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # src pos << 40 | dst pos << 24 | QPN
    psn: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cls: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    reth: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # RETH length (-1: no RETH)
    n: int = 0

    def append(self, key, psn, ts, cls, reth) -> None:
        need = self.n + len(key)
        if need > len(self.key):
            size = max(need, 2 * len(self.key), 1 << 12)
            for name in ("key", "psn", "ts", "cls", "reth"):
                old = getattr(self, name)
                new = np.zeros(size, old.dtype)
                new[:self.n] = old[:self.n]
                setattr(self, name, new)
        for name, values in (("key", key), ("psn", psn), ("ts", ts), ("cls", cls), ("reth", reth)):
            getattr(self, name)[self.n:need] = values
        self.n = need


def eras_shown(cts_sizes: Counter, imm_order: Counter) -> list[str]:
    """The eras whose CTS size (the commonest seen) and ImmDt byte order (the likelier) the
    wire shows; every era where it shows neither."""
    eras = list(SUPPORTED_ERAS)
    if cts_sizes:
        size = cts_sizes.most_common(1)[0][0]
        eras = [e for e in eras if ERAS[e].cts_bytes == size]
    if imm_order["big"] + imm_order["little"]:
        big = imm_order["big"] > imm_order["little"]
        eras = [e for e in eras if ERAS[e].imm_big_endian == big]
    return eras


def imm_evidence(imm: int, length: int, counts: Counter) -> None:
    """ImmDt (read big-endian) against the message's length: NCCL writes the size, byte-swapped
    to big-endian from 2.29 and as the host's little-endian word before; ``other`` counts
    neither (a message split over QPs, or 2.30's request IDs)."""
    swapped = int.from_bytes(imm.to_bytes(4, "big"), "little")
    if length <= 0:
        return
    if imm == length and swapped != length:
        counts["big"] += 1
    elif swapped == length and imm != length:
        counts["little"] += 1
    elif imm != length:
        counts["other"] += 1


FlowId = tuple      # (src, dst, channel, QP) of a planned flow


class _FlowShape(NamedTuple):
    """One planned data flow of a stream, every bucket in one protocol."""

    packets: np.ndarray                                  # int64[buckets]: packets of each bucket
    writes: list[tuple[np.ndarray, np.ndarray]]          # per bucket: its writes' first packets (from the
    #                                                      bucket's first) and their RETH lengths


class _Shapes:
    """Per era and protocol, the planned data flows of one stream (None: the plan cannot be
    built in that era)."""

    def __init__(self, job: JobSpec, stream: str, numels: list[int]):
        self.job, self.numels = job, numels
        mirror = job.mirror(stream)
        self.position, self.direction = mirror.rank, mirror.direction
        self._shapes: dict[tuple[str, Protocol], dict[FlowId, _FlowShape] | None] = {}

    def job_for(self, era: str, protocols: tuple[Protocol, ...]) -> JobSpec:
        nccl = self.job.nccl.model_copy(update={"era": era, "protocols": tuple(p.nccl_name for p in protocols)})
        return self.job.model_copy(update={"nccl": nccl})

    def plan(self, era: str, protocols: tuple[Protocol, ...], numels: list[int] | None = None) -> WirePlan | None:
        try:
            return build_plan(self.job_for(era, protocols), self.numels if numels is None else numels)
        except PlanError:
            return None

    def of(self, era: str, protocol: Protocol) -> dict[FlowId, _FlowShape] | None:
        """The stream's planned data flows with every bucket in ``protocol`` (a bucket's shape
        depends on its size alone, so each distinct size is planned once)."""
        key = (era, protocol)
        if key not in self._shapes:
            sizes = sorted(set(self.numels))
            plan = self.plan(era, (protocol,) * len(sizes), sizes)
            self._shapes[key] = None if plan is None else self._flows(plan, [sizes.index(n) for n in self.numels])
        return self._shapes[key]

    def _flows(self, plan: WirePlan, which: list[int]) -> dict[FlowId, _FlowShape]:
        """Each data flow's shape, bucket ``b`` being the plan's bucket ``which[b]`` (a plan
        has the flows its calls use: a protocol whose small calls take fewer channels may
        leave one out)."""
        flows = plan.flows_of(self.position, self.direction)
        flows = flows[plan.flows["kind"][flows] == DATA]
        out = {}
        for f in flows.tolist():
            m = plan.messages[plan.flows["msg_start"][f]:plan.flows["msg_start"][f] + plan.flows["msg_count"][f]]
            m = m[m["kind"] == DATA]
            packets = np.zeros(len(plan.bucket_numels), np.int64)
            np.add.at(packets, m["bucket"].astype(np.int64), m["npkts"].astype(np.int64))
            writes = []
            for b in range(len(plan.bucket_numels)):
                mb = m[m["bucket"] == b]
                offsets = mb["psn_offset"].astype(np.int64)
                writes.append((offsets - (offsets.min() if len(mb) else 0), mb["wire_bytes"].astype(np.int64)))
            row = plan.flows[f]
            out[(int(row["src"]), int(row["dst"]), int(row["channel"]), int(row["qp"]))] = \
                _FlowShape(packets[which], [writes[u] for u in which])
        return out


class WireEvidence:
    """What one stream shows before a plan exists (see the module docstring)."""

    def __init__(self, job: JobSpec, stream: str, gap_ns: int):
        self.job, self.stream, self.gap_ns = job, stream, gap_ns
        self.ips = np.stack([ip16(r.ip) for r in job.ring.ranks])
        self.packets = _Packets()
        self.cts_sizes: Counter = Counter()
        self.imm_order: Counter = Counter()
        self.tried = 0                      # whole iterations tried
        self.why = ""                       # why the last one did not decide
        self._first_len: dict[int, int] = {}  # flow key -> RETH length of its last WRITE_FIRST
        self.full = False

    def observe(self, recs: np.ndarray, data: np.ndarray) -> None:
        ok = (recs["event"] == ev.DECODE_OK) & (OPCODE_KIND[recs["opcode"]] == KIND_WRITE)
        src, dst = self._positions(recs, "src_ip", ok), self._positions(recs, "dst_ip", ok)
        ring = ok & (src >= 0) & (dst >= 0) & (src != dst)
        idx = np.flatnonzero(ring)
        if len(idx) == 0:
            return
        r = recs[idx]
        opcode = r["opcode"]
        cts_shaped = (opcode == WRITE_ONLY) & np.isin(r["payload_len"], sorted({e.cts_bytes for e in ERAS.values()}))
        self.cts_sizes.update(r["payload_len"][cts_shaped].tolist())
        key = (src[idx] << 40) | (dst[idx] << 24) | r["dest_qp"].astype(np.int64)
        if sum(self.imm_order.values()) < IMM_SAMPLES:
            self._imm(r, key)
        if self.packets.n + len(idx) > MAX_PACKETS:
            self.full = True
            return
        reth = np.where(OPCODE_RETH_OFF[opcode] >= 0, r["reth_len"].astype(np.int64), -1)
        self.packets.append(key, r["psn"].astype(np.int64), r["ts_ns"], packet_protocols(r, data), reth)

    def _positions(self, recs: np.ndarray, column: str, ok: np.ndarray) -> np.ndarray:
        out = np.full(len(recs), -1, np.int64)
        for position, ip in enumerate(self.ips):
            out[ok & (recs[column] == ip).all(axis=1)] = position
        return out

    def _imm(self, r: np.ndarray, key: np.ndarray) -> None:
        """ImmDt against the message length it announces (a WRITE_FIRST's RETH length for a
        WRITE_LAST_WITH_IMM), as ``gradtap discover`` compares them."""
        for rec, k in zip(r[np.isin(r["opcode"], (WRITE_FIRST, WRITE_ONLY_IMM, WRITE_LAST_IMM))], key.tolist()):
            op = int(rec["opcode"])
            if op == WRITE_FIRST:
                self._first_len[k] = int(rec["reth_len"])
                continue
            length = int(rec["reth_len"]) if op == WRITE_ONLY_IMM else self._first_len.pop(k, -1)
            imm_evidence(int(rec["imm"]), length, self.imm_order)

    def iterations(self, final: bool = False) -> list[tuple[int, int]]:
        """Packet ranges ``[a, b)`` that a pause closes (``final``: the end of input too). The
        first may have begun before the capture; it then fits no plan (its flows fall short
        of their period), and the next is tried."""
        n = self.packets.n
        cuts = np.r_[0, np.flatnonzero(np.diff(self.packets.ts[:n]) >= self.gap_ns) + 1, [n] if final and n else []]
        return [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]

    def flows_in(self, a: int, b: int) -> list[_WireIteration]:
        """The wire flows with packets in ``[a, b)`` (the :data:`MAX_FLOWS` busiest), as
        :class:`_WireIteration` (see the module docstring for where an iteration may begin and
        end)."""
        p = self.packets
        key, psn, cls, reth = p.key[:p.n], p.psn[:p.n], p.cls[:p.n], p.reth[:p.n]
        keys, inverse, counts = np.unique(key[a:b], return_inverse=True, return_counts=True)
        kept = np.sort(np.argsort(-counts, kind="stable")[:MAX_FLOWS])
        # Each kept flow's last packet before the segment and first after it, in one pass each.
        before_keys, before_at = np.unique(key[:a][::-1], return_index=True)
        after_keys, after_at = np.unique(key[b:], return_index=True)
        members = np.argsort(inverse, kind="stable") + a          # the segment's packets, flow by flow
        bounds = np.r_[0, np.cumsum(counts)]
        out = []
        for j in kept.tolist():
            k = int(keys[j])
            inside = members[bounds[j]:bounds[j + 1]]
            first, last = int(psn[inside[0]]), int(psn[inside[-1]])
            start = first
            i = np.searchsorted(before_keys, k)
            if i < len(before_keys) and before_keys[i] == k:
                lost = psn_delta(int(psn[a - 1 - before_at[i]]) + 1, first)
                start = first - lost if 0 <= lost <= START_SLACK else first
            rel = psn_delta(start, psn[inside])
            end_lo = psn_delta(start, last) + 1
            i = np.searchsorted(after_keys, k)
            following = i < len(after_keys) and after_keys[i] == k
            end_hi = psn_delta(start, int(psn[b + after_at[i]])) if following else end_lo + START_SLACK
            decided = (cls[inside] != UNDECIDED) & (rel >= 0)
            order = np.argsort(rel[decided], kind="stable")
            writes = (reth[inside] >= 0) & (rel >= 0)
            worder = np.argsort(rel[writes], kind="stable")
            out.append(_WireIteration(key=k, positions=rel[decided][order],
                                      classes=cls[inside][decided][order].astype(np.int64),
                                      write_at=rel[writes][worder], write_bytes=reth[inside][writes][worder],
                                      period=(end_lo, max(end_lo, end_hi))))
        return out


class _WireIteration(NamedTuple):
    """One wire flow's packets in one iteration, by position (PSNs past its start)."""

    key: int
    positions: np.ndarray       # of the packets whose payload says its protocol
    classes: np.ndarray         # that protocol
    write_at: np.ndarray        # of the packets that begin a write (carry a RETH)
    write_bytes: np.ndarray     # the write's RETH length
    period: tuple[int, int]     # the least and the most packets the iteration can have


def _walk(shapes: dict[Protocol, _FlowShape], it: _WireIteration, lengths: bool) -> list[tuple[int, ...]]:
    """The bucket protocols (:data:`OPEN` where the flow shows no packet of the bucket) under
    which one wire flow's iteration ``it`` is one planned flow's (``shapes``: that flow with
    every bucket in each protocol): each bucket's packets are all of its protocol, and, with
    ``lengths``, each write that begins there is one the plan begins there, of its length. An
    iteration shorter than ``it.period`` (the next began without a pause) must be followed by
    the start of the same iteration again."""
    protos = [p for p in PROTOCOLS if p in shapes]
    if not protos:
        return []
    nb = len(shapes[protos[0]].packets)
    prefix = {p: np.r_[0, np.cumsum(it.classes == int(p))] for p in protos}
    low, high = it.period

    def fits(p: Protocol, b: int, at: int) -> bool:
        """Bucket ``b`` in protocol ``p`` from position ``at``: no packet of another protocol,
        and (``lengths``) every write begins where and as the plan's."""
        n = int(shapes[p].packets[b])
        i, j = np.searchsorted(it.positions, (at, at + n))
        if prefix[p][j] - prefix[p][i] != j - i:
            return False
        if not lengths:
            return True
        i, j = np.searchsorted(it.write_at, (at, at + n))
        offsets, sizes = shapes[p].writes[b]
        k = np.searchsorted(offsets, it.write_at[i:j] - at)
        k = np.minimum(k, len(offsets) - 1)
        return bool(len(offsets) or i == j) and bool(
            ((offsets[k] == it.write_at[i:j] - at) & (sizes[k] == it.write_bytes[i:j])).all())

    # Forward: the positions each bucket can begin at, and the ways on to the next (bucket by
    # bucket, not by recursion: a large model has thousands of buckets).
    steps: list[dict[int, list[tuple[int, int]]]] = []     # per bucket: begin -> [(protocol, next begin)]
    reach = {0}
    for b in range(nb):
        sizes = {p: int(shapes[p].packets[b]) for p in protos}
        ways: dict[int, list[tuple[int, int]]] = {}
        for at in sorted(reach):
            if all(n == 0 for n in sizes.values()):
                ways[at] = [(OPEN, at)]
            else:
                ways[at] = [(int(p), at + n) for p, n in sizes.items() if at + n <= high and fits(p, b, at)]
        steps.append(ways)
        reach = {nxt for w in ways.values() for _, nxt in w}
        if not reach:
            return []
    # Backward: up to WALKS ways from each begin to an end within the iteration, as linked
    # (protocol, rest) pairs, spelt out only at the start.
    tails: dict[int, list] = {at: [None] for at in reach if at <= high}
    for b in range(nb - 1, -1, -1):
        tails = {at: [(p, t) for p, nxt in w for t in tails.get(nxt, ())][:WALKS] for at, w in steps[b].items()}

    def spelt(node) -> tuple[int, ...]:
        out = []
        while node is not None:
            out.append(node[0])
            node = node[1]
        return tuple(out)

    def again(walk: tuple[int, ...]) -> bool:
        """The packets past the walk's end, up to the period's least, begin the same walk again."""
        sizes = [0 if p == OPEN else int(shapes[Protocol(p)].packets[b]) for b, p in enumerate(walk)]
        length = sum(sizes)
        at = length
        while at < low and length:
            for b, (p, n) in enumerate(zip(walk, sizes)):
                if n and not fits(Protocol(p), b, at):
                    return False
                at += n
        return True

    return [w for w in map(spelt, tails.get(0, ())) if again(w)]


def _wire_only(messages: np.ndarray) -> bytes:
    """A plan's messages without what only says which elements they carry, as bytes."""
    return b"".join(messages[n].tobytes() for n in messages.dtype.names if n not in ("elem_offset", "nelem", "block"))


def _unify(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    out = []
    for x, y in zip(a, b):
        if x != OPEN and y != OPEN and x != y:
            return None
        out.append(y if x == OPEN else x)
    return tuple(out)


class Resolver:
    """The job's ``auto`` fields, read from the first stream whose whole iteration decides them."""

    def __init__(self, job: JobSpec, streams: list[str], gap_ns: int):
        self.job = job
        self.evidence = {s: WireEvidence(job, s, gap_ns) for s in streams}
        self.failures: dict[str, str] = {}
        self.resolution: Resolution | None = None
        self._numels: list[int] | None = None
        self._shapes: dict[str, _Shapes] = {}

    def observe(self, stream: str, recs: np.ndarray, data: np.ndarray) -> None:
        self.evidence[stream].observe(recs, data)

    def decide(self, final: bool = False) -> Resolution | None:
        """Try every stream's new iterations (``final``: the input has ended, closing the
        last); the resolution once one decides."""
        if self.resolution is not None:
            return self.resolution
        for stream, e in self.evidence.items():
            if stream in self.failures:
                continue
            if e.full:
                self.failures[stream] = (f"{MAX_PACKETS:,} write packets between the ring's addresses passed without "
                                         "a whole iteration that decides; " + self._fix())
                continue
            for a, b in e.iterations(final)[e.tried:]:
                e.tried += 1
                found, why = self._try(stream, a, b)
                e.why = why
                if found is not None:
                    self.resolution = found
                    log.info("resolved from the wire: %s", found.describe())
                    return found
                if e.tried >= ITERATIONS:
                    self.failures[stream] = f"{ITERATIONS} iterations did not decide: {why}; " + self._fix()
                    break
        return None

    def detail(self, stream: str) -> str:
        """What a stream showed the resolver, for a lock-on failure."""
        e = self.evidence[stream]
        keys = np.unique(e.packets.key[:e.packets.n])
        cls = Counter(e.packets.cls[:e.packets.n].tolist())
        shown = ", ".join(f"{Protocol(c).nccl_name if c != UNDECIDED else 'undecided'} {n:,}" for c, n in cls.items())
        return (f"{e.packets.n:,} write packets in {len(keys)} wire flow(s) between the ring's addresses "
                f"({shown or 'none'}); CTS sizes {dict(e.cts_sizes) or 'none'}; ImmDt order "
                f"{dict(e.imm_order) or 'not seen'}; eras the wire allows: {', '.join(self.eras()) or 'none'}")

    def _fix(self) -> str:
        fields = [f for f, auto in (("nccl.era", self.job.nccl.era == "auto"),
                                    ("nccl.protocols", self.job.nccl.protocol == "auto"
                                     and self.job.nccl.protocols is None)) if auto]
        return "set " + " and ".join(fields) + " in the job (gradtap discover suggests them)"

    def eras(self) -> list[str]:
        """One era per family the pooled CTS sizes and ImmDt order allow (the newest of each)."""
        if self.job.nccl.era != "auto":
            return [self.job.nccl.era]
        newest: dict[EraKey, str] = {}
        for e in eras_shown(self._pooled("cts_sizes"), self._pooled("imm_order")):
            newest[_family(e)] = e
        return list(newest.values())

    def _pooled(self, evidence: str) -> Counter:
        """One Counter of ``WireEvidence`` (``cts_sizes``, ``imm_order``) over every stream."""
        return sum((getattr(e, evidence) for e in self.evidence.values()), Counter())

    def _protocols(self) -> list[Protocol]:
        nccl = self.job.nccl
        if nccl.protocols is not None:
            return sorted({Protocol.of(p) for p in nccl.protocols})
        return list(PROTOCOLS) if nccl.protocol == "auto" else [Protocol.of(nccl.protocol)]

    def _try(self, stream: str, a: int, b: int) -> tuple[Resolution | None, str]:
        """The resolution one whole iteration ``[a, b)`` of ``stream`` decides, or why not."""
        if self._numels is None:
            self._numels = [bk.numel for bk in job_buckets(self.job)]
        shapes = self._shapes.setdefault(stream, _Shapes(self.job, stream, self._numels))
        fixed = None if self.job.nccl.protocols is None else tuple(int(Protocol.of(p)) for p in self.job.nccl.protocols)
        flows = self.evidence[stream].flows_in(a, b)
        eras = self.eras()
        if not eras:
            return None, "the CTS size and ImmDt byte order fit no NCCL era from 2.19 to 2.30"
        imm = self._pooled("imm_order")
        sizes = imm["big"] + imm["little"]
        if self.job.nccl.qps_per_connection == 1 and imm["other"] >= IDS_SEEN and imm["other"] > 4 * sizes:
            return None, (f"ImmDt is not the message size in {imm['other']} of {sum(imm.values())} writes: NCCL 2.30's "
                          "ID-based receive matching (NCCL_IB_OOO_RQ=1, NCCL_IB_RESILIENCY_PORT_FAILOVER=1 or "
                          "NCCL_IB_RECEIVER_SIDE_MATCHING_SCHEME=1) writes a request ID there, which gradtap does "
                          "not decode; run the trainer without them")
        protocols = self._protocols()
        seen = {Protocol(int(c)) for it in flows for c in np.unique(it.classes)}
        fits = self._fits(shapes, eras, [p for p in protocols if p in seen], flows, fixed)
        if not fits and not seen.issuperset(protocols):
            fits = self._fits(shapes, eras, protocols, flows, fixed)
        if not fits:
            return None, (f"no era of {', '.join(eras)} and no protocol per bucket makes every planned data flow of "
                          f"the stream one of its {len(flows)} wire flows' iteration")
        if len(fits) > 1:
            shown = "; ".join(" ".join(Protocol(p).nccl_name for p in a) for a in list(fits)[:3])
            return None, f"{len(fits)} protocol assignments fit equally ({shown})"
        (assignment, fitting), = fits.items()
        protos = tuple(Protocol(p) for p in assignment)
        plans = {era: shapes.plan(era, protos) for era in fitting}
        distinct = {(plans[e].messages.tobytes(), ERAS[e].cts_bytes) for e in fitting if plans[e] is not None}
        if len(distinct) > 1:
            placed = {_wire_only(plans[e].messages) for e in fitting if plans[e] is not None}
            how = ("send the same bytes but carry different elements in them, which the wire cannot show"
                   if len(placed) == 1 else "fit this stream's traffic equally but send differently elsewhere")
            return None, f"NCCL eras {', '.join(fitting)} {how}; set nccl.era to the trainer's NCCL major.minor"
        family = [e for e in SUPPORTED_ERAS if any(_family(e) == _family(f) for f in fitting)]
        job = shapes.job_for(fitting[-1], protos)
        return Resolution(job=job, stream=stream, eras=tuple(family),
                          protocols=tuple(p.nccl_name for p in protos)), ""

    def _fits(self, shapes: _Shapes, eras: list[str], protocols: list[Protocol], flows: list[_WireIteration],
              fixed) -> dict[tuple[int, ...], list[str]]:
        """Assignment -> the eras it fits in, with buckets in ``protocols`` only. Planning a
        protocol is costly for a large model (LL: ~7 s for GPT-2 small), so the first try takes
        only the protocols some packet shows; a bucket whose packets all say nothing (a few
        bytes each) then fits no assignment, and every protocol is tried. A wrong protocol
        cannot stand in for an unseen one: its writes' lengths differ (with adaptive routing,
        where lengths are not compared, every protocol is tried at once)."""
        if self.job.nccl.adaptive_routing:
            protocols = self._protocols()
        fits: dict[tuple[int, ...], list[str]] = {}
        for era in eras:
            per = {p: shapes.of(era, p) for p in protocols}
            per = {p: f for p, f in per.items() if f is not None}
            if not per:
                continue
            for assignment in self._fit(per, flows, fixed):
                fits.setdefault(assignment, []).append(era)
        return fits

    def _fit(self, per: dict[Protocol, dict[FlowId, _FlowShape]], flows: list[_WireIteration],
             fixed) -> list[tuple[int, ...]]:
        """Assignments (one protocol per bucket) under which each planned data flow of the
        stream that carries packets is the iteration of a wire flow of its own."""
        # With adaptive routing a NIC may send a write's packets as writes of their own.
        lengths = not self.job.nccl.adaptive_routing
        rows = sorted(set().union(*per.values()))
        nb = len(self._numels)
        empty = _FlowShape(np.zeros(nb, np.int64), [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * nb)
        shape = {r: {p: at.get(r, empty) for p, at in per.items()} for r in rows}
        walks: dict[FlowId, dict[int, list[tuple[int, ...]]]] = {}   # planned flow -> wire flow -> walks
        for w, it in enumerate(flows):
            if len(it.positions) == 0:
                continue              # no packet says its protocol (a CTS flow, or too few bytes)
            edge = (it.key >> 40, (it.key >> 24) & 0xFFFF)
            for r in rows:
                if r[:2] != edge:
                    continue
                found = _walk(shape[r], it, lengths)
                if fixed is not None:
                    found = [x for x in found if _unify(x, fixed) is not None]
                if found:
                    walks.setdefault(r, {})[w] = found
        if not walks:
            return []
        out = []
        for c in _candidates([x for at in walks.values() for found in at.values() for x in found], fixed):
            active = [r for r in rows if any(Protocol(p) in per and shape[r][Protocol(p)].packets[b]
                                             for b, p in enumerate(c))]
            options = {r: [w for w, found in walks.get(r, {}).items()
                           if any(_unify(c, x) is not None for x in found)] for r in active}
            if active and _matching(options):
                out.append(c)
        return out


CANDIDATES = 256           # whole assignments checked per era (more: the walks say too little)


def _candidates(walks: list[tuple[int, ...]], fixed) -> list[tuple[int, ...]]:
    """Whole assignments the walks allow: each bucket takes a protocol some walk gives it."""
    nb = len(walks[0])
    per = [sorted({x[b] for x in walks} - {OPEN}) for b in range(nb)]
    if fixed is not None:
        per = [[fixed[b]] for b in range(nb)]
    if any(not options for options in per) or np.prod([len(o) for o in per], dtype=float) > CANDIDATES:
        return []
    return [tuple(c) for c in itertools.product(*per)]


def _matching(options: dict[int, list[int]]) -> bool:
    """Whether every planned flow gets a wire flow of its own among its ``options`` (Kuhn)."""
    owner: dict[int, int] = {}

    def take(r: int, seen: set[int]) -> bool:
        for w in options[r]:
            if w not in seen:
                seen.add(w)
                if w not in owner or take(owner[w], seen):
                    owner[w] = r
                    return True
        return False

    return all(take(r, set()) for r in options)


