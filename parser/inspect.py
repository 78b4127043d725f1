"""What a capture holds, for ``gradtap inspect``: its RoCEv2 flows with their opcodes, payload
bytes, PSNs, PSN gaps and NCCL protocol, the ICRC results, and with a job, which messages are
which phase and bucket of the wire plan.

The file is read in :class:`~capture.pcap.PcapReader` batches and each batch is decoded by
stage 1 (``parser/decode.py``), so memory stays bounded whatever the file size: per flow the
summary keeps a fixed row of counters, and the job matching below at most ``2 x`` a plan flow's
messages per iteration while it aligns.

Definitions (the JSON keys of :func:`inspect_capture`):

- **RoCEv2 frame**: a frame whose BTH was read (:func:`gradtap.parser.decode.is_roce`), whatever its
  opcode (0xaa counts), its ICRC or whether it was cut short; tshark counts the same frames.
- **flow**: (IP version, source IP, destination IP, BTH destination QP), in order of first
  appearance. ``udp_sport`` is the source port of the flow's first frame (a flow may see
  several). ``payload_bytes`` is what follows the BTH and the opcode's extension headers,
  without pad and ICRC, as the UDP length declares it (for an unknown opcode, everything after
  the BTH). ``psn_first``/``psn_last`` are the PSNs of its first and last frame.
- **PSN gaps**: over the flow's requests (SEND, WRITE, READ request, ATOMIC; responses such
  as ACKs carry the responder's PSNs and are left out) without a bad ICRC, the number of places where a PSN
  skips forward from the highest PSN seen so far by more than one (modulo 2^24, forward
  meaning less than 2^23 ahead). A PSN at or behind the highest (a retransmission, a
  duplicate, a reordered packet) is not a gap. A READ request that is answered by several
  packets advances the PSN by more than one and so also shows as a gap.
- **ICRC**: ``ok``/``bad`` count the complete RoCEv2 frames whose ICRC was checked; a frame
  cut short is in neither.
- **NCCL protocol**, guessed from up to :data:`MAX_SAMPLES` WRITE/SEND packets per flow with
  at least one LL128 line of payload and a good ICRC: ``LL`` if in every sampled packet each
  16-byte line has two equal 32-bit flags (bytes 4-7 and 12-15) and every line's flag is the
  packet's one nonzero flag; ``LL128`` if in every sampled packet the last 8 bytes of each
  128-byte line hold the packet's one flag, nonzero and below 2^32 (a step counter);
  ``Simple`` otherwise; ``unknown`` for a flow without such packets (ACK-only flows, CTS
  writes of 32 bytes).
"""

from __future__ import annotations

import ipaddress
import os
from collections import deque
from typing import Callable

import numpy as np
from numba import njit

from gradtap.capture.pcap import PcapReader
from gradtap.core.bytes import read_le_u64
from gradtap.core.errors import CaptureError
from gradtap.core.jit import JIT
from gradtap.parser.decode import decode_batch, is_roce
from gradtap.parser.stream_tables import ip16
from gradtap.wire.events import DECODE_OK
from gradtap.wire.frame_record import FRAME_DTYPE, ICRC_BAD, ICRC_OK
from gradtap.wire.headers.opcodes import (KIND_ATOMIC, KIND_READ_REQUEST, KIND_SEND, KIND_WRITE,
                                    OPCODE_KIND, OPCODE_RETH_OFF, OPCODE_VALID)
from gradtap.wire.ll import LL_FLAG1_OFF, LL_FLAG2_OFF, LL_HALF_BYTES, LL_LINE_BYTES
from gradtap.wire.ll128 import LL128_FLAG_OFF, LL128_LINE_BYTES, LL128_WORD_BYTES
from gradtap.wire.protocol import Protocol
from gradtap.wire.psn import PSN_HALF, psn_ahead, psn_delta
from gradtap.workload.layout import job_plan
from gradtap.workload.wire_plan import CTS, PHASE_AG, PHASE_RS

MAX_SAMPLES = 64
LL128_FLAG_LIMIT = 1 << 32

# Columns of the per-flow state (int64[flows, N_COLUMNS]).
FRAMES, PAYLOAD, PSN_FIRST, PSN_LAST, TOP, UTOP, GAPS, SAMPLED, LL_PASS, LL128_PASS, SPORT = range(11)
N_COLUMNS = 11


@njit(**JIT)
def _line_flag(data, off, n, line_bytes, flag_off, flag_bytes):
    """The flag at ``flag_off`` of the first line if every ``line_bytes`` line of the packet
    ``data[off:off + n]`` holds the same one there; 0 otherwise (uint64)."""
    if n % line_bytes:
        return np.uint64(0)
    flag = read_le_u64(data, off + flag_off, flag_bytes)
    for line in range(off, off + n, line_bytes):
        if read_le_u64(data, line + flag_off, flag_bytes) != flag:
            return np.uint64(0)
    return flag


@njit(**JIT)
def _is_ll(data, off, n):
    """Both 32-bit flags of every 16-byte line equal one nonzero flag."""
    flag = _line_flag(data, off, n, LL_LINE_BYTES, LL_FLAG1_OFF, LL_HALF_BYTES)
    return flag != 0 and _line_flag(data, off, n, LL_LINE_BYTES, LL_FLAG2_OFF, LL_HALF_BYTES) == flag


@njit(**JIT)
def _is_ll128(data, off, n):
    """The last word of every 128-byte line equals one flag, nonzero and below 2**32."""
    flag = _line_flag(data, off, n, LL128_LINE_BYTES, LL128_FLAG_OFF, LL128_WORD_BYTES)
    return flag != 0 and flag < np.uint64(LL128_FLAG_LIMIT)


@njit(**JIT)
def _accumulate(records, flow_ids, data, state, opcodes, upsn):
    """Add a decoded batch to the per-flow state, in arrival order.

    ``flow_ids[i]`` is record ``i``'s flow (-1: not RoCEv2). ``upsn[i]`` receives a request's
    PSN unwrapped to an int64 that keeps counting past 2^24 (-1 for other records)."""
    for i in range(len(records)):
        upsn[i] = -1
        f = flow_ids[i]
        if f < 0:
            continue
        rec = records[i]
        opcode = rec["opcode"]
        psn = np.int64(rec["psn"])
        if state[f, FRAMES] == 0:
            state[f, PSN_FIRST] = psn
            state[f, SPORT] = rec["udp_sport"]
        state[f, FRAMES] += 1
        state[f, PSN_LAST] = psn
        state[f, PAYLOAD] += rec["payload_len"]
        opcodes[f, opcode] += 1
        kind = OPCODE_KIND[opcode] if OPCODE_VALID[opcode] else 0
        request = kind == KIND_SEND or kind == KIND_WRITE or kind == KIND_READ_REQUEST or kind == KIND_ATOMIC
        if request and rec["icrc"] != ICRC_BAD:  # a corrupted PSN would make up a gap
            if state[f, TOP] < 0:
                state[f, TOP] = psn
                state[f, UTOP] = psn
                upsn[i] = psn
            else:
                ahead = psn_ahead(state[f, TOP], psn)
                upsn[i] = state[f, UTOP] + psn_delta(state[f, TOP], psn)
                if 0 < ahead < PSN_HALF:
                    state[f, GAPS] += ahead > 1
                    state[f, TOP] = psn
                    state[f, UTOP] += ahead
        if (rec["event"] == DECODE_OK and (kind == KIND_WRITE or kind == KIND_SEND)
                and rec["payload_len"] >= LL128_LINE_BYTES and state[f, SAMPLED] < MAX_SAMPLES):
            state[f, SAMPLED] += 1
            state[f, LL_PASS] += _is_ll(data, rec["payload_off"], rec["payload_len"])
            state[f, LL128_PASS] += _is_ll128(data, rec["payload_off"], rec["payload_len"])


KEY_DTYPE = np.dtype([("version", "u1"), ("src", "u1", 16), ("dst", "u1", 16), ("qp", "u4")])


class _Flows:
    """Flow keys -> dense ids, and the state arrays that grow with them."""

    def __init__(self):
        self.ids: dict[bytes, int] = {}
        self.keys: list[np.void] = []
        self.state = np.zeros((0, N_COLUMNS), np.int64)
        self.opcodes = np.zeros((0, 256), np.int64)

    def assign(self, records: np.ndarray) -> np.ndarray:
        """Flow id of every record (-1 if not RoCEv2), adding new flows."""
        roce = np.flatnonzero(is_roce(records))
        keys = np.zeros(len(roce), KEY_DTYPE)
        for name, field in (("version", "ip_version"), ("src", "src_ip"), ("dst", "dst_ip"),
                            ("qp", "dest_qp")):
            keys[name] = records[field][roce]
        raw = keys.view(np.dtype((np.void, KEY_DTYPE.itemsize)))
        unique, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
        local = np.empty(len(unique), np.int64)
        for j in np.argsort(first):  # new flows numbered in order of first appearance
            local[j] = self.ids.setdefault(unique[j].tobytes(), len(self.ids))
            if local[j] == len(self.keys):
                self.keys.append(keys[first[j]])
        grow = len(self.ids) - len(self.state)
        if grow:
            fresh = np.zeros((grow, N_COLUMNS), np.int64)
            fresh[:, TOP] = -1
            self.state = np.concatenate([self.state, fresh])
            self.opcodes = np.concatenate([self.opcodes, np.zeros((grow, 256), np.int64)])
        ids = np.full(len(records), -1, np.int64)
        ids[roce] = local[inverse.ravel()]
        return ids

    def describe(self, f: int) -> dict:
        key, row = self.keys[f], self.state[f]
        if row[SAMPLED] == 0:
            protocol = "unknown"
        elif row[LL_PASS] == row[SAMPLED]:
            protocol = Protocol.LL.nccl_name
        elif row[LL128_PASS] == row[SAMPLED]:
            protocol = Protocol.LL128.nccl_name
        else:
            protocol = Protocol.SIMPLE.nccl_name
        return {"src": address(key["src"], key["version"]), "dst": address(key["dst"], key["version"]),
                "dest_qp": int(key["qp"]), "udp_sport": int(row[SPORT]), "frames": int(row[FRAMES]),
                "opcodes": {str(op): int(c) for op, c in enumerate(self.opcodes[f]) if c},
                "payload_bytes": int(row[PAYLOAD]), "psn_first": int(row[PSN_FIRST]),
                "psn_last": int(row[PSN_LAST]), "psn_gaps": int(row[GAPS]), "nccl_protocol": protocol}


def address(raw: np.ndarray, version: int) -> str:
    """A record's 16-byte address as ``ipaddress`` prints it (IPv4 from ``::ffff:a.b.c.d``)."""
    addr = ipaddress.IPv6Address(bytes(raw))
    return str(addr.ipv4_mapped) if version == 4 and addr.ipv4_mapped else str(addr)


def inspect_capture(path, job=None, progress: Callable[[int, int], None] | None = None,
                    max_frames: int = 65536) -> dict:
    """Summarise the capture at ``path`` (pcap or pcapng).

    Parameters
    ----------
    job:
        Optional :class:`~workload.spec.JobSpec`: also map each flow's RDMA WRITE messages
        onto the job's wire plan (:class:`PlanMatcher`); adds the ``"job"`` key, and a
        ``"job"`` entry to each flow between two of the job's ranks.
    progress:
        Called as ``progress(bytes_read, file_bytes)`` after each batch.
    max_frames:
        Frames per batch (bounds memory: about 100 bytes of record per frame plus the
        batch's frames).

    Returns the JSON-ready dict described in the module docstring. Raises
    :class:`CaptureError` naming the file if it cannot be read as an Ethernet capture.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CaptureError(f"{path}: no such capture file")
    total = os.path.getsize(path)
    flows = _Flows()
    matcher = PlanMatcher(job, flows.keys) if job is not None else None
    frames = roce = icrc_ok = icrc_bad = 0
    records = np.empty(max_frames, FRAME_DTYPE)
    with PcapReader(path, max_frames=max_frames) as reader:
        for batch in reader:
            recs, _ = decode_batch(batch, out=records, decapsulate=True)   # ERSPAN opened, as tshark does
            ids = flows.assign(recs)
            upsn = np.empty(len(recs), np.int64)
            _accumulate(recs, ids, batch.data, flows.state, flows.opcodes, upsn)
            frames += len(recs)
            roce += int((ids >= 0).sum())
            icrc_ok += int((recs["icrc"] == ICRC_OK).sum())
            icrc_bad += int((recs["icrc"] == ICRC_BAD).sum())
            if matcher is not None:
                starts = np.flatnonzero((recs["event"] == DECODE_OK) & (upsn >= 0)
                                        & (OPCODE_RETH_OFF[recs["opcode"]] >= 0)
                                        & (OPCODE_KIND[recs["opcode"]] == KIND_WRITE))
                matcher.feed(ids[starts], upsn[starts], recs["reth_len"][starts].astype(np.int64))
            if progress is not None:
                progress(reader.bytes, total)
        fmt = reader.format
    summary = {"file": path, "format": fmt, "frames": frames, "roce_frames": roce,
               "icrc": {"ok": icrc_ok, "bad": icrc_bad},
               "flows": [flows.describe(f) for f in range(len(flows.keys))]}
    if matcher is not None:
        per_flow, totals = matcher.finish()
        for f, info in per_flow.items():
            summary["flows"][f]["job"] = info
        summary["job"] = totals
    return summary


PHASE_NAMES = ("reduce-scatter", "allgather", "CTS", "other")
DEDUP_WINDOW = 1024


class PlanMatcher:
    """Which phase and bucket of the job's wire plan each captured RDMA WRITE message is.

    Real QPNs and UDP ports are chosen by the NICs, so a capture flow is matched to a plan
    flow by its (source, destination) address pair and by its messages: their sizes (RETH DMA
    length) at their PSN positions. A message starts with a RETH (WRITE FIRST/ONLY); its
    position is its unwrapped PSN. Alignment: for each plan flow of the pair and each planned
    message ``j`` of the size of the first captured one, the base PSN that puts the first
    message at ``j``; a base is right when every captured message then lands, modulo the
    flow's packets per iteration, on a planned message of its size. Among right alignments
    the one whose plan QPN equals the capture's QP wins, then a plan flow not yet matched,
    then the lowest (flow, ``j``); ``alignments`` says how many were right (more than one:
    the plan cannot tell them apart by size, e.g. buckets of equal size). A flow aligns once
    it has ``2 x`` its plan's messages per iteration, or at the end of the file.

    Messages are counted once: one whose start PSN is among the flow's last
    :data:`DEDUP_WINDOW` counted ones is a retransmission or a duplicate. Messages of flows that match no plan flow, and
    messages that land on no planned message, are ``other``. Buckets count data messages
    (reduce-scatter and allgather), not CTS.
    """

    def __init__(self, job, keys: list):
        self.job = job
        self.plan = job_plan(job)
        self.keys = keys
        self.candidates: dict[tuple, list[int]] = {}
        for p, flow in enumerate(self.plan.flows):
            pair = (ip16(job.ring.ranks[flow["src"]].ip).tobytes(), ip16(job.ring.ranks[flow["dst"]].ip).tobytes())
            self.candidates.setdefault(pair, []).append(p)
        self.pending: dict[int, list[np.ndarray]] = {}
        self.aligned: dict[int, tuple[int, int, int]] = {}   # flow -> (plan flow, base, alignments)
        self.counts: dict[int, np.ndarray] = {}               # flow -> messages per planned message
        self.recent: dict[int, tuple[set, deque]] = {}      # flow -> start PSNs lately counted
        self.other: dict[int, int] = {}
        self.taken: set[int] = set()

    def _plan_flows(self, f: int) -> list[int]:
        key = self.keys[f]
        return self.candidates.get((bytes(key["src"]), bytes(key["dst"])), [])

    def feed(self, flows: np.ndarray, upsn: np.ndarray, sizes: np.ndarray) -> None:
        """Message starts in arrival order: capture flow, unwrapped PSN, RETH DMA length."""
        for f in np.unique(flows):
            sel = flows == f
            f = int(f)
            if f in self.aligned:
                self._count(f, upsn[sel], sizes[sel])
            elif not self._plan_flows(f):
                self.other[f] = self.other.get(f, 0) + int(sel.sum())
            else:
                self.pending.setdefault(f, []).append(np.stack([upsn[sel], sizes[sel]]))
                if sum(p.shape[1] for p in self.pending[f]) >= self._limit(f):
                    self._align(f)

    def _limit(self, f: int) -> int:
        return 2 * max(int(self.plan.flows["msg_count"][p]) for p in self._plan_flows(f))

    def _align(self, f: int) -> None:
        upsn, sizes = np.concatenate(self.pending.pop(f), axis=1)
        right = []
        for p in self._plan_flows(f):
            msgs = self.plan.flow_messages(p)
            for j in np.flatnonzero(msgs["wire_bytes"] == sizes[0]):
                base = int(upsn[0] - msgs["psn_offset"][j])
                if _lands(msgs, int(self.plan.flows["npkts"][p]), base, upsn, sizes).all():
                    qp_differs = int(self.plan.flows["dst_qpn"][p]) != int(self.keys[f]["qp"])
                    right.append((qp_differs, p in self.taken, p, int(j), base))
        self.counts[f] = np.zeros(0, np.int64)
        if not right:
            self.other[f] = self.other.get(f, 0) + len(upsn)
            return
        _, _, p, _, base = min(right)
        self.aligned[f] = (p, base, len(right))
        self.taken.add(p)
        self.counts[f] = np.zeros(int(self.plan.flows["msg_count"][p]), np.int64)
        self._count(f, upsn, sizes)

    def _count(self, f: int, upsn: np.ndarray, sizes: np.ndarray) -> None:
        p, base, _ = self.aligned[f]
        msgs = self.plan.flow_messages(p)
        lands = _lands(msgs, int(self.plan.flows["npkts"][p]), base, upsn, sizes)
        index = np.searchsorted(msgs["psn_offset"], (upsn - base) % int(self.plan.flows["npkts"][p]))
        seen, order = self.recent.setdefault(f, (set(), deque()))
        for u, land, i in zip(upsn.tolist(), lands.tolist(), index.tolist()):
            if u in seen:
                continue
            seen.add(u)
            order.append(u)
            if len(order) > DEDUP_WINDOW:
                seen.discard(order.popleft())
            if land:
                self.counts[f][i] += 1
            else:
                self.other[f] = self.other.get(f, 0) + 1

    def finish(self) -> tuple[dict[int, dict], dict]:
        """Align what is still pending; ``({flow: its mapping}, totals)`` for the JSON."""
        for f in list(self.pending):
            self._align(f)
        per_flow, phases, buckets = {}, dict.fromkeys(PHASE_NAMES, 0), {}
        for f in sorted(set(self.counts) | set(self.other)):
            info = {"plan_flow": None, "messages": dict.fromkeys(PHASE_NAMES, 0), "buckets": {}}
            info["messages"]["other"] = self.other.get(f, 0)
            if f in self.aligned:
                p, _, alignments = self.aligned[f]
                flow = self.plan.flows[p]
                info.update(plan_flow=p, kind="CTS" if flow["kind"] == CTS else "data",
                            src_rank=int(flow["src"]), dst_rank=int(flow["dst"]),
                            channel=int(flow["channel"]), qp=int(flow["qp"]), alignments=alignments)
                for m, n in zip(self.plan.flow_messages(p), self.counts[f]):
                    info["messages"][_phase(m)] += int(n)
                    if m["kind"] != CTS and n:
                        info["buckets"][str(m["bucket"])] = info["buckets"].get(str(m["bucket"]), 0) + int(n)
            if self._plan_flows(f):
                per_flow[f] = info
            for name, n in info["messages"].items():
                phases[name] += n
            for b, n in info["buckets"].items():
                buckets[b] = buckets.get(b, 0) + n
        return per_flow, {"name": self.job.name, "phases": phases,
                          "buckets": dict(sorted(buckets.items(), key=lambda kv: int(kv[0])))}


def _lands(msgs, period: int, base: int, upsn: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which messages fall, relative to ``base`` and modulo ``period``, on a planned message
    start of their size."""
    offset = (upsn - base) % period
    index = np.minimum(np.searchsorted(msgs["psn_offset"], offset), len(msgs) - 1)
    return (msgs["psn_offset"][index] == offset) & (msgs["wire_bytes"][index] == sizes)


def _phase(message) -> str:
    if message["kind"] == CTS:
        return "CTS"
    return {PHASE_RS: "reduce-scatter", PHASE_AG: "allgather"}.get(int(message["phase"]), "other")
