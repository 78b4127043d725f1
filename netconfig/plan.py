"""A mirror plan: which ports and directions are mirrored to which CPU-node port.

The plan is the contract between ``gradtap netconfig plan`` and everything after it
(``render``, ``apply``, ``teardown``, and the appliances' job specs). It is vendor-neutral
JSON: switch sessions are grouped per vendor only when rendering.

Directions are always seen from the GPU NIC (``egress`` = frames the NIC transmits);
renderers translate them to the switch port's view, where they are reversed
(NIC egress = switch-port RX).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, model_validator

from gradtap.core.errors import ConfigError
from gradtap.netconfig.cost import CostModel
from gradtap.netconfig.hardware import Vendor
from gradtap.netconfig.ring import chunk_coverage, stream_hops
from gradtap.netconfig.topology import Direction, MirrorPolicy, read_text
from gradtap.netconfig.validation import format_validation_error

PLAN_FORMAT = "gradtap-netconfig-plan/1"
#: The job spec's pattern for a mirror-stream name (the SONiC session-name pattern).
MIRROR_NAME = r"^[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}$"
Encapsulation = Literal["none", "erspan2", "erspan3"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlannedSource(_Model):
    """One mirrored port and direction, and where its copies go."""

    name: str = Field(pattern=MIRROR_NAME)
    group: str
    position: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    global_rank: int = Field(ge=0)
    node: str
    nic: str
    direction: Direction
    switch: str
    port: str
    speed_gbps: float = Field(gt=0)
    #: Mirror bandwidth this source needs at its destination: speed x 1, or x 2 for ``both``, times
    #: ERSPAN's per-frame overhead when encapsulated (:mod:`gradtap.netconfig.encapsulation`).
    load_gbps: float = Field(gt=0)
    #: When ``port`` is a LAG: the member ports mirrored for it.
    lag_members: list[str] = []
    cpu_node: str
    cpu_nic: str
    #: The switch port the CPU NIC is cabled to (SPAN destination, or where ERSPAN arrives).
    dest_switch: str
    dest_port: str
    encapsulation: Encapsulation
    erspan_dst_ip: str | None = None
    #: For ERSPAN: the routed path the stream takes and the budget it was checked against.
    erspan_route: str | None = None


class GroupNode(_Model):
    """One CPU node of a DP group's mirror group: the streams it captures and what it lacks."""

    name: str
    #: Its rank in the group's torch.distributed process group: nodes sorted by name.
    rank: int = Field(ge=0)
    #: Names of the group's sources this node captures.
    sources: list[str]
    #: Sum of those sources' loads.
    load_gbps: float
    #: Allgather chunks none of its streams carries: of every bucket it steps, the node must be
    #: sent these from its peers (or have them from nowhere, when it is the group's only node).
    uncovered_chunks: list[int]
    #: Bytes it lacks of its shard over the bytes its streams mirror, per iteration (the shards
    #: split the gradient evenly; both phases of the ring are mirrored): ``exchange_share``.
    exchange_share: float


class GroupPlan(_Model):
    id: str
    size: int = Field(ge=2)
    #: The CPU nodes the group's streams arrive at, in rank order; one node runs one appliance.
    cpu_nodes: list[GroupNode] = Field(min_length=1)
    sources: list[PlannedSource]
    #: c_k: mirrored streams carrying allgather chunk k, k = 0..size-1.
    coverage: list[int]
    p_fail_exact: float
    #: FlowCheck Eq. (2); null when the sources are not single-direction streams of distinct hops.
    p_fail_eq2: float | None

    @model_validator(mode="before")
    @classmethod
    def _one_node(cls, data: object) -> object:
        """Plans written before mirror groups named one ``cpu_node`` per group."""
        if isinstance(data, dict) and "cpu_node" in data and "cpu_nodes" not in data:
            data = {k: v for k, v in data.items() if k != "cpu_node"}
            size, raw = data.get("size"), data.get("sources")
            if not isinstance(raw, list) or not isinstance(size, int) or size < 2:
                return data  # reported as the fields' own errors and a missing cpu_nodes
            try:
                sources = [PlannedSource.model_validate(s) for s in raw]
            except ValidationError:
                return data
            if sources:
                data["cpu_nodes"] = [n.model_dump() for n in group_nodes(size, sources)]
        return data

    @model_validator(mode="after")
    def _nodes_hold_the_sources(self) -> GroupPlan:
        """``cpu_nodes`` must be what ``sources`` say: each source on the node it names, once, and
        the nodes ranked by name (a plan file is read back, and may have been edited)."""
        listed = [(name, node.name) for node in self.cpu_nodes for name in node.sources]
        placed = sorted((s.name, s.cpu_node) for s in self.sources)
        if sorted(listed) != placed:
            def show(pairs: list[tuple[str, str]]) -> str:
                return ", ".join(f"{name} on {node}" for name, node in sorted(pairs))
            raise ValueError(f"cpu_nodes list {show(listed)}, but the sources are {show(placed)} (the plan is "
                             "damaged; plan again)")
        names = [node.name for node in self.cpu_nodes]
        if names != sorted(names) or [node.rank for node in self.cpu_nodes] != list(range(len(names))):
            raise ValueError(f"cpu_nodes {names} must be ranked 0..{len(names) - 1} in name order (the plan is "
                             "damaged; plan again)")
        return self

    @property
    def spread(self) -> bool:
        """Do the group's streams arrive at several CPU nodes (a mirror group)?"""
        return len(self.cpu_nodes) > 1


def exchange_share(n_ranks: int, n_nodes: int, uncovered: int, hops: int) -> float:
    """Planned bytes a node lacks over the bytes its streams mirror, per iteration.

    With G the gradient's bytes, an N-rank ring sends each hop N-1 chunks of G/N in the
    reduce-scatter and N-1 in the allgather, so a node mirroring ``hops`` hops reads
    ``hops * 2(N-1)/N * G``. It steps 1/W of the gradient (W = ``n_nodes``, shards even) and lacks
    ``uncovered``/N of it: ``uncovered / (2 W (N-1) hops)``. The group's own protocol (coverage
    bitmaps and digests, about 0.4 % measured: docs/group.md) comes on top.
    """
    return uncovered / (2 * n_nodes * (n_ranks - 1) * hops)


def group_nodes(n_ranks: int, sources: list[PlannedSource]) -> list[GroupNode]:
    """The CPU nodes of a group's sources, ranked by name, with the chunks each lacks."""
    by_node: dict[str, list[PlannedSource]] = {}
    for s in sources:
        by_node.setdefault(s.cpu_node, []).append(s)
    nodes = []
    for rank, name in enumerate(sorted(by_node)):
        mine = by_node[name]
        hops = [h for s in mine for h in stream_hops(s.position, s.direction, n_ranks)]
        uncovered = [k for k, c in enumerate(chunk_coverage(n_ranks, hops)) if c == 0]
        nodes.append(GroupNode(name=name, rank=rank, sources=[s.name for s in mine],
                               load_gbps=sum(s.load_gbps for s in mine), uncovered_chunks=uncovered,
                               exchange_share=exchange_share(n_ranks, len(by_node), len(uncovered), len(hops))))
    return nodes


class SwitchInfo(_Model):
    name: str
    vendor: Vendor
    max_mirror_sessions: int | None = None
    session_id_base: int | None = None
    erspan_source_ip: str | None = None
    erspan_monitor_port: str | None = None
    #: Junos: Enhanced Layer 2 Software (see :class:`~gradtap.netconfig.hardware.LeafSwitch`).
    junos_els: bool = True
    ports_total: int
    ports_free: int
    #: Switch port -> Linux interface, for the ports this plan uses (``linux`` vendor).
    linux_ifnames: dict[str, str] = {}


class CpuPortUse(_Model):
    nic: str
    switch: str
    port: str
    speed_gbps: float
    #: Sum of the loads of the sources sent to this port (all sending at line rate at once).
    load_gbps: float
    groups: list[str]


class CpuNodeUse(_Model):
    name: str
    #: DP groups with streams on this node (one appliance each).
    groups: list[str]
    load_gbps: float
    #: The sum of its ports' speeds.
    capacity_gbps: float
    ports: list[CpuPortUse] = []
    #: What the node can take in over all ports (topology ``max_ingest_gbps``); null in older plans.
    max_ingest_gbps: float | None = None
    #: Where its mirror-group peers reach it, and the interface for that traffic (topology).
    address: str | None = None
    group_interface: str | None = None


class FabricUse(_Model):
    """ERSPAN load on the routed fabric, as the planner budgeted it."""

    spine_load_gbps: float
    spine_free_gbps: float
    #: Leaf -> ERSPAN Gbps it sends up / receives down, each of which must fit one uplink's free share.
    uplink_sent_gbps: dict[str, float] = {}
    uplink_received_gbps: dict[str, float] = {}
    #: Leaf -> free share of its smallest uplink, Gbps.
    uplink_free_gbps: dict[str, float] = {}


class Plan(_Model):
    format: Literal["gradtap-netconfig-plan/1"] = PLAN_FORMAT
    topology: str
    mirror: MirrorPolicy
    switches: list[SwitchInfo]
    groups: list[GroupPlan]
    cpu_nodes: list[CpuNodeUse]
    #: Null when no source crosses the routed fabric.
    fabric: FabricUse | None = None
    #: The topology's cost inputs. Saved with only the fields the topology gave, so that the report
    #: of a reloaded plan still tells FlowCheck's defaults from the cluster's own figures.
    cost: CostModel = CostModel()

    @field_serializer("cost")
    def _given_cost(self, cost: CostModel) -> dict:
        return cost.model_dump(exclude_unset=True)

    @model_validator(mode="before")
    @classmethod
    def _older_plan(cls, data: object) -> object:
        """Plans written before the ``cost:`` section kept a CPU-node price in ``mirror``; it is
        dropped (its report then shows FlowCheck's default prices, labelled so)."""
        if isinstance(data, dict) and isinstance(data.get("mirror"), dict):
            mirror = {k: v for k, v in data["mirror"].items() if k not in ("cpu_node_price_per_hour", "currency")}
            data = {**data, "mirror": mirror}
        return data

    def switch(self, name: str) -> SwitchInfo:
        for sw in self.switches:
            if sw.name == name:
                return sw
        raise ConfigError(f"plan: switch {name!r} is not part of this plan "
                          f"(switches: {', '.join(s.name for s in self.switches)})")

    def sources_on(self, switch: str) -> list[PlannedSource]:
        """Sources mirrored by ``switch``, in plan order."""
        return [s for g in self.groups for s in g.sources if s.switch == switch]


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(plan.model_dump_json(indent=2) + "\n")


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    text = read_text(path, "plan", "a plan is the plan.json `gradtap netconfig plan` writes")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path.name}: cannot read plan: {exc}; a plan is the plan.json "
                          "`gradtap netconfig plan` writes") from None
    except RecursionError:
        raise ConfigError(f"{path.name}: (top level): nested too deeply for a plan") from None
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path.name, exc, Plan)) from None
