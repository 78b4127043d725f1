"""Slow twin of the stream parser's coverage: which allgather units a capture delivers.

Frames are decoded by ``tests/naive.py`` and placed by their PSN relative to their flow's
first PSN (given) and the plan's ``psn_offset``, exactly as the wire plan defines positions
(:func:`positions`); a data packet that passes its ICRC marks the units of the coverage block
it carries (:func:`coverage`). :func:`bad_icrcs` splits the frames whose ICRC fails by phase.
"""

from __future__ import annotations

import numpy as np

from tests import naive
from gradtap.wire.protocol import Protocol
from gradtap.wire.psn import PSN_MODULUS
from gradtap.workload.wire_plan import DATA, PHASE_AG


def first_psns(path, job, plan) -> dict[int, int]:
    """PSN of the first data packet of every plan flow in a capture (of those with a good ICRC)."""
    ranks = {r.ip: i for i, r in enumerate(job.ring.ranks)}
    out: dict[int, int] = {}
    for _, frame in naive.read_capture(path):
        f, _ = naive.decode_frame(frame)
        if f is None or not f["icrc_ok"] or not 0x06 <= f["opcode"] <= 0x0B or f["ip_src"] not in ranks or \
                f["ip_dst"] not in ranks:
            continue
        flow = _flow(plan, ranks[f["ip_src"]], ranks[f["ip_dst"]], f["dest_qp"])
        if flow is not None:
            out.setdefault(flow, f["psn"])
    return out


def _flow(plan, src, dst, qp):
    fl = plan.flows
    hit = np.flatnonzero((fl["src"] == src) & (fl["dst"] == dst) & (fl["dst_qpn"] == qp) & (fl["kind"] == DATA))
    return int(hit[0]) if len(hit) else None


def positions(path, job, plan, first: dict[int, int]):
    """Each frame of ``path`` with where the plan puts it: ``(frame, decoded, placed)``, where
    ``decoded`` is ``tests/naive.py``'s decoding (None: not a RoCEv2 frame) and ``placed`` is
    ``(iteration, write, packet of the write)`` for a data write of a plan flow, by its PSN
    relative to the flow's first (``first``), else None."""
    ranks = {r.ip: i for i, r in enumerate(job.ring.ranks)}
    for _, frame in naive.read_capture(path):
        f, _ = naive.decode_frame(frame)
        placed = None
        if f is not None and 0x06 <= f["opcode"] <= 0x0B and f["ip_src"] in ranks and f["ip_dst"] in ranks:
            flow = _flow(plan, ranks[f["ip_src"]], ranks[f["ip_dst"]], f["dest_qp"])
            if flow is not None and flow in first:
                it, pos = divmod((f["psn"] - first[flow]) % PSN_MODULUS, int(plan.flows["npkts"][flow]))
                msgs = plan.flow_messages(flow)
                w = msgs[np.searchsorted(msgs["psn_offset"], pos, side="right") - 1]
                placed = it, w, pos - int(w["psn_offset"])
        yield frame, f, placed


def coverage(path, job, plan, first: dict[int, int], iterations: int) -> list[np.ndarray]:
    """Per iteration, the covered mask of every block, from the frames of ``path``."""
    got = [np.zeros(len(plan.blocks), np.int64) for _ in range(iterations)]
    for _, f, placed in positions(path, job, plan, first):
        if placed is None or not f["icrc_ok"]:
            continue
        it, w, k = placed
        if it >= iterations or w["phase"] != PHASE_AG or w["block"] < 0:
            continue
        wire = int(w["part_offset"]) + k * plan.mtu
        if len(f["payload"]) != min(plan.mtu, int(w["wire_bytes"]) - k * plan.mtu):
            continue
        if plan.protocols[int(w["bucket"])] == Protocol.LL128:
            for line in range(wire // 128, (wire + len(f["payload"])) // 128):
                got[it][int(w["block"]) + line // 16] |= 1 << (line % 16)
        else:
            got[it][int(w["block"]) + k] |= 1
    need = plan.blocks["need"]
    return [(g & need) == need for g in got]


def bad_icrcs(path, job, plan, first: dict[int, int]) -> tuple[int, int]:
    """The frames of ``path`` whose ICRC is wrong: how many the plan puts in the reduce-scatter
    phase, and how many others."""
    scattered = others = 0
    for _, f, placed in positions(path, job, plan, first):
        if f is not None and not f["icrc_ok"]:
            if placed is not None and placed[1]["phase"] != PHASE_AG:
                scattered += 1
            else:
                others += 1
    return scattered, others
