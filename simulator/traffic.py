"""One iteration of ring-allreduce traffic as packet descriptors.

The wire plan says which RDMA writes each flow posts; this module gives them absolute
positions (PSN, FIFO step, slot address, LL flag, CTS index), payloads (the ring's true
partial sums, encoded per protocol), packets (FIRST/MIDDLE/LAST/ONLY per MTU), timestamps at
the configured line rate, the RC ACKs of the receivers, and the training-link faults that
make a sender retransmit (go-back-N). Mirror-link faults are not applied here: every mirror
of a link sees the same traffic, and each mirror then loses its own frames (see faults.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gradtap.simulator.frames import PACKET_DTYPE, Routes
from gradtap.simulator.payload import encode, wire_size
from gradtap.wire.headers import aeth, eth, ipv6, udp
from gradtap.wire.headers import opcodes as op
from gradtap.wire.headers.bth import BTH_LEN
from gradtap.wire.headers.immdt import IMMDT_LEN
from gradtap.wire.headers.reth import RETH_LEN
from gradtap.wire.icrc import ICRC_LEN
from gradtap.wire.protocol import Protocol
from gradtap.wire.psn import PSN_MODULUS, psn_add
from gradtap.workload import nccl as N
from gradtap.workload.spec import JobSpec
from gradtap.workload.wire_plan import CTS, DATA, NO_VA, WirePlan, senders

# ACK with the credit field "invalid" (end-to-end credits unused by RoCE NICs); NAK for a
# PSN sequence error (IBTA §9.3.5.1).
ACK_SYNDROME = aeth.syndrome_byte(aeth.SYNDROME_ACK, 0x1F)
NAK_SEQ_ERR_SYNDROME = aeth.syndrome_byte(aeth.SYNDROME_NAK, aeth.NAK_PSN_SEQUENCE_ERROR)
ETHERNET_FRAMING = 8 + 12 + 4  # preamble + SFD, inter-frame gap, FCS (bytes on the link per frame)
# Bytes on the link per packet besides its payload, at most (IPv6, RETH and ImmDt).
HEADER_OVERHEAD = (eth.ETH_LEN + ipv6.IPV6_LEN + udp.UDP_LEN + BTH_LEN + RETH_LEN + IMMDT_LEN + ICRC_LEN
                   + ETHERNET_FRAMING)
# Sends start at multiples of this in the payload arena (aligned word views for LL/LL128).
ARENA_ALIGN = 64


@dataclass(frozen=True)
class Timing:
    line_rate_gbps: float = 100.0
    step_latency_ns: int = 4_000     # between ring steps (GPU kernel + proxy)
    compute_gap_ns: int = 2_000_000  # forward/backward before the first bucket's allreduce
    ack_delay_ns: int = 800
    rtt_ns: int = 6_000

    def ns(self, nbytes) -> np.ndarray:
        return (np.asarray(nbytes, dtype=np.float64) * 8 / self.line_rate_gbps).astype(np.int64)


@dataclass
class LinkFaults:
    """Training-link faults: each packet is lost (after the mirrors) or corrupted (before
    them) with these probabilities; either makes the receiver NAK and the sender resend."""

    loss: float = 0.0
    corrupt: float = 0.0


@dataclass
class ConnectionState:
    """What carries over between iterations on the wire (NCCL's counters and the QPs')."""

    step_base: np.ndarray           # [channel, position] FIFO step at the iteration's start
    fifo_base: np.ndarray           # [channel, position] CTS index base
    psn_base: np.ndarray            # [flow] PSN of the flow's first packet this iteration
    msn: np.ndarray                 # [flow] responder message sequence number
    buffer_va: np.ndarray           # [channel, position] receive buffer of each connection
    fifo_va: np.ndarray             # [channel, position] sender's CTS fifo
    rkeys: np.ndarray               # [channel, position, 2] data and fifo rkeys

    @classmethod
    def initial(cls, plan: WirePlan, rng: np.random.Generator) -> "ConnectionState":
        nch, n = plan.steps_per_iteration.shape
        page = rng.integers(0x7F0000000, 0x7FF000000, size=(nch, n), dtype=np.int64) << 12
        # A connection's counter counts from its setup. Where the steps depend on its phase
        # (Simple calls after LL/LL128 ones), start it anywhere, as earlier calls leave it.
        start = rng.integers(0, 64, size=(nch, n)) if plan.step_phases > 1 else np.zeros((nch, n), np.int64)
        return cls(
            step_base=start.astype(np.int64),
            fifo_base=np.zeros((nch, n), np.int64),
            # Some flows start close to 2^24 so PSN wrap-around occurs in short runs.
            psn_base=rng.integers(PSN_MODULUS - 4096, PSN_MODULUS + 4096, size=len(plan.flows)) % PSN_MODULUS,
            msn=np.zeros(len(plan.flows), np.int64),
            buffer_va=page,
            fifo_va=page + (1 << 28),
            rkeys=rng.integers(1, 1 << 32, size=(nch, n, 2), dtype=np.int64),
        )

    def steps(self, plan: WirePlan, index: np.ndarray) -> np.ndarray:
        """The absolute FIFO step of plan messages ``index`` in this iteration."""
        m = plan.messages[index]
        base = self.step_base[m["channel"], senders(m, plan.flows)]
        return base + plan.phase_steps[base % plan.step_phases, index]

    def advance(self, plan: WirePlan) -> None:
        nch, n = self.step_base.shape
        phase = self.step_base % plan.step_phases
        self.step_base += plan.phase_period[phase, np.arange(nch)[:, None], np.arange(n)[None, :]]
        self.fifo_base += plan.fifo_per_iteration
        self.psn_base = psn_add(self.psn_base, plan.flows["npkts"])
        self.msn = (self.msn + plan.flows["msg_count"]) % aeth.MSN_MODULUS


@dataclass
class IterationTraffic:
    """Packets of one iteration, ordered by time, with the ring positions of each end."""

    packets: np.ndarray                      # PACKET_DTYPE
    src: np.ndarray                          # int16 ring position of the sender (-1: outside the ring)
    dst: np.ndarray
    arena: np.ndarray                        # uint8 payload bytes (the builder's buffer: see TrafficBuilder)
    end_ns: int
    injected: dict[str, int] = field(default_factory=dict)


class TrafficBuilder:
    """Turns the plan plus one iteration's ring values into packets.

    The payloads of a build go into one of ``arenas`` buffers, used in turn: a build's
    ``arena`` stays valid until ``arenas`` more builds have run (2 lets its frames be
    written while the next bucket is built).
    """

    def __init__(self, job: JobSpec, plan: WirePlan, routes: Routes, timing: Timing, faults: LinkFaults,
                 rng: np.random.Generator, egress: set[int], ingress: set[int], arenas: int = 1):
        if arenas < 1:
            raise ValueError(f"arenas = {arenas}; must be at least 1")
        self.job, self.plan, self.routes, self.timing, self.faults, self.rng = job, plan, routes, timing, faults, rng
        # Per protocol (indexed by Protocol): a FIFO slot, the receive size a CTS announces, and
        # where its buffer lies in a connection's receive memory.
        self.step_bytes, self.slot_bytes = plan.by_protocol("step_bytes"), plan.by_protocol("slot_bytes")
        self.buffer_offset = np.array([N.recv_buffer_offset(job.nccl, p) for p in Protocol], np.int64)
        ranks = job.ring.ranks
        f = plan.flows
        self.flow_route = np.array([routes.add(ranks[s].mac, ranks[d].mac, ranks[s].ip, ranks[d].ip, int(sp))
                                    for s, d, sp in zip(f["src"], f["dst"], f["udp_sport"])], np.int32)
        self.ack_route = np.array([routes.add(ranks[d].mac, ranks[s].mac, ranks[d].ip, ranks[s].ip, int(sp))
                                   for s, d, sp in zip(f["src"], f["dst"], f["udp_sport"])], np.int32)
        # Only what some mirror captures is built: a flow's writes when its sender's egress or
        # its receiver's ingress is mirrored; its ACKs when the reverse holds. Payloads are
        # encoded only for the first kind.
        src_e, dst_i = np.isin(f["src"], list(egress)), np.isin(f["dst"], list(ingress))
        self.payload_flows = src_e | dst_i
        self.ack_flows = np.isin(f["dst"], list(egress)) | np.isin(f["src"], list(ingress))
        self._arena_buffers = [np.zeros(0, np.uint8) for _ in range(arenas)]
        self._builds = 0

    # -- payloads ---------------------------------------------------------------------
    def _arena(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of this build's payload arena: the next of the buffers reused in turn
        (each grown to the largest), so their pages fault in once per run, not per bucket."""
        k = self._builds % len(self._arena_buffers)
        self._builds += 1
        if len(self._arena_buffers[k]) < nbytes:
            self._arena_buffers[k] = np.empty(nbytes, np.uint8)
        return self._arena_buffers[k][:nbytes]

    def _payloads(self, msgs: np.ndarray, steps: np.ndarray, partials: np.ndarray,
                  cts: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Encode every send once, and the CTS writes' payloads (``cts``, the era's records)
        after them, into the arena; returns ``(arena, start, cts_at)``: ``start`` is each
        write's arena offset of its send's bytes (-1: none), ``cts_at`` where ``cts`` begins."""
        n = self.plan.world_size
        start = np.full(len(msgs), -1, np.int64)
        cache: dict[tuple, int] = {}
        sends = []          # (row, first byte, bytes, protocol, flag, arena offset)
        total = 0
        flows = self.plan.flows
        for i, m in enumerate(msgs):
            if m["kind"] != DATA or m["msg_bytes"] == 0 or not self.payload_flows[m["flow"]]:
                continue
            # Parts of one send (split over QPs, or adaptive routing's two writes) share it.
            src = flows["src"][m["flow"]]
            key = (int(m["bucket"]), int(m["channel"]), int(src), int(m["step"]))
            if key in cache:
                start[i] = cache[key]
                continue
            row = partials[min(int(m["ring_step"]), n - 1)]
            protocol = Protocol(int(m["protocol"]))
            lo, count = int(m["elem_offset"]), int(m["nelem"])
            size = wire_size(protocol, count * row.itemsize)
            sends.append((row, lo, count, protocol, int(steps[i] + 1), total, size))
            cache[key] = start[i] = total
            total += -(-size // ARENA_ALIGN) * ARENA_ALIGN
        cts_bytes = cts.view(np.uint8).reshape(-1)
        arena = self._arena(total + len(cts_bytes))
        for row, lo, count, protocol, flag, at, size in sends:
            encode(protocol, row[lo:lo + count].view(np.uint8), flag, out=arena[at:at + size])
        arena[total:] = cts_bytes
        return arena, start, total

    def _cts_payloads(self, msgs: np.ndarray, steps: np.ndarray, state: ConnectionState) -> np.ndarray:
        """The era's ncclIbSendFifo of each CTS write (docs/wire-format.md, "NCCL eras")."""
        era = N.era_facts(self.job.nccl)
        cts = np.zeros(len(msgs), dtype=era.cts_dtype)
        sender = self.plan.flows["dst"][msgs["flow"]]
        c = msgs["channel"]
        slot = steps % N.NCCL_STEPS
        proto = msgs["protocol"]
        cts["addr"] = state.buffer_va[c, sender] + self.buffer_offset[proto] + slot * self.step_bytes[proto]
        cts["size"] = self.slot_bytes[proto]
        rkey = "rkey" if "rkey" in cts.dtype.names else "rkeys"
        if cts.dtype[rkey].shape:
            cts[rkey][:, 0] = state.rkeys[c, sender, 0]     # one device: the first of the per-device rkeys
        else:
            cts[rkey] = state.rkeys[c, sender, 0]
        cts["nreqs"] = 1
        cts["tag"] = sender
        cts["idx"] = state.fifo_base[c, sender] + msgs["fifo_seq"] + 1
        return cts

    # -- timing -------------------------------------------------------------------------
    def _write_times(self, msgs: np.ndarray, t0: int) -> tuple[np.ndarray, int]:
        """Start time of every write: ring steps run in lockstep; each sender's link carries
        the writes of one step back to back at line rate."""
        t = self.timing
        data = msgs["kind"] == DATA
        group = np.stack([msgs["bucket"], msgs["loop"], msgs["ring_step"]], axis=1)
        keys, gid = np.unique(group, axis=0, return_inverse=True)
        sender = self.plan.flows["src"][msgs["flow"]]
        nbytes = (msgs["wire_bytes"] + msgs["npkts"] * HEADER_OVERHEAD) * data
        # Per (group, sender) serialisation in plan order: bytes sent before each write.
        order = np.lexsort((np.arange(len(msgs)), sender, gid))
        key = gid[order] * (self.plan.world_size + 1) + sender[order]
        nb = nbytes[order]
        inclusive = np.cumsum(nb)
        first = np.r_[True, key[1:] != key[:-1]]
        head = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
        inclusive -= inclusive[head] - nb[head]
        before = np.zeros(len(msgs), np.int64)
        before[order] = inclusive - nb
        per_group = np.zeros(len(keys), np.int64)
        np.maximum.at(per_group, gid[order], inclusive)
        durations = t.ns(per_group) + t.step_latency_ns
        starts = t0 + np.concatenate([[0], np.cumsum(durations)[:-1]])
        ts = starts[gid] + t.ns(before)
        cts = ~data
        ts[cts] = starts[gid[cts]] - t.rtt_ns // 2   # receivers post CTS ahead of the data
        return ts, int(starts[-1] + durations[-1]) if len(keys) else t0

    # -- packets ------------------------------------------------------------------------
    def build(self, bucket: int, partials: np.ndarray, state: ConnectionState, t0: int) -> IterationTraffic:
        """The packets of one bucket's allreduce, starting at ``t0``; ``partials`` are the
        ring values of the bucket (row s: sent at reduce-scatter step s; row n-1: final)."""
        plan, mtu = self.plan, self.plan.mtu
        pm = plan.messages
        wanted = (self.payload_flows | self.ack_flows)[pm["flow"]] & (pm["bucket"] == bucket)
        index = np.flatnonzero(wanted)
        msgs = pm[index]
        steps = state.steps(plan, index)
        is_cts = msgs["kind"] == CTS
        cts = self._cts_payloads(msgs[is_cts], steps[is_cts], state)
        arena, payload, cts_at = self._payloads(msgs, steps, partials, cts)
        payload[is_cts] = cts_at + np.arange(len(cts), dtype=np.int64) * cts.dtype.itemsize
        ts, end = self._write_times(msgs, t0)

        # Writes -> packets.
        npk = msgs["npkts"].astype(np.int64)
        w = np.repeat(np.arange(len(msgs)), npk)
        k = np.arange(len(w)) - np.repeat(np.cumsum(npk) - npk, npk)
        m = msgs[w]
        last = k == npk[w] - 1
        pk = np.zeros(len(w), PACKET_DTYPE)
        pk["route"] = self.flow_route[m["flow"]]
        pk["opcode"] = _write_opcodes(k, npk[w], m["imm"] == 1)
        pk["ackreq"] = last
        pk["dest_qpn"] = plan.flows["dst_qpn"][m["flow"]]
        pk["psn"] = psn_add(state.psn_base[m["flow"]], m["psn_offset"] + k)
        src = plan.flows["src"][m["flow"]]
        dst = plan.flows["dst"][m["flow"]]
        c = m["channel"]
        proto = m["protocol"]
        data_va = state.buffer_va[c, src] + self.buffer_offset[proto] \
            + (steps[w] % N.NCCL_STEPS) * self.step_bytes[proto] + m["part_offset"]
        stride = N.era_facts(self.job.nccl).cts_slot_stride
        cts_va = state.fifo_va[c, dst] + ((state.fifo_base[c, dst] + m["fifo_seq"]) % N.CTS_SLOTS) * stride
        pk["reth_va"] = np.where(m["kind"] == CTS, cts_va, np.where(m["remote_offset"] == NO_VA, 0, data_va))
        # Adaptive routing's closing zero-length write has VA 0 and R_Key 0 (a zeroed work request).
        pk["reth_rkey"] = np.where(m["kind"] == CTS, state.rkeys[c, dst, 1],
                                   np.where(m["remote_offset"] == NO_VA, 0, state.rkeys[c, src, 0]))
        pk["reth_len"] = m["wire_bytes"]
        imm = np.where(self._imm_big_endian(), m["msg_bytes"], _bswap32(m["msg_bytes"]))
        pk["imm"] = np.where(m["kind"] == CTS, 0, imm)
        pk["payload_off"] = payload[w] + m["part_offset"] + k * mtu
        pk["payload_len"] = np.minimum(mtu, m["wire_bytes"] - k * mtu).clip(0)
        pk["ts_ns"] = ts[w] + self.timing.ns(k * (mtu + HEADER_OVERHEAD))
        psrc, pdst = src.astype(np.int16), dst.astype(np.int16)

        # Receiver ACKs, one per write (coalescing is the responder's choice).
        lp = np.flatnonzero(last)
        acks = np.zeros(len(lp), PACKET_DTYPE)
        acks["route"] = self.ack_route[m["flow"][lp]]
        acks["opcode"] = op.RC_ACKNOWLEDGE
        acks["dest_qpn"] = plan.flows["src_qpn"][m["flow"][lp]]
        acks["psn"] = pk["psn"][lp]
        in_flow = index[w[lp]] - plan.flows["msg_start"][m["flow"][lp]]
        acks["aeth"] = aeth.word(ACK_SYNDROME, state.msn[m["flow"][lp]] + in_flow + 1)
        acks["ts_ns"] = pk["ts_ns"][lp] + self.timing.ack_delay_ns
        extra, esrc, edst, ekeep, injected = self._retransmissions(pk, psrc, pdst, w, k, npk, m)
        packets = np.concatenate([pk, acks, extra])
        src_all = np.concatenate([psrc, pdst[lp], esrc])
        dst_all = np.concatenate([pdst, psrc[lp], edst])
        # Writes of flows no mirror captures were built only for their ACKs and NAKs.
        keep = np.concatenate([self.payload_flows[m["flow"]], np.ones(len(lp), bool), ekeep])
        order = np.flatnonzero(keep)[np.argsort(packets["ts_ns"][keep], kind="stable")]
        return IterationTraffic(packets[order], src_all[order], dst_all[order], arena,
                                max(end, int(packets["ts_ns"].max(initial=t0))), injected)

    def _imm_big_endian(self) -> bool:
        return N.era_facts(self.job.nccl).imm_big_endian

    def _retransmissions(self, pk, psrc, pdst, w, k, npk, m):
        """Training-link faults: the chosen packets are lost after the mirrors or corrupted
        before them; the receiver NAKs and the sender goes back to that PSN and resends the
        rest of the write. Only data and CTS writes are affected, not ACKs."""
        f = self.faults
        p = f.loss + f.corrupt
        empty = np.zeros(0, PACKET_DTYPE), np.zeros(0, np.int16), np.zeros(0, np.int16), np.zeros(0, bool)
        if p <= 0 or not len(pk):
            return (*empty, {"link_loss": 0, "link_corrupt": 0, "retransmitted": 0})
        hit = np.flatnonzero(self.rng.random(len(pk)) < p)
        corrupt = self.rng.random(len(hit)) < f.corrupt / p
        pk["corrupt"][hit[corrupt]] = 1
        out, srcs, dsts, keep = [], [], [], []
        rtt = self.timing.rtt_ns
        for i, bad in zip(hit, corrupt):
            rest = np.arange(i, i + npk[w[i]] - k[i])        # from the lost packet to the write's end
            again = pk[rest].copy()
            again["corrupt"] = 0
            again["ts_ns"] = pk["ts_ns"][rest[-1]] + rtt + self.timing.ns((rest - i + 1) * 1100)
            nak = np.zeros(1, PACKET_DTYPE)
            nak["route"] = self.ack_route[m["flow"][i]]
            nak["opcode"] = op.RC_ACKNOWLEDGE
            nak["dest_qpn"] = self.plan.flows["src_qpn"][m["flow"][i]]
            nak["psn"] = pk["psn"][i]
            nak["aeth"] = aeth.word(NAK_SEQ_ERR_SYNDROME, 0)
            nak["ts_ns"] = pk["ts_ns"][rest[-1]] + rtt // 2
            out += [nak, again]
            srcs += [pdst[i:i + 1], psrc[rest]]
            dsts += [psrc[i:i + 1], pdst[rest]]
            keep += [np.ones(1, bool), np.full(len(rest), self.payload_flows[m["flow"][i]])]
        stats = {"link_loss": int((~corrupt).sum()), "link_corrupt": int(corrupt.sum()),
                 "retransmitted": int(sum(len(x) for x in out[1::2]))}
        if not out:
            return (*empty, stats)
        return np.concatenate(out), np.concatenate(srcs), np.concatenate(dsts), np.concatenate(keep), stats


def _write_opcodes(k: np.ndarray, npkts: np.ndarray, imm: np.ndarray) -> np.ndarray:
    only = npkts == 1
    first = (k == 0) & ~only
    last = (k == npkts - 1) & ~only
    out = np.full(len(k), op.RC_RDMA_WRITE_MIDDLE, np.uint8)
    out[first] = op.RC_RDMA_WRITE_FIRST
    out[last] = np.where(imm[last], op.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, op.RC_RDMA_WRITE_LAST)
    out[only] = np.where(imm[only], op.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, op.RC_RDMA_WRITE_ONLY)
    return out


def _bswap32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.uint32).byteswap()
