"""Where each rank sits and how the DP groups' rings run.

Global ranks fill the GPUs in listing order: rank 0 is GPU 0 of the first GPU node, and so
on. A global rank splits into (tp, dp, pp) coordinates by ``layout.order``, fastest-varying
axis first; Megatron-LM's default ``tp-dp-pp`` gives ``rank = tp + TP*(dp + DP*pp)``.

A DP group is the set of ranks sharing (tp, pp); its allreduce runs over a ring of its DP
ranks. NCCL orders that ring by rank: ``connectRings`` (``src/graph/connect.cc``, v2.19.3-1)
chains the nodes in node order, and nodes are numbered in the order of their first rank,
so for one GPU per node and DP group, ring position = DP rank. ``layout.ring_order`` and
``layout.ring_order_by_group`` override that when a job's rings differ (``NCCL_RINGS``,
topology files, several GPUs of one group in a node).
"""

from __future__ import annotations

from dataclasses import dataclass

from gradtap.netconfig.topology import Topology


@dataclass(frozen=True)
class Seat:
    """One rank's GPU and the leaf-switch port its NIC is cabled to."""

    global_rank: int
    node: str
    nic: str
    switch: str
    port: str
    speed_gbps: float


@dataclass(frozen=True)
class DpGroup:
    """One data-parallel group; ``seats[i]`` and ``dp_ranks[i]`` belong to ring position i."""

    id: str
    tp: int
    pp: int
    dp_ranks: tuple[int, ...]
    seats: tuple[Seat, ...]

    @property
    def size(self) -> int:
        return len(self.seats)

    def hop_on_network(self, hop: int) -> bool:
        """Does ring hop ``hop`` -> ``hop+1`` leave the node, i.e. cross the sender's NIC?"""
        return self.seats[hop].node != self.seats[(hop + 1) % self.size].node


def group_id(tp: int, pp: int) -> str:
    return f"tp{tp}-pp{pp}"


def seats(topo: Topology) -> list[Seat]:
    """Seats indexed by global rank."""
    speed = {(sw.name, p.name): p.speed_gbps for sw in topo.leaf_switches for p in sw.ports}
    gpus = [(node.name, gpu) for node in topo.gpu_nodes for gpu in node.gpus]
    return [Seat(rank, node, gpu.nic, gpu.switch, gpu.port, speed[gpu.switch, gpu.port])
            for rank, (node, gpu) in enumerate(gpus)]


def global_rank(topo: Topology, tp: int, dp: int, pp: int) -> int:
    layout = topo.layout
    coords = {"tp": tp, "dp": dp, "pp": pp}
    sizes = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp}
    rank, stride = 0, 1
    for axis in layout.order:
        rank += coords[axis] * stride
        stride *= sizes[axis]
    return rank


def dp_groups(topo: Topology) -> list[DpGroup]:
    """Every DP group, ordered by (pp, tp), each with its ring in ring-position order."""
    layout = topo.layout
    by_rank = seats(topo)
    groups = []
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            gid = group_id(tp, pp)
            order = layout.ring_order_by_group.get(gid, layout.ring_order) or list(range(layout.dp))
            ring = tuple(by_rank[global_rank(topo, tp, dp, pp)] for dp in order)
            groups.append(DpGroup(gid, tp, pp, tuple(order), ring))
    return groups
