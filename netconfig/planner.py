"""Choose the mirror sources of every DP group and assign them to CPU-node ports.

Per DP group, the planner greedily adds ``mirror.sources_per_group`` sources -- a ring position
and a direction -- each time taking the candidate that best improves chunk coverage
(:mod:`gradtap.netconfig.ring`): the sorted coverage vector is compared lexicographically, so the
minimum coverage is raised first, then the number of chunks at that minimum lowered. Ties prefer
a switch-local destination, less mirror bandwidth, ring neighbours of the sources already chosen
(FlowCheck's consecutive ranks) and low positions. For egress-only sources every choice of
distinct ranks covers each chunk at least M-1 times; the ranking matters when ingress or both
are allowed, where mirroring both ends of one link would waste a source.

A group's sources go to one CPU node (one gradtap appliance) when one node can take them all.
When none can -- its ports, or its ``max_ingest_gbps`` over all its ports, fall short -- they
are spread over several, which form a **mirror group** (docs/group.md): the same greedy choice
runs over every open node's ports, and among equally good sources it prefers, after coverage and
switch-local destinations, fewer nodes whose own streams leave an allgather chunk uncovered (a
node holding one egress stream lacks 1/N of every bucket it steps and must be sent it; two hops,
or a ``both`` mirror, carry every chunk), then fewer nodes. Since the greedy fills one node
before the next, the spread is also tried with at most two streams a node and the placement with
fewer lacking nodes kept (four sources on nodes of three: 2 + 2, not 3 + 1). Spreading changes no
stream, so the group's coverage and P(fail) are those of the same sources on one node.

A source is placed on an unused port of a node: on the source's own leaf (SPAN) when possible,
else through ERSPAN when the policy, the vendor and the addresses allow. A port takes several
sources only if they belong to different groups (a group's streams must be lost independently)
and their total bandwidth fits (every source at line rate, ERSPAN's per-frame overhead included,
within ``mirror.cpu_port_max_utilization``); a node takes in at most its ``max_ingest_gbps``; a
port is either a SPAN destination or an ERSPAN receiver, never both. An ERSPAN stream must also
fit the routed fabric: the path MTU, a route to its destination, one uplink at each end, the
spine. Switch session limits are counted with each vendor's own session grouping. A group that
cannot be served makes the whole topology infeasible: the error says which limit stopped each
port and node, and no partial plan is returned.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ipaddress import ip_address

from gradtap.core.errors import ConfigError
from gradtap.netconfig import vendors
from gradtap.netconfig.encapsulation import mirrored_gbps, outer_ip_bytes
from gradtap.netconfig.hardware import LeafSwitch
from gradtap.netconfig.layout import DpGroup, Seat, dp_groups
from gradtap.netconfig.plan import (CpuNodeUse, CpuPortUse, FabricUse, GroupPlan, Plan, PlannedSource, SwitchInfo,
                                    group_nodes)
from gradtap.netconfig.reliability import p_fail_eq2, p_fail_exact
from gradtap.netconfig.ring import chunk_coverage, stream_hops
from gradtap.netconfig.topology import Direction, Topology
from gradtap.netconfig.vendors.base import SWITCH_DIRECTION, session_keys, session_limit

_DIRECTION_ORDER = {"egress": 0, "ingress": 1, "both": 2}
_MAX_REASONS = 6
#: Gbps below which a shortfall is rounding, not a lack of capacity.
_EPS = 1e-9


@dataclass
class _CpuPort:
    node: str
    nic: str
    switch: str
    port: str
    speed_gbps: float
    ip: str | None
    free_gbps: float
    mode: str | None = None  # "span" or "erspan" once used


@dataclass
class _Fabric:
    """ERSPAN load on the routed fabric: per leaf up and down its uplinks, and on the spines."""

    sent: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    received: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    spine: float = 0.0

    def copy(self) -> _Fabric:
        return _Fabric(defaultdict(float, self.sent), defaultdict(float, self.received), self.spine)

    def add(self, source_leaf: str, dest_leaf: str, gbps: float) -> None:
        self.sent[source_leaf] += gbps
        self.received[dest_leaf] += gbps
        self.spine += gbps


@dataclass
class _State:
    """What earlier groups have committed: port capacity, node slots, sources per switch, fabric load."""

    ports: dict[str, list[_CpuPort]]
    slots: dict[str, int]
    switches: dict[str, LeafSwitch]
    #: Per CPU node: Gbps it can take in (``max_ingest_gbps``) and Gbps planned so far.
    ingest_limit: dict[str, float]
    ingest: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    groups_of: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    on_switch: dict[str, list[tuple[str, Direction]]] = field(default_factory=lambda: defaultdict(list))
    fabric: _Fabric = field(default_factory=_Fabric)


@dataclass(frozen=True)
class _Pick:
    position: int
    direction: Direction
    hops: tuple[int, ...]
    seat: Seat
    load_gbps: float
    port: _CpuPort
    encapsulation: str
    route: str | None


@dataclass
class _Selection:
    nodes: list[str]
    picks: list[_Pick]
    reasons: set[str]

    @property
    def node(self) -> str:
        return self.nodes[0]

    def lacking(self) -> int:
        """Nodes whose streams leave an allgather chunk uncovered (one distinct hop)."""
        return sum(len({h for p in self.picks if p.port.node == node for h in p.hops}) == 1 for node in self.nodes)

    @property
    def erspan(self) -> int:
        return sum(p.encapsulation != "none" for p in self.picks)


class _Infeasible(Exception):
    pass


def plan_topology(topo: Topology) -> Plan:
    """Plan every DP group of ``topo``; raise :class:`ConfigError` explaining any group that cannot be served."""
    speed = {(sw.name, p.name): p.speed_gbps for sw in topo.leaf_switches for p in sw.ports}
    share = topo.mirror.cpu_port_max_utilization
    state = _State(
        ports={n.name: [_CpuPort(n.name, p.nic, p.switch, p.port, speed[p.switch, p.port],
                                 str(p.ip) if p.ip else None, speed[p.switch, p.port] * share) for p in n.ports]
               for n in topo.cpu_nodes},
        slots={n.name: n.max_dp_groups for n in topo.cpu_nodes},
        switches={sw.name: sw for sw in topo.leaf_switches},
        ingest_limit={n.name: n.max_ingest_gbps for n in topo.cpu_nodes},
    )
    groups, problems = [], []
    for group in dp_groups(topo):
        try:
            groups.append(_plan_group(topo, group, state))
        except _Infeasible as exc:
            problems.append(str(exc))
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more DP groups"] if len(problems) > 8 else [])
        raise ConfigError(f"topology {topo.name!r} is infeasible ({len(problems)} of "
                          f"{len(problems) + len(groups)} DP groups cannot be mirrored); no plan was made:\n"
                          + "\n".join(f"  - {p}" for p in shown))
    return Plan(topology=topo.name, mirror=topo.mirror, switches=_switch_infos(topo, groups),
                groups=groups, cpu_nodes=_cpu_uses(topo, state, groups), fabric=_fabric_use(topo, state),
                cost=topo.cost)


def _candidates(topo: Topology, group: DpGroup) -> list[tuple[int, Direction, tuple[int, ...]]]:
    out = []
    for position in range(group.size):
        for direction in topo.mirror.directions:
            hops = stream_hops(position, direction, group.size)
            if all(group.hop_on_network(h) for h in hops):
                out.append((position, direction, hops))
    return out


def _plan_group(topo: Topology, group: DpGroup, state: _State) -> GroupPlan:
    wanted = topo.mirror.sources_per_group
    candidates = _candidates(topo, group)
    positions = {c[0] for c in candidates}
    switches = sorted({s.switch for s in group.seats})
    where = f"DP group {group.id} ({group.size} ranks on {', '.join(switches)})"
    if len(positions) < wanted:
        raise _Infeasible(f"{where}: only {len(positions)} ring positions send or receive in the allowed "
                          f"directions ({', '.join(topo.mirror.directions)}) over the network -- the other hops "
                          f"stay inside a node -- but {wanted} mirror sources are needed")
    open_nodes = [n.name for n in topo.cpu_nodes if len(state.groups_of[n.name]) < state.slots[n.name]]
    if not open_nodes:
        raise _Infeasible(f"{where}: every CPU node already hosts its max_dp_groups; add a CPU node cabled to "
                          f"{', '.join(switches)} or raise max_dp_groups")
    local = [n for n in open_nodes if any(p.switch in switches for p in state.ports[n])]
    # Nodes already in use first (fewer CPU nodes), then those with more ports on the group's leaves.
    local.sort(key=lambda n: (not state.groups_of[n], -sum(p.switch in switches for p in state.ports[n])))
    remote = [n for n in open_nodes if n not in local] if topo.mirror.erspan.allow else []
    best: _Selection | None = None
    for node in local + remote:
        selection = _select(topo, group, candidates, [node], state)
        complete = len(selection.picks) == wanted
        if complete and selection.erspan == 0:
            best = selection
            break
        if best is None or (len(selection.picks), -selection.erspan) > (len(best.picks), -best.erspan):
            best = selection
    if best is not None and len(best.picks) == wanted:
        return _commit(topo, group, best, state)
    if not local and not remote:
        raise _Infeasible(f"{where}: no CPU node with a free DP-group slot is cabled to {', '.join(switches)}"
                          + ("" if topo.mirror.erspan.allow else ", and mirror.erspan.allow is false"))
    assert best is not None
    # No one node takes the group's streams: spread them over several (a mirror group, docs/group.md).
    spread = None
    if len(local + remote) > 1:
        # Greedy fills a node before the next, so four sources over nodes of three become 3 + 1 and
        # leave one node lacking a chunk; at most two streams a node gives 2 + 2. Keep the better.
        spread = max((_select(topo, group, candidates, local + remote, state, per_node)
                      for per_node in (None, 2)),
                     key=lambda s: (len(s.picks), -s.lacking(), -len(s.nodes)))
    if spread is not None and len(spread.picks) == wanted:
        return _commit(topo, group, spread, state)
    message = (f"{where}: needs {wanted} mirror sources on distinct ports of one CPU node, but the best node, "
               f"{best.node}, takes only {len(best.picks)}: " + "; ".join(sorted(best.reasons)[:_MAX_REASONS]))
    if spread is not None:
        more = sorted(spread.reasons - best.reasons)[:_MAX_REASONS]
        message += (f"; spread over the {len(local + remote)} CPU nodes with a free DP-group slot "
                    f"({_names(local + remote)}), only {len(spread.picks)} fit"
                    + (f": also {'; '.join(more)}" if more else " (for the same reasons)"))
    raise _Infeasible(message)


def _names(nodes: list[str], shown: int = 4) -> str:
    return ", ".join(nodes[:shown]) + (f" and {len(nodes) - shown} more" if len(nodes) > shown else "")


def _select(topo: Topology, group: DpGroup, candidates: list[tuple[int, Direction, tuple[int, ...]]],
            nodes: list[str], state: _State, per_node: int | None = None) -> _Selection:
    """Greedily choose the group's sources and their ports among ``nodes`` (one node, or several
    for a mirror group, each taking at most ``per_node`` of them), against tentative copies of
    the state."""
    ports = {node: [_CpuPort(**vars(p)) for p in state.ports[node]] for node in nodes}
    ingest = {node: state.ingest[node] for node in nodes}
    on_switch = {k: list(v) for k, v in state.on_switch.items()}
    fabric = state.fabric.copy()
    picks: list[_Pick] = []
    reasons: set[str] = set()
    for _ in range(topo.mirror.sources_per_group):
        reasons = set()
        best, best_score = None, None
        taken = {p.position for p in picks}
        for position, direction, hops in candidates:
            if position in taken:
                continue
            seat = group.seats[position]
            for index, node in enumerate(nodes):
                if per_node is not None and sum(p.port.node == node for p in picks) >= per_node:
                    continue
                placed = _place(topo, state.switches[seat.switch], seat, direction, seat.speed_gbps * len(hops),
                                ports[node], picks, on_switch, fabric, reasons,
                                state.ingest_limit[node] - ingest[node], len(nodes) > 1)
                if placed is None:
                    continue
                port, encapsulation, load, route = placed
                score = (*_score(group, picks, position, direction, hops, load, encapsulation, node),
                         -index)  # the earlier node in the planner's order (in use, more local ports)
                if best_score is None or score > best_score:
                    best = _Pick(position, direction, hops, seat, load, port, encapsulation, route)
                    best_score = score
        if best is None:
            break
        picks.append(best)
        ingest[best.port.node] += best.load_gbps
        best.port.free_gbps -= best.load_gbps
        best.port.mode = "span" if best.encapsulation == "none" else "erspan"
        if best.encapsulation != "none":
            fabric.add(best.seat.switch, best.port.switch, best.load_gbps)
        on_switch.setdefault(best.seat.switch, []).append((_dest_key(best.port, best.encapsulation), best.direction))
    return _Selection(list(dict.fromkeys(p.port.node for p in picks)) or nodes[:1], picks, reasons)


def _score(group: DpGroup, picks: list[_Pick], position: int, direction: Direction, hops: tuple[int, ...],
           load: float, encapsulation: str, node: str) -> tuple:
    """Higher is better: the group's coverage, a switch-local destination, then (for a mirror group)
    fewer nodes whose own streams leave chunks uncovered (each must fetch them from its peers),
    fewer nodes, less bandwidth, ring neighbours, low positions, simple directions."""
    coverage = chunk_coverage(group.size, [h for p in picks for h in p.hops] + list(hops))
    distance = min((min((position - p.position) % group.size, (p.position - position) % group.size)
                    for p in picks), default=0)
    node_hops: dict[str, list[int]] = defaultdict(list)
    for p in picks:
        node_hops[p.port.node].extend(p.hops)
    node_hops[node].extend(hops)
    lacking = sum(len(set(h)) == 1 for h in node_hops.values())  # one distinct hop misses one chunk
    return (sorted(coverage), encapsulation == "none", -lacking, -len(node_hops), -load, -distance, -position,
            -_DIRECTION_ORDER[direction])


def _dest_key(port: _CpuPort, encapsulation: str) -> str:
    return port.port if encapsulation == "none" else f"erspan:{port.ip}"


def _place(topo: Topology, switch: LeafSwitch, seat: Seat, direction: Direction, line_gbps: float, ports,
           picks: list[_Pick], on_switch: dict[str, list[tuple[str, Direction]]], fabric: _Fabric,
           reasons: set[str], ingest_free: float, name_nodes: bool) -> tuple[_CpuPort, str, float, str | None] | None:
    """The best port of the node for this source (local first, tightest fit) with its encapsulation,
    load (``line_gbps`` plus ERSPAN overhead) and ERSPAN route; or None, with the reasons noted.
    ``ingest_free``: what the node can still take in; ``name_nodes``: name the node in reasons."""
    spec = vendors.spec(switch.vendor)
    limit = session_limit(spec, switch, topo.mirror)
    erspan = f"erspan{topo.mirror.erspan.version}"
    used = {id(p.port) for p in picks}
    options, short = [], []
    for port in ports:
        if id(port) in used:
            continue
        route = None
        if port.switch == seat.switch:
            if port.mode == "erspan":
                reasons.add(f"{port.node} {port.nic} receives ERSPAN already, so it is no SPAN destination")
                continue
            encapsulation = "none"
        else:
            if port.mode == "span":
                reasons.add(f"{port.node} {port.nic} is a SPAN destination already, so it receives no ERSPAN")
                continue
            if port.ip is None:
                reasons.add(f"{port.node} {port.nic} (on {port.switch}) has no ip to receive ERSPAN")
                continue
            if not topo.mirror.erspan.allow:
                reasons.add(f"ERSPAN from {seat.switch} is off (mirror.erspan.allow is false)")
                continue
            if erspan not in spec.encapsulations:
                reasons.add(f"{seat.switch} runs {spec.title}, which gradtap cannot configure for {erspan}")
                continue
            if switch.erspan_source_ip is None:
                reasons.add(f"{seat.switch} has no erspan_source_ip for ERSPAN")
                continue
            if SWITCH_DIRECTION[direction] not in spec.erspan_directions:
                reasons.add(f"{seat.switch} runs {spec.title}, whose ERSPAN takes only "
                            f"{'/'.join(sorted(spec.erspan_directions))} sources (switch-port view), not {direction}")
                continue
            if spec.erspan_monitor_port and switch.erspan_monitor_port is None:
                reasons.add(f"{seat.switch} runs {spec.title}, whose ERSPAN leaves by a named port: set "
                            f"erspan_monitor_port to one of its uplinks")
                continue
            erspan_sessions = {k for k, _ in on_switch.get(seat.switch, []) if k.startswith("erspan:")}
            if (spec.max_erspan_sessions is not None and _dest_key(port, erspan) not in erspan_sessions
                    and len(erspan_sessions) >= spec.max_erspan_sessions):
                reasons.add(f"{seat.switch} ({spec.title}) already sends ERSPAN to "
                            f"{len(erspan_sessions)} destination(s), its limit (one monitor port per group)")
                continue
            encapsulation = erspan
        load = mirrored_gbps(line_gbps, topo.mirror.frame_bytes, encapsulation, _ip_version(port.ip))
        if port.free_gbps < load - _EPS:
            short.append(f"{port.node + ' ' if name_nodes else ''}{port.nic} {port.free_gbps:.4g} of "
                         f"{port.speed_gbps:g}"
                         + (f" (needs {load:.4g} with {encapsulation.upper()})" if encapsulation != "none" else ""))
            continue
        if ingest_free < load - _EPS:
            limit = next(n.max_ingest_gbps for n in topo.cpu_nodes if n.name == port.node)
            reasons.add(f"CPU node {port.node} takes in at most {limit:g} Gbps (cpu_nodes max_ingest_gbps) and has "
                        f"{max(ingest_free, 0):.4g} left, not the {load:.4g} Gbps that mirroring {direction} from "
                        f"{seat.switch} needs")
            continue
        if encapsulation != "none":
            route = _erspan_route(topo, seat.switch, port, encapsulation, load, fabric, reasons)
            if route is None:
                continue
        keys = session_keys(spec, [*on_switch.get(seat.switch, []), (_dest_key(port, encapsulation), direction)])
        if limit is not None and len(keys) > limit:
            reasons.add(f"{seat.switch} ({spec.title}) would exceed its limit of {limit} mirror sessions")
            continue
        options.append(((encapsulation != "none", port.free_gbps), port, encapsulation, load, route))
    unused = [p for p in ports if id(p) not in used]
    if not options and (short or not unused):
        # Only when capacity is what is missing: a port left out for another reason has said so.
        utilization = topo.mirror.cpu_port_max_utilization
        cap = "" if utilization == 1 else f" within mirror.cpu_port_max_utilization {utilization:g}"
        why = (f"Gbps free: {', '.join(short)}" if short else
               f"each of the node's {len(used)} ports already carries one of this group's streams")
        reasons.add(f"no unused port on {seat.switch} (or reachable by ERSPAN) has {line_gbps:g} Gbps free{cap} "
                    f"to mirror {direction} ({why})")
    if not options:
        return None
    _, port, encapsulation, load, route = min(options, key=lambda o: o[0])
    return port, encapsulation, load, route


def _ip_version(ip: str | None) -> int:
    return 4 if ip is None else ip_address(ip).version


def _erspan_route(topo: Topology, source_leaf: str, port: _CpuPort, encapsulation: str, load: float,
                  fabric: _Fabric, reasons: set[str]) -> str | None:
    """The routed path of an ERSPAN stream from ``source_leaf`` to ``port``, checked against the path MTU,
    the fabric's routes, the leaves' uplinks and the spine; None (with the reason noted) if it does not fit."""
    where = f"ERSPAN from {source_leaf} to {port.node} {port.nic} ({port.ip} on {port.switch})"
    if topo.fabric is None:
        reasons.add(f"{where} crosses the routed fabric, which the topology does not describe (add fabric: "
                    "path_mtu, uplink_free_fraction, spine_free_gbps, routes)")
        return None
    routes = [(i, r) for i, r in enumerate(topo.fabric.routes) if ip_address(port.ip) in r.prefix]
    if not routes:
        reasons.add(f"{where}: no fabric.routes prefix holds {port.ip}, so the switch has no route to it")
        return None
    index, route = max(routes, key=lambda ir: ir[1].prefix.prefixlen)  # longest prefix match
    if route.leaf != port.switch:
        reasons.add(f"{where}: fabric.routes[{index}] routes {route.prefix} to {route.leaf}, not to {port.switch}")
        return None
    version = _ip_version(port.ip)
    packet = outer_ip_bytes(topo.mirror.frame_bytes, encapsulation, version)
    if packet > topo.fabric.path_mtu:
        reasons.add(f"{where}: a {topo.mirror.frame_bytes} B frame in {encapsulation.upper()} over IPv{version} is a "
                    f"{packet} B packet, over fabric.path_mtu {topo.fabric.path_mtu}")
        return None
    for leaf, used, way in ((source_leaf, fabric.sent, "up"), (port.switch, fabric.received, "down")):
        free = _uplink_free(topo, leaf)
        if free is None:
            reasons.add(f"{where}: {leaf} has no uplink port (uplink: true) for ERSPAN to cross the spine")
            return None
        # ECMP hashes a GRE flow on its outer addresses: all of a leaf's sessions may share one uplink.
        if used[leaf] + load > free + _EPS:
            reasons.add(f"{where}: {used[leaf] + load:.4g} Gbps of ERSPAN {way} {leaf}'s uplinks, over the "
                        f"{free:.4g} Gbps free on one (ECMP may put every session on the same uplink)")
            return None
    if fabric.spine + load > topo.fabric.spine_free_gbps + _EPS:
        reasons.add(f"{where}: {fabric.spine + load:.4g} Gbps of ERSPAN across the spine, over "
                    f"fabric.spine_free_gbps {topo.fabric.spine_free_gbps:g}")
        return None
    return (f"{source_leaf} uplink -> spine -> {port.switch} {port.port} ({port.ip}, in {route.prefix}: "
            f"fabric.routes[{index}]); {packet} B IPv{version} packets <= path MTU {topo.fabric.path_mtu}")


def _uplink_free(topo: Topology, leaf: str) -> float | None:
    """Free Gbps of the leaf's smallest uplink (None without uplinks)."""
    assert topo.fabric is not None
    speeds = [p.speed_gbps for sw in topo.leaf_switches if sw.name == leaf for p in sw.ports if p.uplink]
    return min(speeds) * topo.fabric.uplink_free_fraction if speeds else None


def _commit(topo: Topology, group: DpGroup, selection: _Selection, state: _State) -> GroupPlan:
    real = {(p.node, p.nic): p for node in selection.nodes for p in state.ports[node]}
    lags = {(sw.name, p.name): p.lag_members for sw in topo.leaf_switches for p in sw.ports if p.lag_members}
    sources = []
    for index, pick in enumerate(sorted(selection.picks, key=lambda p: p.position)):
        port = real[pick.port.node, pick.port.nic]
        port.free_gbps -= pick.load_gbps
        state.ingest[port.node] += pick.load_gbps
        port.mode = "span" if pick.encapsulation == "none" else "erspan"
        if pick.encapsulation != "none":
            state.fabric.add(pick.seat.switch, port.switch, pick.load_gbps)
        state.on_switch[pick.seat.switch].append((_dest_key(port, pick.encapsulation), pick.direction))
        sources.append(PlannedSource(
            name=f"m{index}", group=group.id, position=pick.position, dp_rank=group.dp_ranks[pick.position],
            global_rank=pick.seat.global_rank, node=pick.seat.node, nic=pick.seat.nic, direction=pick.direction,
            switch=pick.seat.switch, port=pick.seat.port, speed_gbps=pick.seat.speed_gbps, load_gbps=pick.load_gbps,
            cpu_node=port.node, cpu_nic=port.nic, dest_switch=port.switch, dest_port=port.port,
            lag_members=list(lags.get((pick.seat.switch, pick.seat.port), [])),
            encapsulation=pick.encapsulation, erspan_dst_ip=None if pick.encapsulation == "none" else port.ip,
            erspan_route=pick.route))
    for node in selection.nodes:
        state.groups_of[node].append(group.id)
    hops = [h for p in selection.picks for h in p.hops]
    mirror = topo.mirror
    coverage = chunk_coverage(group.size, hops)
    distinct_streams = len(set(hops)) == len(hops) == len(selection.picks)
    return GroupPlan(
        id=group.id, size=group.size, cpu_nodes=group_nodes(group.size, sources), sources=sources, coverage=coverage,
        p_fail_exact=p_fail_exact(coverage, mirror.packets_per_iteration, mirror.loss_rate),
        p_fail_eq2=p_fail_eq2(group.size, len(hops), mirror.packets_per_iteration, mirror.loss_rate)
        if distinct_streams else None)


def _switch_infos(topo: Topology, groups: list[GroupPlan]) -> list[SwitchInfo]:
    cabled = {(g.switch, g.port) for n in topo.gpu_nodes for g in n.gpus}
    cabled |= {(p.switch, p.port) for n in topo.cpu_nodes for p in n.ports}
    used = {(s.switch, port) for g in groups for s in g.sources for port in [s.port, *s.lag_members]}
    used |= {(s.dest_switch, s.dest_port) for g in groups for s in g.sources}
    return [SwitchInfo(name=sw.name, vendor=sw.vendor, max_mirror_sessions=sw.max_mirror_sessions,
                       session_id_base=sw.session_id_base,
                       erspan_source_ip=str(sw.erspan_source_ip) if sw.erspan_source_ip else None,
                       erspan_monitor_port=sw.erspan_monitor_port,
                       junos_els=sw.junos_els,
                       ports_total=len(sw.ports),
                       ports_free=sum((sw.name, p.name) not in cabled and not p.uplink for p in sw.ports),
                       linux_ifnames={p.name: p.linux_ifname for p in sw.ports
                                      if p.linux_ifname and (sw.name, p.name) in used})
            for sw in topo.leaf_switches]


def _cpu_uses(topo: Topology, state: _State, groups: list[GroupPlan]) -> list[CpuNodeUse]:
    described = {n.name: n for n in topo.cpu_nodes}
    load: dict[tuple[str, str], float] = defaultdict(float)
    port_groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for g in groups:
        for s in g.sources:
            load[s.cpu_node, s.cpu_nic] += s.load_gbps
            port_groups[s.cpu_node, s.cpu_nic].append(g.id)
    uses = []
    for node, gids in state.groups_of.items():
        if not gids:
            continue
        ports = [CpuPortUse(nic=p.nic, switch=p.switch, port=p.port, speed_gbps=p.speed_gbps,
                            load_gbps=load[node, p.nic], groups=port_groups[node, p.nic]) for p in state.ports[node]]
        uses.append(CpuNodeUse(name=node, groups=list(gids), load_gbps=sum(p.load_gbps for p in ports),
                               capacity_gbps=sum(p.speed_gbps for p in ports), ports=ports,
                               max_ingest_gbps=described[node].max_ingest_gbps, address=described[node].address,
                               group_interface=described[node].group_interface))
    return uses


def _fabric_use(topo: Topology, state: _State) -> FabricUse | None:
    if topo.fabric is None or not state.fabric.spine:
        return None
    leaves = sorted({*state.fabric.sent, *state.fabric.received})
    return FabricUse(spine_load_gbps=state.fabric.spine, spine_free_gbps=topo.fabric.spine_free_gbps,
                     uplink_sent_gbps=dict(state.fabric.sent), uplink_received_gbps=dict(state.fabric.received),
                     uplink_free_gbps={leaf: _uplink_free(topo, leaf) or 0.0 for leaf in leaves})
