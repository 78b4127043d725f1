"""The cluster topology a mirror plan is computed from, loaded from YAML and validated.

A topology holds the hardware (GPU nodes and the leaf-switch port of each GPU's NIC, leaf
switches with their ports and speeds, CPU mirror nodes and where each of their NIC ports
is cabled), the job's parallel layout (DP/TP/PP sizes, rank order, ring order) and the
mirror policy (loss rate, packets per iteration, sources per DP group) and the cost inputs.

Hardware (the records of :mod:`gradtap.netconfig.hardware`) is listed explicitly, or generated
from a compact ``rail_fabric`` section for rail-optimised clusters (see
:mod:`gradtap.netconfig.rail_fabric`). Every problem is reported as
``<file>: <field path>: <bad value> is not allowed (<what is>)``, all problems at once.
"""

from __future__ import annotations

import re
from collections import Counter
from ipaddress import IPv4Network
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gradtap.core.errors import ConfigError
from gradtap.netconfig.cost import CostModel
from gradtap.netconfig.hardware import NAME, CpuNode, GpuNode, LeafSwitch, SwitchPort, Vendor
from gradtap.netconfig.rail_fabric import RailFabric, expand_rail_fabric
from gradtap.netconfig.validation import format_validation_error, issue, show_value

#: A mirror direction, seen from the GPU NIC: ``egress`` = frames the NIC transmits.
Direction = Literal["egress", "ingress", "both"]
Axis = Literal["tp", "dp", "pp"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Layout(_Model):
    dp: int = Field(ge=2)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    #: Parallel axes from fastest- to slowest-varying global rank (Megatron's default).
    order: list[Axis] = ["tp", "dp", "pp"]
    #: Ring position -> DP rank, for every DP group. Default: NCCL orders the ring by rank.
    ring_order: list[int] | None = None
    #: Per-group override of ``ring_order``, keyed by group id (``tp0-pp3``).
    ring_order_by_group: dict[str, list[int]] = {}

    @field_validator("order")
    @classmethod
    def _permutation(cls, value: list[str]) -> list[str]:
        if sorted(value) != ["dp", "pp", "tp"]:
            raise ValueError(f"{show_value(value)} is not allowed (must name tp, dp and pp once each)")
        return value


class ErspanPolicy(_Model):
    #: May sources reach a CPU node on another switch through ERSPAN?
    allow: bool = True
    version: Literal[2, 3] = 2
    dscp: int = Field(0, ge=0, le=63)
    ttl: int = Field(64, ge=1, le=255)


class MirrorPolicy(_Model):
    #: Per-packet loss probability p of a mirror link.
    loss_rate: float = Field(ge=0, lt=1)
    #: K: allgather packets of one iteration, summed over all chunks of one DP group's ring.
    packets_per_iteration: float = Field(gt=0)
    sources_per_group: int = Field(3, ge=3)
    #: Directions the planner may choose from; ``both`` needs twice the mirror capacity.
    directions: list[Direction] = Field(["egress"], min_length=1)
    erspan: ErspanPolicy = ErspanPolicy()
    #: Per-vendor session limits replacing the built-in defaults (a switch's own limit wins).
    session_limits: dict[Vendor, int] = {}
    #: The largest mirrored frame, FCS included: RoCEv2 at RoCE MTU 4096 with VLAN tag, IPv6, UDP,
    #: BTH, RETH, ImmDt and ICRC is 14+4+40+8+12+16+4+4096+4+4 = 4202 bytes. ERSPAN budgets use it.
    frame_bytes: int = Field(4202, ge=64, le=9216)
    #: The share of a CPU-facing port's speed that mirrored streams may fill. 1 allows a port to
    #: run full when every source sends at line rate at once; lower it to keep headroom.
    cpu_port_max_utilization: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _price_moved(cls, data: object) -> object:
        if isinstance(data, dict) and ("cpu_node_price_per_hour" in data or "currency" in data):
            raise ValueError("cpu_node_price_per_hour and currency moved to the cost: section (write "
                             "cost: {cpu_node_usd_per_hour: ...}; prices are in USD; docs/netconfig.md, Cost)")
        return data


class Route(_Model):
    """The routed fabric carries ``prefix`` to leaf ``leaf`` (where the CPU ports of that prefix are)."""

    prefix: IPv4Network
    leaf: str


class Fabric(_Model):
    """The routed path ERSPAN crosses between leaves (leaf uplinks, spines): what it can carry."""

    #: The smallest IP MTU of any routed hop between two leaves (bytes of IP packet).
    path_mtu: int = Field(ge=1280, le=9216)
    #: The share of each leaf uplink that the training's own traffic leaves free for mirroring.
    uplink_free_fraction: float = Field(gt=0, le=1)
    #: Bandwidth the spine layer as a whole has free for mirror streams, Gbps.
    spine_free_gbps: float = Field(gt=0)
    #: Prefixes the fabric routes to each leaf: every ERSPAN destination must be in one.
    routes: list[Route] = Field(min_length=1)


class Topology(_Model):
    name: str = Field(pattern=NAME)
    description: str = ""
    layout: Layout
    mirror: MirrorPolicy
    gpu_nodes: list[GpuNode] = []
    leaf_switches: list[LeafSwitch] = []
    cpu_nodes: list[CpuNode] = []
    #: Compact description of a rail-optimised cluster; expands into the three lists above.
    rail_fabric: RailFabric | None = None
    #: The routed fabric between leaves; required when a plan sends ERSPAN across it.
    fabric: Fabric | None = None
    #: Prices, failure rate and checkpoint habits (:mod:`gradtap.netconfig.cost`); every input
    #: left out takes FlowCheck's value, and the report says so.
    cost: CostModel = CostModel()


def read_text(path: Path, what: str, example: str) -> str:
    """The text of ``path``, a ``what`` file (``example`` says what one looks like); a
    :class:`ConfigError` naming the file when it cannot be read or is not UTF-8 text."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path.name}: cannot read {what}: {exc.strerror} ({path})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path.name}: (top level): not a text file (byte 0x{raw[exc.start]:02x} at offset "
                          f"{exc.start} is not UTF-8); {example}") from None


def load_topology(path: str | Path) -> Topology:
    """Read, expand and validate a topology file; raise :class:`ConfigError` listing every problem."""
    path = Path(path)
    text = read_text(path, "topology", "a topology is a YAML file such as those in configs/topologies/")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name}: cannot read topology: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path.name}: (top level): nested too deeply for a topology") from None
    return parse_topology(data, source=path.name)


def parse_topology(data: object, source: str = "topology.yaml") -> Topology:
    """Validate an already-parsed YAML document (see :func:`load_topology`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the topology must be a mapping, got {type(data).__name__}")
    try:
        topo = Topology.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc, Topology)) from None
    if topo.rail_fabric is not None:
        if topo.gpu_nodes or topo.leaf_switches or topo.cpu_nodes:
            raise ConfigError(issue(source, ("rail_fabric",), "cannot be combined with explicit gpu_nodes, "
                                    "leaf_switches or cpu_nodes (use one or the other)"))
        gpu_nodes, leaf_switches, cpu_nodes = expand_rail_fabric(topo.rail_fabric, source)
        topo = topo.model_copy(update={"gpu_nodes": gpu_nodes, "leaf_switches": leaf_switches,
                                       "cpu_nodes": cpu_nodes})
    problems = check_references(topo, source)
    if problems:
        raise ConfigError("\n".join(problems))
    return topo


def check_references(topo: Topology, source: str) -> list[str]:
    """Cross-field checks pydantic cannot do: names resolve, nothing is cabled twice, sizes agree."""
    problems: list[str] = []
    ports: dict[str, dict[str, SwitchPort]] = {}
    for i, sw in enumerate(topo.leaf_switches):
        if sw.name in ports:
            problems.append(issue(source, ("leaf_switches", i, "name"), f"{sw.name!r} is used twice"))
        ports[sw.name] = {}
        for j, port in enumerate(sw.ports):
            if port.name in ports[sw.name]:
                problems.append(issue(source, ("leaf_switches", i, "ports", j, "name"),
                                      f"{port.name!r} is used twice on switch {sw.name!r}"))
            ports[sw.name][port.name] = port
        if sw.erspan_monitor_port is not None and not any(p.uplink and p.name == sw.erspan_monitor_port
                                                          for p in sw.ports):
            problems.append(issue(source, ("leaf_switches", i, "erspan_monitor_port"),
                                  f"{sw.erspan_monitor_port!r} is not an uplink port of {sw.name!r} (ERSPAN leaves "
                                  f"by a routed uplink; list it in ports with uplink: true)"))
        ifnames = Counter(p.linux_ifname for p in sw.ports if p.linux_ifname)
        for j, port in enumerate(sw.ports):
            if port.linux_ifname and ifnames[port.linux_ifname] > 1:
                problems.append(issue(source, ("leaf_switches", i, "ports", j, "linux_ifname"),
                                      f"{port.linux_ifname!r} names two ports of switch {sw.name!r}"))

    vendor_of = {sw.name: sw.vendor for sw in topo.leaf_switches}
    lag_of = _check_lags(topo, source, problems)
    cabled: dict[tuple[str, str], str] = {}

    def cable(loc: tuple, switch: str, port: str, owner: str) -> None:
        if switch not in ports:
            known = ", ".join(sorted(ports)) or "none"
            problems.append(issue(source, (*loc, "switch"),
                                  f"{switch!r} is not a leaf switch of this topology (known: {known})"))
        elif port not in ports[switch]:
            problems.append(issue(source, (*loc, "port"), f"{port!r} is not a port of leaf switch {switch!r}"))
        elif ports[switch][port].uplink:
            problems.append(issue(source, (*loc, "port"),
                                  f"{switch} {port} is an uplink and cannot be cabled to {owner}"))
        elif (switch, port) in cabled:
            problems.append(issue(source, (*loc, "port"),
                                  f"{switch} {port} is already cabled to {cabled[switch, port]}"))
        elif (switch, port) in lag_of:
            problems.append(issue(source, (*loc, "port"),
                                  f"{switch} {port} is a member of LAG {lag_of[switch, port]}; cable {owner} to "
                                  f"{lag_of[switch, port]} or take {port} out of its lag_members"))
        else:
            cabled[switch, port] = owner

    node_names: Counter[str] = Counter(n.name for n in [*topo.gpu_nodes, *topo.cpu_nodes])
    for i, node in enumerate(topo.gpu_nodes):
        if node_names[node.name] > 1:
            problems.append(issue(source, ("gpu_nodes", i, "name"), f"{node.name!r} is used twice"))
        for j, gpu in enumerate(node.gpus):
            cable(("gpu_nodes", i, "gpus", j), gpu.switch, gpu.port, f"{node.name} {gpu.nic}")
    for i, node in enumerate(topo.cpu_nodes):
        if node_names[node.name] > 1:
            problems.append(issue(source, ("cpu_nodes", i, "name"), f"{node.name!r} is used twice"))
        for j, port in enumerate(node.ports):
            cable(("cpu_nodes", i, "ports", j), port.switch, port.port, f"{node.name} {port.nic}")
            lag = ports.get(port.switch, {}).get(port.port)
            if lag is not None and lag.lag_members:
                problems.append(issue(source, ("cpu_nodes", i, "ports", j, "port"),
                                      f"{port.switch} {port.port} is a LAG, and a mirror destination must be one "
                                      f"physical port: {LAG_DESTINATION_RULE.get(vendor_of[port.switch], _NO_LAG_DEST)}; "
                                      f"gradtap also needs each stream on one link, whose losses are its own; "
                                      f"cable {node.name} {port.nic} to a port outside any LAG"))

    layout = topo.layout
    world = layout.dp * layout.tp * layout.pp
    gpus = sum(len(n.gpus) for n in topo.gpu_nodes)
    if gpus != world:
        problems.append(issue(source, ("layout",), f"dp {layout.dp} x tp {layout.tp} x pp {layout.pp} = "
                              f"{world} ranks, but gpu_nodes list {gpus} GPUs"))
    if layout.ring_order is not None and sorted(layout.ring_order) != list(range(layout.dp)):
        problems.append(issue(source, ("layout", "ring_order"), f"{show_value(layout.ring_order)} is not "
                              f"allowed (must list each DP rank 0..{layout.dp - 1} once)"))
    groups = {f"tp{t}-pp{p}" for t in range(layout.tp) for p in range(layout.pp)}
    for key, order in layout.ring_order_by_group.items():
        if key not in groups:
            problems.append(issue(source, ("layout", "ring_order_by_group", key),
                                  f"{key!r} is not a DP group of this layout (ids look like 'tp0-pp0')"))
        elif sorted(order) != list(range(layout.dp)):
            problems.append(issue(source, ("layout", "ring_order_by_group", key), f"{show_value(order)} is "
                                  f"not allowed (must list each DP rank 0..{layout.dp - 1} once)"))
    if not topo.cpu_nodes:
        problems.append(issue(source, ("cpu_nodes",), "no CPU mirror node is listed"))
    if topo.fabric is not None:
        for i, route in enumerate(topo.fabric.routes):
            if route.leaf not in ports:
                problems.append(issue(source, ("fabric", "routes", i, "leaf"), f"{route.leaf!r} is not a leaf "
                                      f"switch of this topology (known: {', '.join(sorted(ports)) or 'none'})"))
    return problems


#: A port name that is a link aggregate on some platform: SONiC PortChannel0010, EOS Port-Channel10,
#: NX-OS port-channel10 / Po10, Junos ae0, Comware Bridge-Aggregation1 / Route-Aggregation1,
#: Huawei Eth-Trunk1, Linux and Cumulus bond0.
LAG_NAME = re.compile(r"(port-?channel|po|ae|bond|bridge-aggregation|route-aggregation|eth-trunk)\d+",
                      re.IGNORECASE)
#: Why each platform cannot take a LAG as mirror destination, as far as its sources say.
LAG_DESTINATION_RULE = {
    "sonic": "SONiC's `config mirror_session span add` refuses it ('Destination Interface ... is not "
             "supported', sonic-utilities config/main.py) and sonic-mirror-session.yang's dst_port is a leafref "
             "to PORT",
    "linux": "tc mirred to a bond sends each copy out of one slave, chosen by the bond's mode and hash",
    "comware": "H3C's mirroring guide: 'A Layer 2 or Layer 3 aggregate interface cannot be configured as the "
               "monitor port of a local mirroring group', nor can an aggregate member",
}
_NO_LAG_DEST = "gradtap renders no LAG destination for this platform (not confirmed in its documentation)"


def _check_lags(topo: Topology, source: str, problems: list[str]) -> dict[tuple[str, str], str]:
    """LAG members exist, belong to one LAG, add up to its speed; LAG-like names declare members.
    Returns (switch, member port) -> LAG name."""
    lag_of: dict[tuple[str, str], str] = {}
    for i, sw in enumerate(topo.leaf_switches):
        by_name = {p.name: p for p in sw.ports}
        for j, port in enumerate(sw.ports):
            loc = ("leaf_switches", i, "ports", j)
            if not port.lag_members:
                if LAG_NAME.fullmatch(port.name):
                    problems.append(issue(source, (*loc, "name"), f"{port.name!r} names a LAG (port-channel, "
                                          f"ae, PortChannel, bond, ...); list its member ports in lag_members so "
                                          f"that gradtap knows which links it mirrors"))
                continue
            speed = 0.0
            for k, member in enumerate(port.lag_members):
                where = (*loc, "lag_members", k)
                found = by_name.get(member)
                if found is None:
                    problems.append(issue(source, where, f"{member!r} is not a port of leaf switch {sw.name!r}"))
                elif found.lag_members or member == port.name:
                    problems.append(issue(source, where, f"{member!r} is a LAG itself; list physical ports"))
                elif (sw.name, member) in lag_of:
                    problems.append(issue(source, where, f"{member!r} is already a member of "
                                          f"{lag_of[sw.name, member]}"))
                else:
                    lag_of[sw.name, member] = port.name
                    speed += found.speed_gbps
            if speed and abs(speed - port.speed_gbps) > 1e-9:
                problems.append(issue(source, (*loc, "speed_gbps"), f"{port.speed_gbps:g} is not allowed (the "
                                      f"members of {port.name} add up to {speed:g} Gbps)"))
    return lag_of


