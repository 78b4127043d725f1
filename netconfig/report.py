"""The plan report: sessions per switch, CPU nodes and their load, failure probability, cost.

Per DP group it lists its CPU nodes (several for a mirror group) with each node's rank, streams,
load and expected exchange share (:func:`gradtap.netconfig.plan.exchange_share`); per CPU node
its ingest against its ports' speeds and its ``max_ingest_gbps``.

Cost is the expected USD a day with ordinary checkpoints against gradtap's CPU nodes
(:mod:`gradtap.netconfig.cost`), for the plan's CPU nodes and for a reference count (FlowCheck's
16 for the 175B layout), with what each CPU node must take at either count.

One dictionary (:func:`report_dict`, the JSON form) feeds both outputs; the shell
(``gradtap netconfig plan``) lays it out as tables. "Failure" is an iteration whose gradients cannot be recovered
from the mirrored streams; the job-level figures are the probability that any DP group
fails in an iteration, with groups independent.

The planner never loads a CPU port beyond its speed (times ``mirror.cpu_port_max_utilization``),
counting every source at line rate at once and ERSPAN's overhead. A port that several groups
share can still run full when their allgathers overlap; then one burst drops mirrored packets of
all of them, so their failures are not independent. The report warns about each such port. A
group's own streams are on distinct ports, so its P(fail) is unaffected; the job figure assumes
independent groups, and with correlated ones the truth stays below the sum of the groups' P(fail).
"""

from __future__ import annotations

import math

from gradtap.netconfig import vendors
from gradtap.netconfig.cost import DailyCost, daily_cost, input_sources
from gradtap.netconfig.plan import Plan
from gradtap.netconfig.reliability import iterations_between_failures, p_any_fails
from gradtap.netconfig.vendors.base import build_sessions, session_limit


def _iterations(p_fail: float | None) -> float | None:
    """Expected iterations between failures; None when it is unbounded (p = 0) or unknown."""
    if p_fail is None:
        return None
    value = iterations_between_failures(p_fail)
    return None if math.isinf(value) else value


#: A CPU port shared by several DP groups and loaded to this share of its speed or more is reported.
FULL_PORT = 0.9


def port_warnings(plan: Plan) -> list[str]:
    """CPU ports that several groups fill to FULL_PORT or more when all send at once: one line per
    utilization, naming the first such port and how many there are."""
    full: dict[str, list[str]] = {}
    for node in plan.cpu_nodes:
        for port in node.ports:
            share = port.load_gbps / port.speed_gbps
            groups = list(dict.fromkeys(port.groups))
            if len(groups) > 1 and share >= FULL_PORT:
                full.setdefault(f"{share:.0%}", []).append(
                    f"{node.name} {port.nic} ({port.load_gbps:.4g} of {port.speed_gbps:g} Gbps, {', '.join(groups)})")
    return [f"{len(ports)} CPU port(s) shared by several DP groups run at {share} when their allgathers overlap, "
            f"e.g. {ports[0]}: a burst beyond that drops mirrored packets of all of them at once, so their failures "
            f"are correlated (the job P(fail) assumes independent groups; the sum of the groups' P(fail) still bounds "
            f"it); lower mirror.cpu_port_max_utilization to keep headroom" for share, ports in full.items()]


def report_dict(plan: Plan) -> dict:
    mirror = plan.mirror
    groups = [{
        "id": g.id, "ranks": g.size, "cpu_nodes": [n.name for n in g.cpu_nodes],
        # Per node of the group: its rank, streams, load and the share of its mirrored bytes its peers
        # must send it (chunks its own streams lack of the shard it steps).
        "nodes": [{"name": n.name, "rank": n.rank, "sources": n.sources, "load_gbps": n.load_gbps,
                   "uncovered_chunks": n.uncovered_chunks, "exchange_share": n.exchange_share}
                  for n in g.cpu_nodes],
        "sources": [f"{s.name}: position {s.position} {s.direction} {s.switch} {s.port} -> {s.cpu_node} "
                    f"{s.cpu_nic} ({'local' if s.encapsulation == 'none' else s.encapsulation})" for s in g.sources],
        "min_chunk_coverage": min(g.coverage), "p_fail_exact": g.p_fail_exact, "p_fail_eq2": g.p_fail_eq2,
        "iterations_between_failures": _iterations(g.p_fail_exact),
    } for g in plan.groups]
    switches = []
    for sw in plan.switches:
        sources = plan.sources_on(sw.name)
        if not sources:
            continue
        spec = vendors.spec(sw.vendor)
        switches.append({"switch": sw.name, "vendor": sw.vendor, "sources": len(sources),
                         "sessions": len(build_sessions(spec, sw, sources, mirror)),
                         "session_limit": session_limit(spec, sw, mirror),
                         "free_ports": sw.ports_free})
    eq2 = [g.p_fail_eq2 for g in plan.groups]
    p_job = p_any_fails(g.p_fail_exact for g in plan.groups)
    p_job_eq2 = None if None in eq2 else p_any_fails(eq2)
    return {
        "topology": plan.topology, "loss_rate": mirror.loss_rate,
        "packets_per_iteration": mirror.packets_per_iteration,
        "sources_per_group": mirror.sources_per_group, "groups": groups, "switches": switches,
        "cpu_nodes": [{"name": n.name, "groups": n.groups, "load_gbps": n.load_gbps,
                       "capacity_gbps": n.capacity_gbps, "max_ingest_gbps": n.max_ingest_gbps,
                       "max_port_utilization": max((p.load_gbps / p.speed_gbps for p in n.ports), default=0.0)}
                      for n in plan.cpu_nodes],
        "cpu_port_max_utilization": mirror.cpu_port_max_utilization,
        "fabric": None if plan.fabric is None else plan.fabric.model_dump(),
        "erspan_routes": [f"{g.id} {s.name}: {s.erspan_route}" for g in plan.groups for s in g.sources
                          if s.erspan_route],
        "warnings": port_warnings(plan),
        "job": {"dp_groups": len(plan.groups), "mirror_groups": sum(g.spread for g in plan.groups),
                "p_fail_exact": p_job, "p_fail_eq2": p_job_eq2,
                "iterations_between_failures": _iterations(p_job)},
        "cost": cost_dict(plan),
    }


def _daily(cost: DailyCost) -> dict:
    return {"cpu_nodes": cost.cpu_nodes,
            "ordinary_usd_per_day": {"lost_work": cost.ordinary_lost_work, "stall": cost.ordinary_stall,
                                     "total": cost.ordinary},
            "gradtap_usd_per_day": {"cpu_nodes": cost.gradtap_cpu_nodes, "lost_work": cost.gradtap_lost_work,
                                    "total": cost.gradtap},
            "ratio": cost.ratio}


def node_sizing(plan: Plan, cpu_nodes: int) -> dict:
    """What each of ``cpu_nodes`` CPU nodes must take if the plan's DP groups were spread evenly
    over them, against the planner's rules: every stream at line rate at once, a group's streams on
    distinct ports, ports of the plan's own CPU-port speed filled to ``cpu_port_max_utilization``,
    and what the plan's CPU nodes take in (the smallest ``max_ingest_gbps``; null for older plans)."""
    groups_per_node = math.ceil(len(plan.groups) / cpu_nodes)
    limits = [n.max_ingest_gbps for n in plan.cpu_nodes]
    group_gbps = max(sum(s.load_gbps for s in g.sources) for g in plan.groups)
    port_gbps = max(p.speed_gbps for n in plan.cpu_nodes for p in n.ports) * plan.mirror.cpu_port_max_utilization
    gbps = groups_per_node * group_gbps
    return {"cpu_nodes": cpu_nodes, "dp_groups_per_node": groups_per_node,
            "streams_per_node": groups_per_node * plan.mirror.sources_per_group, "gbps_per_node": gbps,
            "port_gbps": port_gbps,
            "ports_per_node": max(math.ceil(gbps / port_gbps - 1e-9), plan.mirror.sources_per_group),
            "ingest_limit_gbps": None if None in limits else min(limits)}


def cost_dict(plan: Plan) -> dict:
    """The cost comparison (:mod:`gradtap.netconfig.cost`) for this plan's CPU nodes and, when the
    topology names one, for ``reference_cpu_nodes``, with the inputs, their sources and what each CPU
    node would have to take."""
    model = plan.cost
    gpus = sum(g.size for g in plan.groups)  # every rank is in exactly one DP group
    reference = model.reference_cpu_nodes
    nodes = len(plan.cpu_nodes)
    return {
        "inputs": model.model_dump(), "sources": input_sources(model), "gpus": gpus,
        "gpu_servers": gpus / model.gpus_per_server,
        "plan": _daily(daily_cost(model, gpus, nodes)),
        "reference": None if reference is None else _daily(daily_cost(model, gpus, reference)),
        # The plan's own nodes as planned (the busiest one), beside the even spread at the reference count.
        "sizing": {"plan": {**node_sizing(plan, nodes),
                            "dp_groups_per_node": max(len(n.groups) for n in plan.cpu_nodes),
                            "streams_per_node": max(sum(len(p.groups) for p in n.ports) for n in plan.cpu_nodes),
                            "gbps_per_node": max(n.load_gbps for n in plan.cpu_nodes),
                            "ports_per_node": max(len(n.ports) for n in plan.cpu_nodes),
                            "capacity_gbps_per_node": max(n.capacity_gbps for n in plan.cpu_nodes)},
                   "reference": None if reference is None else node_sizing(plan, reference)},
    }
