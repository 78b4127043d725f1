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

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, model_validator

from gradtap.core.errors import ConfigError
from gradtap.netconfig.cost import CostModel
from gradtap.netconfig.hardware import Vendor
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


class GroupPlan(_Model):
    id: str
    size: int = Field(ge=2)
    cpu_node: str
    sources: list[PlannedSource]
    #: c_k: mirrored streams carrying allgather chunk k, k = 0..size-1.
    coverage: list[int]
    p_fail_exact: float
    #: FlowCheck Eq. (2); null when the sources are not single-direction streams of distinct hops.
    p_fail_eq2: float | None


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
    groups: list[str]
    load_gbps: float
    capacity_gbps: float
    ports: list[CpuPortUse] = []


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


def mirrors_section(group: GroupPlan) -> dict:
    """The job spec's ``mirrors:`` section for the appliance of ``group``.

    ``rank`` is the ring position (equal to the DP rank under NCCL's default ring order).
    """
    return {"mirrors": [{"name": s.name, "rank": s.position, "direction": s.direction,
                         "encapsulation": s.encapsulation} for s in group.sources]}


def mirrors_yaml(plan: Plan, group: GroupPlan) -> str:
    """``mirrors_section`` as YAML, with comments saying where each stream is captured."""
    lines = [f"# Mirror streams of DP group {group.id} (topology {plan.topology}), written by "
             "`gradtap netconfig plan`.",
             f"# The gradtap appliance for this group runs on CPU node {group.cpu_node}."]
    for s in group.sources:
        how = "switch-local SPAN" if s.encapsulation == "none" else (
            f"{s.encapsulation.upper()} from {s.switch} to {s.erspan_dst_ip}; the appliance opens GRE/ERSPAN itself")
        lines.append(f"# {s.name}: {s.node} {s.nic} ({s.switch} {s.port}) {s.direction} -> "
                     f"{s.cpu_node} {s.cpu_nic} via {how}")
    return "\n".join(lines) + "\n" + yaml.safe_dump(mirrors_section(group), sort_keys=False)
