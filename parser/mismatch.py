"""What in the job spec the traffic contradicts, when a stream cannot lock on.

Flow learning (``parser/flow_learning.py``) fails quietly in one sense: it can say that no wire
flow fits the plan, not why. An operator needs the field of the job spec to fix. When a stream
has not locked, :func:`what_differs` looks, in order, at

1. **addresses**: RDMA WRITEs seen only between other hosts (or in the wrong direction) name
   the ring order, a rank missing from ``ring.ranks``, or the IP version;
2. **the path MTU**: the payload of a WRITE_FIRST or WRITE_MIDDLE is the MTU, whatever the
   write sizes;
3. **one field changed**: the job's plan rebuilt with one of ``nccl.protocol``,
   ``nccl.channels``, ``nccl.qps_per_connection``, ``ddp.grad_dtype`` or ``ddp.layout``
   changed, kept when its data write sizes are what the wire flows between the stream's
   ranks show (each planned data flow has a wire flow whose every write size it posts).

It returns one sentence for the operator, or None when nothing stands out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import numpy as np

from gradtap.core.errors import GradtapError
from gradtap.parser.flow_learning import FlowLearner
from gradtap.parser.stream_tables import stream_tables
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import JobSpec, MirrorSpec


def what_differs(job: JobSpec, mirror: MirrorSpec, learner: FlowLearner) -> str | None:
    """The job spec's field the stream's traffic contradicts, in words (see the module docstring)."""
    return _addresses(job, learner) or _mtu(job, learner) or _one_field(job, mirror, learner)


def _ip(raw: bytes) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A record's 16-byte address (IPv4 as ``::ffff:a.b.c.d``)."""
    v6 = ipaddress.IPv6Address(raw)
    return v6.ipv4_mapped or v6


def _addresses(job: JobSpec, learner: FlowLearner) -> str | None:
    if learner.wire or not learner.strangers:
        return None
    ranks = [ipaddress.ip_address(str(r.ip)) for r in job.ring.ranks]
    n = len(ranks)
    (src, dst), _ = learner.strangers.most_common(1)[0]
    a, b = _ip(src), _ip(dst)
    if a in ranks and b in ranks:
        i, j = ranks.index(a), ranks.index(b)
        return (f"the RDMA WRITEs go from ring.ranks[{i}] ({a}) to ring.ranks[{j}] ({b}), but in the job's ring "
                f"ranks[{i}] sends to ranks[{(i + 1) % n}] ({ranks[(i + 1) % n]}): the ring order (ring.ranks) "
                f"or the mirror's rank and direction differ from the traffic's")
    if a in ranks or b in ranks:
        known, other = (a, b) if a in ranks else (b, a)
        return (f"ring.ranks[{ranks.index(known)}] ({known}) exchanges RDMA WRITEs with {other}, which is not in "
                f"ring.ranks: the job has fewer ranks than the traffic, or other addresses")
    if a.version != ranks[0].version:
        return (f"the stream's RDMA WRITEs are over IPv{a.version} ({a} -> {b}); the job's ranks are "
                f"IPv{ranks[0].version} (ring.ranks[].ip)")
    return f"the stream's RDMA WRITEs are between {a} -> {b}, none of the job's ranks (ring.ranks[].ip)"


def _mtu(job: JobSpec, learner: FlowLearner) -> str | None:
    seen = {w.packet_bytes for w in learner.wire.values() if w.data and w.packet_bytes}
    if not seen or job.nccl.mtu in seen:
        return None
    return (f"the job's RDMA WRITE packets carry {', '.join(str(v) for v in sorted(seen))}-byte payloads (the "
            f"path MTU); nccl.mtu is {job.nccl.mtu}")


def _variants(job: JobSpec) -> Iterator[tuple[str, JobSpec]]:
    """The job with one field changed, named as the operator would set it."""
    nccl, ddp = job.nccl, job.ddp
    # With one protocol per bucket given, nccl.protocol is not what the buckets travel in.
    changes = [("nccl", "protocol", v) for v in ("Simple", "LL", "LL128")
               if v != nccl.protocol and nccl.protocols is None]
    changes += [("nccl", "channels", v) for v in (1, 2, 4, 8, 16, 32) if v != nccl.channels]
    changes += [("nccl", "qps_per_connection", v) for v in (1, 2, 4) if v != nccl.qps_per_connection]
    changes += [("ddp", "grad_dtype", v) for v in ("fp32", "bf16", "fp16") if v != ddp.grad_dtype]
    changes += [("ddp", "layout", v) for v in ("initial", "rebuilt") if v != ddp.layout and ddp.layout != "explicit"]
    for section, name, value in changes:
        part = getattr(job, section)
        yield f"{section}.{name} {value} (the job says {getattr(part, name)})", \
            job.model_copy(update={section: part.model_copy(update={name: value})})


def _fits(job: JobSpec, mirror: MirrorSpec, learner: FlowLearner) -> bool:
    """Every planned data flow of the stream has a wire flow between its ranks whose write
    sizes are all sizes it posts."""
    try:
        t = stream_tables(job, job_plan(job), mirror)
    except (GradtapError, ValueError):
        return False
    ends = np.concatenate([t.src_ip, t.dst_ip], axis=1)
    for pair in np.unique(ends[t.is_data], axis=0):
        flows = np.flatnonzero(t.is_data & (ends == pair).all(axis=1))
        sizes = set()
        for f in flows.tolist():
            sizes |= set(t.messages["wire_bytes"][t.msg_start[f]:t.msg_start[f] + t.msg_count[f]].tolist())
        p = np.flatnonzero((learner.pairs == pair).all(axis=1))
        wires = [w for w in learner.wire.values() if len(p) and w.pair == p[0] and w.data and w.lengths]
        if sum(set(w.lengths) <= sizes for w in wires) < len(flows):
            return False
    return True


def _one_field(job: JobSpec, mirror: MirrorSpec, learner: FlowLearner) -> str | None:
    if not any(w.data and w.lengths for w in learner.wire.values()) or _fits(job, mirror, learner):
        return None
    fitting = [what for what, variant in _variants(job) if _fits(variant, mirror, learner)]
    if not fitting:
        return ("no one change of nccl.protocol, nccl.channels, nccl.qps_per_connection, ddp.grad_dtype or "
                "ddp.layout explains the write sizes: check the world size (ring.ranks) and the model")
    return f"the write sizes on the wire are the job's plan with {', or with '.join(fitting)}"
