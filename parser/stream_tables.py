"""What one mirror stream must know of the wire plan, as one record of arrays for the kernels.

A stream (a rank's port, one or both directions) sees a subset of the plan's flows. Each is
identified on the wire by its destination QPN and its source and destination addresses; the
QPNs are learnt from the traffic at lock-on (``parser/flow_learning.py``), so they start as
``UNKNOWN_QPN`` and the spec's QPNs, when it gives them, are only hints.
Per flow the kernel needs the slice of ``plan.messages`` it posts, its packets per
iteration (the PSN period), and where its packets sit in the stream's per-iteration
"seen" bitmap; per connection (channel, sender) the FIFO steps per iteration.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

import numpy as np

from gradtap.workload import nccl
from gradtap.workload.spec import JobSpec, MirrorSpec
from gradtap.workload.wire_plan import DATA, WirePlan, senders


UNKNOWN_QPN = 1 << 24       # equals no 24-bit destination QPN: a flow not learnt yet


def ip16(address: str) -> np.ndarray:
    """16-byte form of an address: IPv6 as is, IPv4 as ``::ffff:a.b.c.d`` (as stage 1 stores it)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
    return np.frombuffer(ip.packed, np.uint8).copy()


class StreamTables(NamedTuple):
    """Flows of one stream (index ``f``), its connections (index ``c``) and the plan facts
    the assembly kernel reads; a NamedTuple so the kernel takes it whole."""

    qpn: np.ndarray            # uint32[F]: destination QPN on the wire (UNKNOWN_QPN until learnt)
    qpn_hint: np.ndarray       # int64[F]: the QPN the spec's qpn_base implies (-1: none given)
    src: np.ndarray            # int64[F]: ring position of the sender
    dst: np.ndarray            # int64[F]: ring position of the receiver
    channel: np.ndarray        # int64[F]
    qp_index: np.ndarray       # int64[F]: QP within the connection
    src_ip: np.ndarray         # uint8[F, 16]
    dst_ip: np.ndarray         # uint8[F, 16]
    is_data: np.ndarray        # bool[F]: data flow (else CTS)
    period: np.ndarray         # int64[F]: packets per iteration (PSN period)
    msg_start: np.ndarray      # int64[F]: first message in plan.messages
    msg_count: np.ndarray      # int64[F]
    seen_base: np.ndarray      # int64[F]: first bit of the flow in the seen bitmap (data flows)
    conn: np.ndarray           # int64[F]: connection index channel * n + sender position
    phase_steps: np.ndarray    # int64[Q, M]: plan.phase_steps (a message's step, by the counter's phase)
    phase_period: np.ndarray   # int64[Q, C]: FIFO steps of each connection's iteration, by phase (C connections)
    phased: np.ndarray         # bool[C]: the connection's steps depend on the phase
    messages: np.ndarray       # MESSAGE_DTYPE[M]: plan.messages
    bucket_offsets: np.ndarray  # int64[buckets]: first element of each bucket in the flat gradient
    elem: int                  # bytes per element on the wire
    mtu: int                   # payload bytes per full packet
    step_bytes: np.ndarray     # int64[3]: bytes of one FIFO slot, by Protocol (0: a protocol the job does not use)
    imm_big_endian: bool       # ImmDt carries the message size big-endian (else NCCL's little-endian)
    seen_bits: int             # packets of all data flows per iteration
    grad_bytes: int            # bytes of the whole flat gradient in the wire dtype

    @property
    def data_flows(self) -> np.ndarray:
        return np.flatnonzero(self.is_data)

    def label(self, f: int) -> str:
        """A planned flow as an operator names it, e.g. ``rank 0->1 channel 1 QP 0 data``."""
        what = f"QP {int(self.qp_index[f])} data" if self.is_data[f] else "CTS"
        return f"rank {int(self.src[f])}->{int(self.dst[f])} channel {int(self.channel[f])} {what}"


def _phased(plan: WirePlan) -> np.ndarray:
    """Per connection (channel * n + sender): whether its steps differ between phases."""
    m = plan.messages
    conn = m["channel"].astype(np.int64) * plan.world_size + senders(m, plan.flows)
    differs = (plan.phase_steps != plan.phase_steps[0]).any(axis=0)
    out = (plan.phase_period != plan.phase_period[0]).any(axis=0).reshape(-1)
    out[np.unique(conn[differs])] = True
    return out


def stream_tables(job: JobSpec, plan: WirePlan, mirror: MirrorSpec) -> StreamTables:
    flows = plan.flows_of(mirror.rank, mirror.direction)
    f = plan.flows[flows]
    ranks = job.ring.ranks
    is_data = f["kind"] == DATA
    seen_base = np.zeros(len(flows), np.int64)
    seen_base[is_data] = np.concatenate([[0], np.cumsum(f["npkts"][is_data])[:-1]]) if is_data.any() else []
    n = plan.world_size
    hinted = np.array([ranks[d].qpn_base is not None for d in f["dst"]], bool)
    return StreamTables(
        qpn=np.full(len(flows), UNKNOWN_QPN, np.uint32),
        qpn_hint=np.where(hinted, f["dst_qpn"], -1).astype(np.int64),
        src=f["src"].astype(np.int64),
        dst=f["dst"].astype(np.int64),
        channel=f["channel"].astype(np.int64),
        qp_index=f["qp"].astype(np.int64),
        src_ip=np.stack([ip16(ranks[s].ip) for s in f["src"]]) if len(f) else np.zeros((0, 16), np.uint8),
        dst_ip=np.stack([ip16(ranks[d].ip) for d in f["dst"]]) if len(f) else np.zeros((0, 16), np.uint8),
        is_data=is_data,
        period=f["npkts"].astype(np.int64),
        msg_start=f["msg_start"].astype(np.int64),
        msg_count=f["msg_count"].astype(np.int64),
        seen_base=seen_base,
        conn=(f["channel"].astype(np.int64) * n + f["src"]),
        phase_steps=plan.phase_steps.astype(np.int64),
        phase_period=plan.phase_period.reshape(plan.step_phases, -1).astype(np.int64),
        phased=_phased(plan),
        messages=plan.messages,
        bucket_offsets=np.asarray(plan.bucket_offsets, np.int64),
        elem=plan.elem_size,
        mtu=plan.mtu,
        step_bytes=plan.by_protocol("step_bytes"),
        imm_big_endian=nccl.era_facts(job.nccl).imm_big_endian,
        seen_bits=int(f["npkts"][is_data].sum()),
        grad_bytes=plan.grad_bytes,
    )
