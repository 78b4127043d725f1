"""What captures say about the job that made them, for ``gradtap discover``: the ring section
of a job spec and the NCCL settings that shape the wire, learnt from the traffic, with what
could not be decided said plainly.

From the captures alone (:func:`survey`, then :func:`ring_of`):

- **flows**, each ``(source, destination, destination QP)`` as ``gradtap inspect`` counts
  them, sorted into *data* (RDMA WRITEs that end with an immediate, as NCCL's
  ``ncclIbMultiSend`` posts them), *CTS* (plain one-packet WRITEs of one size, which
  ``ncclIbPostFifo`` sends back on the data connection) and the rest (ACKs, connection
  management, other traffic);
- **the ring**: per NCCL protocol, the hosts its data flows join. The ring is the protocol
  whose edges form one directed cycle through its hosts (the point-to-point traffic of a
  pipeline does not: it goes one way, and not around); its order is the cycle's;
- **channels x QPs per connection**: the data flows on each edge of the ring;
- **MTU**: the payload of the first and middle packets of a multi-packet write (exactly one
  MTU each, IBTA 9.7.4); **MAC**: each address's source MAC in unencapsulated frames;
- **era**: the CTS size (32 bytes in 2.18–2.19, 64 from 2.20) and ImmDt's byte order (the
  message size, big-endian from 2.29), as ``docs/wire-format.md`` cites them.

What the wire cannot show without the job's sizes: which rank is ring position 0 (a rotation
of the ring fits every write size modulo the iteration), how the data flows of an edge split
into channels and QPs, and which era of those the CTS and ImmDt allow. Given a partial job
spec with the model (:func:`fit`), every candidate is tried through the stream parser itself
and the ones that lock on and recover an iteration are kept; QPNs are then the parser's learnt
ones (``parser/flow_learning.py``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from gradtap.capture.pcap import PcapReader
from gradtap.core.errors import CaptureError, ConfigError, GradtapError
from gradtap.parser.decode import decode_batch
from gradtap.parser.inspect_flows import MIXED, FlowTable
from gradtap.parser.resolve import eras_shown, imm_evidence
from gradtap.parser.stream_tables import UNKNOWN_QPN
from gradtap.wire.events import DECODE_OK
from gradtap.wire.frame_record import FRAME_DTYPE, ICRC_BAD
from gradtap.workload.spec import SUPPORTED_ERAS

WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST_IMM, WRITE_ONLY, WRITE_ONLY_IMM, ACK = 0x06, 0x07, 0x09, 0x0A, 0x0B, 0x11
WRITE_LAST = 0x08
WRITES = (WRITE_FIRST, WRITE_MIDDLE, WRITE_LAST, WRITE_LAST_IMM, WRITE_ONLY, WRITE_ONLY_IMM)
ENDS_WITH_IMM = {str(WRITE_LAST_IMM), str(WRITE_ONLY_IMM)}
PLAIN_ENDS = {str(WRITE_LAST), str(WRITE_ONLY)}
IMM_SAMPLES = 256        # decisive ImmDt comparisons kept per capture set
MAX_ADDRESSES = 4096     # addresses whose MAC and write counts are kept (a ring has at most 64 ranks)
SIZES_PER_FLOW = 8       # distinct plain-write sizes kept per flow (a CTS flow shows one)
TRIAL_FRAMES = 2_000_000  # frames of a capture one candidate is given to lock on and recover an iteration


@dataclass
class Survey:
    """What :func:`survey` read from the captures."""

    files: list[str]
    frames: int
    flows: list[dict]                     # FlowTable.describe() rows, plus "role" and "write_sizes"
    macs: dict[str, str]                  # address -> source MAC (unencapsulated frames)
    mtu: int | None                       # None: no multi-packet write
    imm_order: Counter                    # "little"/"big": ImmDt equal to the write's RETH length
    cts_sizes: Counter                    # payload bytes of the CTS writes
    hosts: list[dict[str, tuple[int, int]]]   # per file: address -> (sent, received) write frames


@dataclass
class Ring:
    """The ring :func:`ring_of` found (order up to rotation) and what it could not decide."""

    order: list[str]
    protocol: str
    flows_per_edge: int                   # channels x QPs per connection
    mtu: int | None
    macs: dict[str, str]
    eras: list[str]                       # eras the CTS size and ImmDt order allow
    adaptive_routing: bool                # data messages end in a zero-length WRITE with immediate
    undecided: list[str] = field(default_factory=list)   # what the wire does not show
    to_fit: list[str] = field(default_factory=list)      # what :func:`fit` decides, given the model

    @staticmethod
    def order_of(doc: dict) -> list[str]:
        """A job document's ring order, as addresses."""
        return [r["ip"] for r in doc["ring"]["ranks"]]


def survey(paths: Iterable, progress: Callable[[int, int], None] | None = None,
           max_frames: int = 65536) -> Survey:
    """Read every capture once (bounded memory: batches of ``max_frames``)."""
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ConfigError("no capture given; give one or more pcap or pcapng files")
    for p in paths:
        if not os.path.isfile(p):
            raise CaptureError(f"{p}: no such capture file")
    total = sum(os.path.getsize(p) for p in paths)
    macs: dict[bytes, bytes] = {}
    imm_order: Counter = Counter()
    flows: list[dict] = []
    hosts: list[dict] = []
    mtu = frames = done = 0
    records = np.empty(max_frames, FRAME_DTYPE)
    for i, path in enumerate(paths):
        table = FlowTable(1 << 16)        # per file: each capture has its own QPNs
        sizes: dict[int, Counter] = {}    # flow -> Counter of plain WRITE_ONLY payload sizes
        reth: dict[int, int] = {}         # flow -> RETH length of its last WRITE_FIRST
        hosts.append({})
        with PcapReader(path, max_frames=max_frames) as reader:
            for batch in reader:
                recs, _ = decode_batch(batch, out=records, decapsulate=True)
                ids = table.assign(recs)
                table.accumulate(recs, ids, batch.data)
                frames += len(recs)
                ok = (recs["event"] == DECODE_OK) & (recs["icrc"] != ICRC_BAD) & (ids >= 0)
                op = recs["opcode"]
                bulk = ok & ((op == WRITE_FIRST) | (op == WRITE_MIDDLE))
                if bulk.any():
                    mtu = max(mtu, int(recs["payload_len"][bulk].max()))
                _learn_macs(recs, ok, batch, macs)
                writes = ok & np.isin(op, WRITES)
                for side, column in enumerate(("src_ip", "dst_ip")):
                    keys, counts = np.unique(_address_keys(recs[writes], column), return_counts=True)
                    for k, n in zip(keys.tolist(), counts.tolist()):
                        if k in hosts[-1] or len(hosts[-1]) < MAX_ADDRESSES:
                            hosts[-1].setdefault(k, [0, 0])[side] += n
                for j in np.flatnonzero(ok & np.isin(op, (WRITE_FIRST, WRITE_ONLY, WRITE_ONLY_IMM, WRITE_LAST_IMM))):
                    f, code, r = int(ids[j]), int(op[j]), recs[j]
                    if code == WRITE_ONLY:
                        seen = sizes.setdefault(f, Counter())
                        if int(r["payload_len"]) in seen or len(seen) < SIZES_PER_FLOW:
                            seen[int(r["payload_len"])] += 1
                    elif code == WRITE_FIRST:
                        reth[f] = int(r["reth_len"])
                    else:
                        length = int(r["reth_len"]) if code == WRITE_ONLY_IMM else reth.pop(f, 0)
                        if length and sum(imm_order.values()) < IMM_SAMPLES:
                            imm_evidence(int(r["imm"]), length, imm_order)
        for f, row in enumerate(table.describe()):
            row.update(file=i, write_sizes=dict(sizes.get(f, {})))
            row["role"] = _role(row)
            flows.append(row)
        done += os.path.getsize(path)
        if progress is not None:
            progress(done, total)
    cts = Counter()
    for row in flows:
        if row["role"] == "cts":
            cts.update(row["write_sizes"])
    return Survey(files=paths, frames=frames, flows=flows, macs=_mac_names(macs), mtu=mtu or None,
                  imm_order=imm_order, cts_sizes=cts,
                  hosts=[{_name(k): tuple(v) for k, v in h.items()} for h in hosts])


def _address_keys(recs: np.ndarray, column: str) -> np.ndarray:
    """Each record's address and IP version as 17 bytes (one ``bytes`` per record)."""
    raw = np.concatenate([recs[column], recs["ip_version"][:, None]], axis=1)
    return np.ascontiguousarray(raw).view("S17").ravel()


def _learn_macs(recs: np.ndarray, ok: np.ndarray, batch, macs: dict[bytes, bytes]) -> None:
    """The source MAC of each source address, from its first unencapsulated frame (in an
    ERSPAN frame the Ethernet header at the frame's start is the mirror session's)."""
    plain = np.flatnonzero(ok & (recs["erspan_type"] == 0))
    if not plain.size:
        return
    keys = _address_keys(recs[plain], "src_ip")
    _, first = np.unique(keys, return_index=True)
    for i in first:
        if keys[i] not in macs and len(macs) < MAX_ADDRESSES:
            off = int(batch.offsets[plain[i]])
            macs[keys[i]] = bytes(batch.data[off + 6:off + 12])


def _name(key: bytes) -> str:
    """An address key of :func:`_address_keys` as ``ipaddress`` prints it (IPv4 unmapped)."""
    key = key.ljust(17, b"\0")           # NumPy's S17 drops trailing zero bytes
    addr = ipaddress.IPv6Address(key[:16])
    return str(addr.ipv4_mapped) if key[16] == 4 and addr.ipv4_mapped else str(addr)


def _mac_names(macs: dict[bytes, bytes]) -> dict[str, str]:
    return {_name(key): ":".join(f"{b:02x}" for b in mac) for key, mac in macs.items()}


def _role(row: dict) -> str:
    ops = set(row["opcodes"]) - {str(ACK)}
    if ops & ENDS_WITH_IMM:
        return "data"
    if ops == {str(WRITE_ONLY)} and len(row["write_sizes"]) == 1:
        return "cts"
    return "other"


def ring_of(s: Survey) -> Ring:
    """The ring the data flows draw, or a :class:`GradtapError` saying what they draw instead."""
    data = [f for f in s.flows if f["role"] == "data"]
    if not data:
        raise GradtapError(f"no RDMA WRITE with immediate in {len(s.files)} capture(s) ({s.frames:,} frames): "
                           "nothing here is NCCL's IB/RoCE data traffic. Check that the mirror carries the "
                           "job's ports (gradtap inspect lists what the captures hold)")
    # Flows are grouped by protocol, so that a pipeline's p2p writes (another protocol) between
    # ring neighbours are not counted as channels; when calls of several protocols share the
    # ring's connections (flows "mixed"), every data flow of a protocol seen on them belongs.
    groups = {p: {p} for p in {f["nccl_protocol"] for f in data}}
    if MIXED in groups:
        groups[MIXED] = set(groups)
    rings, seen = {}, []
    for proto in sorted(groups):
        per_file = Counter((f["file"], f["src"], f["dst"]) for f in data if f["nccl_protocol"] in groups[proto])
        edges: Counter = Counter()
        for (_, a, b), n in per_file.items():        # flows per edge: in one capture (QPNs are per run)
            edges[(a, b)] = max(edges[(a, b)], n)
        order = _cycle(edges)
        seen.append(f"{proto}: {len(edges)} edge(s) between {len({a for e in edges for a in e})} hosts")
        if order is not None:
            counts = {edges[(a, b)] for a, b in zip(order, order[1:] + order[:1])}
            rings[proto] = (order, counts)
    if not rings:
        raise GradtapError("the data flows draw no ring (" + "; ".join(seen) + "): a ring allreduce sends from each "
                           "rank to the next around a cycle. Mirror every rank's port, or both directions of one "
                           "rank's, and include a whole iteration")
    undecided = []
    busiest = max(rings, key=lambda p: sum(f["frames"] for f in data if f["nccl_protocol"] in groups[p]))
    order, counts = rings[busiest]
    proto = busiest
    if len(rings) > 1 or busiest == MIXED:
        proto = "auto"
        undecided.append(f"the ring's flows carry calls in several protocols ({', '.join(sorted(groups))}): NCCL's tuner "
                         "picks one per call; nccl.protocol 'auto' is written (the appliance reads each bucket's "
                         "from the wire), or give --job with the model to have them written one per bucket")
    if len(counts) != 1:
        undecided.append(f"the ring's edges carry different numbers of data flows ({sorted(counts)}): some flows "
                         "were not captured, or other traffic shares the ring's protocol")
    to_fit = [f"which rank is ring position 0: any rotation of the {len(order)} ranks fits the wire modulo an "
              "iteration; give --job with the model to decide it"]
    per_edge = max(counts)
    if per_edge > 1:
        to_fit.append(f"channels x QPs per connection = {per_edge}: written as {per_edge} channels of 1 QP; "
                         "give --job to try the other splits")
    missing = [a for a in order if a not in s.macs]
    if missing:
        undecided.append("the MAC of " + ", ".join(missing) + " (seen only encapsulated, or not as a source)")
    if s.mtu is None:
        undecided.append("the MTU: no multi-packet write was captured")
    eras = eras_of(s)
    if not eras:
        raise GradtapError(f"the CTS writes ({dict(s.cts_sizes)} bytes) and ImmDt byte order ({dict(s.imm_order)}) "
                           f"fit no NCCL era from {SUPPORTED_ERAS[0]} to {SUPPORTED_ERAS[-1]} (CTS of 32 bytes up "
                           "to 2.19 and 64 from 2.20; ImmDt big-endian from 2.29)")
    if len(eras) > 1:
        to_fit.append(f"the NCCL era: the wire fits {eras[0]} to {eras[-1]}; give the trainer's NCCL "
                         "(major.minor), or --job to try each")
    # NCCL_IB_ADAPTIVE_ROUTING: the bulk of a message goes as a plain WRITE, then a zero-length
    # WRITE with immediate (ncclIbMultiSend); without it every data write carries the immediate.
    adaptive = any(set(f["opcodes"]) & PLAIN_ENDS for f in data if f["nccl_protocol"] in groups[busiest])
    return Ring(order=order, protocol=proto, flows_per_edge=per_edge, mtu=s.mtu, macs=s.macs, eras=eras,
                adaptive_routing=adaptive, undecided=undecided, to_fit=to_fit)


def _cycle(edges: Counter) -> list[str] | None:
    """The hosts of the longest directed cycle that following each host's busiest out-edge
    walks (hosts off it, such as a point-to-point peer, are left out), in its order from its
    lowest host; None if the walk closes no cycle of two hosts or more."""
    nxt = {}
    for (a, b), n in sorted(edges.items()):
        if n > edges.get((a, nxt.get(a)), 0):
            nxt[a] = b
    best: list[str] = []
    for start in sorted(nxt):
        order = [start]
        while order[-1] in nxt and nxt[order[-1]] not in order:
            order.append(nxt[order[-1]])
        if nxt.get(order[-1]) == start and len(order) > len(best):
            best = order
    if len(best) < 2:
        return None
    k = best.index(min(best))
    return best[k:] + best[:k]


def eras_of(s: Survey) -> list[str]:
    """The eras whose CTS size and ImmDt byte order the captures show (all, with no evidence)."""
    return eras_shown(s.cts_sizes, s.imm_order)


@dataclass
class Fit:
    """One candidate job that :func:`fit` ran the captures through, and what it recovered."""

    spec: dict                            # the job document (the partial one, completed)
    locked: int                           # captures whose stream locked on and recovered an iteration
    learnt: list[dict[str, int]]          # per capture: planned flow label -> learnt QPN
    reasons: list[str]                    # why the other captures did not lock
    eras: tuple[str, ...] = ()            # the eras that send this job's traffic alike (when read from the wire)


def candidates(partial: dict, ring: Ring) -> list[dict]:
    """The job documents that the wire leaves open: every rotation of the ring and every split
    of an edge's data flows into channels x QPs, with the era and the protocols left to the
    wire (``auto``: ``parser/resolve.py`` reads them while a candidate is tried). What the
    partial job already says (its ``ring``, ``nccl.era``, ``nccl.channels``,
    ``nccl.qps_per_connection``, or any other ``nccl`` field) is kept, not tried."""
    given = dict(partial.get("nccl") or {})
    wire = {"era": "auto", "protocol": "auto", "adaptive_routing": ring.adaptive_routing}
    if ring.mtu is not None:
        wire["mtu"] = ring.mtu
    per_edge = ring.flows_per_edge
    splits = [(per_edge // q, q) for q in range(1, per_edge + 1) if per_edge % q == 0
              and given.get("channels", per_edge // q) == per_edge // q and given.get("qps_per_connection", q) == q]
    if "ring" in partial:
        rings = [partial["ring"]]
    else:
        # An address seen only inside ERSPAN has no MAC from the wire: a placeholder, said in undecided.
        macs = {ip: ring.macs.get(ip, f"02:00:00:00:ff:{i:02x}") for i, ip in enumerate(ring.order)}
        rings = [{"ranks": [{"ip": ip, "mac": macs[ip]} for ip in ring.order[k:] + ring.order[:k]]}
                 for k in range(len(ring.order))]
    return [dict(partial, nccl={**wire, **given, "channels": channels, "qps_per_connection": qps}, ring=r)
            for r in rings for channels, qps in splits]


def fit(partial: dict, s: Survey, ring: Ring, progress: Callable[[int, int], None] | None = None) -> list[Fit]:
    """Run the captures through the stream parser under every candidate of ``partial`` (a job
    document with at least ``name`` and ``model``), best first: most captures locked on with an
    iteration recovered. Each capture is parsed as the port mirror of the ring address its
    writes all touch (both directions, or the one it shows)."""
    docs = candidates(partial, ring)
    fits = []
    quiet = logging.getLogger("gradtap.parser")      # a candidate that does not fit is no news
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for k, doc in enumerate(docs):
            fits.append(_try(doc, partial, s, ring))
            if progress is not None:
                progress(k + 1, len(docs))
    finally:
        quiet.setLevel(level)
    fits.sort(key=lambda f: -f.locked)
    return fits


def _try(doc: dict, partial: dict, s: Survey, ring: Ring) -> Fit:
    """One candidate, capture by capture: its era and protocols read from the wire where it
    leaves them ``auto`` (the first capture that decides them fixes them for the rest), then
    the stream parser until the capture has locked on and recovered an iteration, or ended, or
    given :data:`TRIAL_FRAMES` frames."""
    from gradtap.parser.stream import StreamParser
    from gradtap.workload.layout import job_plan
    from gradtap.workload.spec import parse_job

    doc = dict(doc, mirrors=[_mirror(i, h, ring.order_of(doc)) for i, h in enumerate(s.hosts)])
    spec = parse_job(doc, "the job --job gave, completed from the wire")
    plan, eras = None, ()
    locked, learnt, reasons = 0, [], []
    for i, path in enumerate(s.files):
        stream = f"capture{i}"
        if plan is None and not spec.nccl.resolved:
            resolution, why = _resolve(spec, stream, path)
            if resolution is None:
                learnt.append({})
                reasons.append(f"{path}: {why}")
                continue
            spec, eras = resolution.job, resolution.eras
        plan = plan or job_plan(spec)
        parser = StreamParser(spec, plan, stream, spares=0)     # a trial: nothing is given back
        got: list = []
        frames = 0
        with PcapReader(path) as reader:
            for batch in reader:
                got += parser.feed(batch)
                frames += len(batch.offsets)
                if (parser.locked and any(a.covered.any() for a in got)) or frames >= TRIAL_FRAMES:
                    break
        got += parser.flush()
        if parser.locked and any(a.covered.any() for a in got):
            locked += 1
            learnt.append({parser.tables.label(f): int(q) for f, q in enumerate(parser.tables.qpn)
                           if q != UNKNOWN_QPN})     # a CTS whose data connection this mirror does not show
        else:
            learnt.append({})
            why = parser.failure.reason if parser.failure is not None else "no iteration recovered"
            reasons.append(f"{path}: {why}")
    nccl = dict(doc["nccl"])
    if spec.nccl.resolved:
        nccl["era"] = spec.nccl.era
        protocols = spec.nccl.protocols or (spec.nccl.protocol,) * len(plan.bucket_numels)
        if len(set(protocols)) == 1:
            nccl.update(protocol=protocols[0])
            nccl.pop("protocols", None)
        else:
            nccl.update(protocol=Counter(protocols).most_common(1)[0][0], protocols=list(protocols))
    return Fit(spec=dict(doc, nccl=nccl, mirrors=partial.get("mirrors") or doc["mirrors"]), locked=locked,
               learnt=learnt, reasons=reasons, eras=eras)


def _resolve(spec, stream: str, path: str):
    """The era and protocols one capture shows (``parser/resolve.py``), or why not."""
    from gradtap.parser.resolve import Resolver

    resolver = Resolver(spec, [stream], spec.appliance.iteration_gap_ns)
    frames = 0
    with PcapReader(path) as reader:
        for batch in reader:
            recs, _ = decode_batch(batch, spec.appliance.verify_icrc, decapsulate=True)
            resolver.observe(stream, recs, batch.data)
            frames += len(batch.offsets)
            if resolver.decide() is not None or stream in resolver.failures or frames >= TRIAL_FRAMES:
                break
    found = resolver.decide(final=True)
    return found, resolver.failures.get(stream, "its era and protocols were not decided")


def _mirror(i: int, hosts: dict[str, tuple[int, int]], order: list[str]) -> dict:
    """Capture ``i`` as a port mirror: the ring address in most of its writes, and the
    directions it shows that address in."""
    ours = {a: v for a, v in hosts.items() if a in order}
    if not ours:
        return {"name": f"capture{i}", "rank": 0, "direction": "both"}
    address = max(ours, key=lambda a: sum(ours[a]))
    sent, received = ours[address]
    direction = "both" if sent and received else "egress" if sent else "ingress"
    return {"name": f"capture{i}", "rank": order.index(address), "direction": direction}


@dataclass
class Discovery:
    """What ``gradtap discover`` writes: a job document (or its ``nccl`` and ``ring``
    sections), the QPNs learnt per capture, and what the wire did not decide."""

    doc: dict
    learnt: list[dict[str, int]]
    undecided: list[str]


def discover(paths: Iterable, partial: dict | None = None,
             progress: Callable[[str, int, int], None] | None = None) -> Discovery:
    """Survey the captures, find the ring and, with a partial job document (``name``, ``model``
    and whatever else the operator knows), complete it with the candidate that the stream
    parser locks on with in the most captures."""
    s = survey(paths, None if progress is None else lambda done, total: progress("reading", done, total))
    ring = ring_of(s)
    if partial is None:
        ranks = [{"ip": ip, "mac": ring.macs.get(ip)} for ip in ring.order]
        nccl = {"era": ring.eras[0] if len(ring.eras) == 1 else None, "protocol": ring.protocol,
                "channels": ring.flows_per_edge, "qps_per_connection": 1,
                "adaptive_routing": ring.adaptive_routing, "mtu": ring.mtu}
        return Discovery(doc={"nccl": {k: v for k, v in nccl.items() if v is not None},
                              "ring": {"ranks": [{k: v for k, v in r.items() if v is not None} for r in ranks]}},
                         learnt=[], undecided=ring.to_fit + ring.undecided)
    for key in ("name", "model"):
        if key not in partial:
            raise ConfigError(f"--job: the partial job has no '{key}'; discover needs the job's name and its model "
                              "(the bucket sizes decide the ring's rotation and the channels)")
    fits = fit(partial, s, ring, None if progress is None else lambda k, n: progress("trying", k, n))
    best = fits[0]
    if best.locked == 0:
        raise GradtapError(f"none of the {len(fits)} jobs the wire leaves open locked on in any capture; the first "
                           "one's reasons:\n  " + "\n  ".join(best.reasons) +
                           "\ncheck the model (its bucket sizes) and the ddp section of the partial job")
    ties = [f for f in fits if f.locked == best.locked]
    undecided = list(ring.undecided)
    if len(ties) > 1:
        undecided.append(f"{len(ties)} jobs fit equally ({best.locked} of {len(s.files)} captures): "
                         + "; ".join(_differs(best.spec, f.spec) for f in ties[1:]) + "; the first is written")
    if len(best.eras) > 1:
        undecided.append(f"the NCCL era: {best.eras[0]} to {best.eras[-1]} send this job's traffic alike; "
                         f"nccl.era {best.spec['nccl']['era']!r} is written, give the trainer's NCCL major.minor")
    if best.locked < len(s.files):
        undecided.append("captures that did not lock on under the job written: " + "; ".join(best.reasons))
    return Discovery(doc=best.spec, learnt=best.learnt, undecided=undecided)


def _differs(a: dict, b: dict) -> str:
    """How candidate ``b`` differs from ``a``: ring order or NCCL fields."""
    out = [f"nccl.{k} {b['nccl'][k]!r}" for k in b["nccl"] if a["nccl"].get(k) != b["nccl"][k]]
    if Ring.order_of(a) != Ring.order_of(b):
        out.append("ring order " + ", ".join(Ring.order_of(b)))
    return " and ".join(out) or "the same job"
