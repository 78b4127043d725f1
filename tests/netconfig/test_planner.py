from collections import defaultdict

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gradtap.core.errors import ConfigError
from gradtap.netconfig.job_specs import mirrors_section
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.reliability import p_fail_eq2
from gradtap.netconfig.ring import chunk_coverage, stream_hops
from gradtap.netconfig.report import report_dict
from gradtap.netconfig.topology import load_topology, parse_topology
from tests.netconfig.topologies import EXAMPLES, edited, one_leaf
from gradtap.workload.spec import MirrorSpec, load_job, parse_job


def plan_of(doc: dict):
    return plan_topology(parse_topology(doc))


def infeasible(doc: dict) -> str:
    with pytest.raises(ConfigError) as err:
        plan_of(doc)
    return str(err.value)


def test_flowcheck_testbed_mirrors_three_consecutive_egress_ports_locally():
    plan = plan_topology(load_topology(EXAMPLES / "flowcheck-testbed.yaml"))
    (group,) = plan.groups
    assert [(s.name, s.position, s.direction, s.port, s.cpu_nic, s.encapsulation) for s in group.sources] == [
        ("m0", 0, "egress", "HundredGigE1/0/1", "nic0", "none"),
        ("m1", 1, "egress", "HundredGigE1/0/2", "nic1", "none"),
        ("m2", 2, "egress", "HundredGigE1/0/3", "nic2", "none")]
    assert group.coverage == [3, 2, 2, 2, 3, 3, 3, 3]
    assert group.p_fail_exact == pytest.approx(6e-12, rel=1e-6)
    assert group.p_fail_eq2 == pytest.approx(group.p_fail_exact, rel=1e-12)


def test_erspan_reaches_a_cpu_node_on_another_leaf():
    plan = plan_topology(load_topology(EXAMPLES / "erspan-two-leaf.yaml"))
    sources = plan.groups[0].sources
    assert [(s.position, s.switch, s.encapsulation, s.erspan_dst_ip) for s in sources] == [
        (0, "leaf-a", "erspan2", "10.0.1.12"), (6, "leaf-b", "none", None), (7, "leaf-b", "none", None)]


def test_with_ingress_allowed_the_planner_never_mirrors_both_ends_of_one_link():
    plan = plan_of(one_leaf(directions=("ingress", "egress")))
    hops = [(s.position - (s.direction == "ingress")) % 8 for s in plan.groups[0].sources]
    assert len(set(hops)) == 3
    assert min(plan.groups[0].coverage) == 2


def test_both_directions_need_twice_the_capacity():
    plan = plan_of(one_leaf(directions=("both",), cpu_speed=200))
    assert {(s.direction, s.load_gbps) for s in plan.groups[0].sources} == {("both", 200)}
    assert plan.groups[0].p_fail_eq2 is None
    assert min(plan.groups[0].coverage) == 5  # six hop streams, each missing one chunk
    message = infeasible(one_leaf(directions=("both",), cpu_speed=100))
    assert "needs 3 mirror sources on distinct ports of one CPU node" in message
    assert "no unused port on leaf0 (or reachable by ERSPAN) has 200 Gbps free to mirror both" in message


def test_a_groups_sources_use_distinct_ports_but_groups_may_share_one():
    doc = edited(one_leaf(dp=8, cpu_ports=3, cpu_speed=200, gpus_per_node=1), **{"layout": {"dp": 4, "tp": 2}})
    doc["gpu_nodes"] = [{"name": f"gpu{n}", "gpus": [{"nic": f"nic{g}", "switch": "leaf0",
                                                      "port": f"Ethernet{2 * n + g}"} for g in range(2)]}
                        for n in range(4)]
    doc["cpu_nodes"][0]["max_dp_groups"] = 2
    plan = plan_of(doc)
    per_port = defaultdict(list)
    for g in plan.groups:
        assert len({s.cpu_nic for s in g.sources}) == 3
        for s in g.sources:
            per_port[s.cpu_nic].append(s.load_gbps)
    assert {port: sum(loads) for port, loads in per_port.items()} == {"c0": 200, "c1": 200, "c2": 200}
    assert [n.load_gbps for n in plan.cpu_nodes] == [600]


def test_infeasible_without_a_cpu_node_on_the_leaf():
    doc = one_leaf()
    doc["leaf_switches"].append({"name": "leaf1", "vendor": "sonic",
                                 "ports": [{"name": "Ethernet0", "speed_gbps": 100}]})
    doc["cpu_nodes"][0]["ports"] = [{"nic": "c0", "switch": "leaf1", "port": "Ethernet0"}]
    doc["mirror"]["erspan"] = {"allow": False}
    message = infeasible(doc)
    assert message.startswith("topology 'one-leaf' is infeasible (1 of 1 DP groups cannot be mirrored); "
                              "no plan was made:")
    assert ("DP group tp0-pp0 (8 ranks on leaf0): no CPU node with a free DP-group slot is cabled to leaf0, "
            "and mirror.erspan.allow is false") in message


def test_infeasible_with_too_few_ports_says_how_many_were_placed():
    message = infeasible(one_leaf(cpu_ports=2))
    assert "the best node, ckpt0, takes only 2" in message
    assert "no unused port on leaf0 (or reachable by ERSPAN) has 100 Gbps free to mirror egress" in message


def test_infeasible_when_the_switch_runs_out_of_sessions():
    doc = edited(one_leaf(), **{"leaf_switches.0.max_mirror_sessions": 2})
    assert "leaf0 (SONiC) would exceed its limit of 2 mirror sessions" in infeasible(doc)
    per_vendor = edited(one_leaf(), **{"mirror.session_limits": {"sonic": 1}})
    assert "leaf0 (SONiC) would exceed its limit of 1 mirror sessions" in infeasible(per_vendor)
    assert len(plan_of(edited(one_leaf(), **{"mirror.session_limits": {"eos": 1}})).groups[0].sources) == 3


def test_erspan_needs_a_capable_vendor_and_a_source_address():
    plan_doc = yaml.safe_load((EXAMPLES / "erspan-two-leaf.yaml").read_text())
    no_ip = edited(plan_doc, **{"leaf_switches.0.erspan_source_ip": None})
    assert "leaf-a has no erspan_source_ip for ERSPAN" in infeasible(no_ip)
    junos = edited(plan_doc, **{"leaf_switches.0.vendor": "junos"})
    assert "leaf-a runs Juniper Junos, which gradtap cannot configure for erspan2" in infeasible(junos)


def test_comware_erspan_needs_its_monitor_port_and_inbound_sources():
    plan_doc = edited(yaml.safe_load((EXAMPLES / "erspan-two-leaf.yaml").read_text()),
                      **{"leaf_switches.0.vendor": "comware"})
    assert [s.encapsulation for s in plan_of(plan_doc).groups[0].sources] == ["erspan2", "none", "none"]
    no_port = edited(plan_doc, **{"leaf_switches.0.erspan_monitor_port": None})
    assert ("leaf-a runs H3C Comware, whose ERSPAN leaves by a named port: set erspan_monitor_port to one of "
            "its uplinks") in infeasible(no_port)
    ingress = edited(plan_doc, **{"mirror.directions": ["ingress"]})
    assert ("leaf-a runs H3C Comware, whose ERSPAN takes only rx sources (switch-port view), not ingress"
            in infeasible(ingress))


def test_hops_inside_a_server_cannot_be_mirrored():
    doc = edited(one_leaf(dp=8, gpus_per_node=2), **{"layout.order": ["dp", "tp", "pp"]})
    plan = plan_of(doc)  # 4 servers x 2 GPUs: only the 4 inter-server hops leave a NIC
    assert {s.position % 2 for s in plan.groups[0].sources} == {1}
    four = edited(one_leaf(dp=8, gpus_per_node=4), **{"layout.order": ["dp", "tp", "pp"]})
    assert "only 2 ring positions send or receive in the allowed directions (egress) over the network" \
        in infeasible(four)


def test_every_cpu_node_full():
    doc = edited(one_leaf(dp=8, gpus_per_node=1), **{"layout": {"dp": 4, "tp": 2}})
    assert "every CPU node already hosts its max_dp_groups" in infeasible(doc)


@pytest.mark.parametrize("name", ["gpt-175b-1536gpu", "mt-nlg-530b-2240gpu", "gpt-1t-3072gpu"])
def test_table_2_plans_respect_capacity_sessions_and_independence(name):
    topo = load_topology(EXAMPLES / f"{name}.yaml")
    plan = plan_topology(topo)
    speed = {(sw.name, p.name): p.speed_gbps for sw in topo.leaf_switches for p in sw.ports}
    load = defaultdict(float)
    for g in plan.groups:
        assert len(g.sources) == 3 and len({(s.cpu_node, s.cpu_nic) for s in g.sources}) == 3
        assert [n.name for n in g.cpu_nodes] == [g.sources[0].cpu_node]
        assert {s.cpu_node for s in g.sources} == {g.sources[0].cpu_node}
        assert all(s.encapsulation == "none" and s.dest_switch == s.switch for s in g.sources)
        assert g.p_fail_eq2 == pytest.approx(p_fail_eq2(g.size, 3, topo.mirror.packets_per_iteration, 1e-9))
        for s in g.sources:
            load[s.dest_switch, s.dest_port] += s.load_gbps
    assert all(total <= speed[port] for port, total in load.items())
    for s in report_dict(plan)["switches"]:
        assert s["sessions"] <= s["session_limit"]


def test_mirror_sections_are_valid_job_spec_sections():
    plan = plan_topology(load_topology(EXAMPLES / "erspan-two-leaf.yaml"))
    section = mirrors_section(plan.groups[0])
    assert section == {"mirrors": [
        {"name": "m0", "rank": 0, "direction": "egress", "encapsulation": "erspan2"},
        {"name": "m1", "rank": 6, "direction": "egress", "encapsulation": "none"},
        {"name": "m2", "rank": 7, "direction": "egress", "encapsulation": "none"}]}
    for entry in section["mirrors"]:
        MirrorSpec.model_validate(entry)


def test_the_testbed_plan_drops_into_the_testbed_job_spec():
    plan = plan_topology(load_topology(EXAMPLES / "flowcheck-testbed.yaml"))
    job_path = EXAMPLES.parent / "flowcheck-testbed.yaml"
    job = yaml.safe_load(job_path.read_text())
    job.update(mirrors_section(plan.groups[0]))
    parsed = parse_job(job, source=str(job_path))
    assert [(m.name, m.rank, m.direction) for m in parsed.mirrors] == [(f"m{i}", i, "egress") for i in range(3)]
    assert load_job(job_path).world_size == plan.groups[0].size


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(2, 10), cpu_ports=st.integers(1, 5), cpu_speed=st.sampled_from([100, 200, 400]),
       directions=st.sets(st.sampled_from(["egress", "ingress", "both"]), min_size=1),
       limit=st.one_of(st.none(), st.integers(1, 6)), gpus_per_node=st.sampled_from([1, 2]))
def test_any_plan_keeps_the_rules_or_the_topology_is_refused(dp, cpu_ports, cpu_speed, directions, limit,
                                                            gpus_per_node):
    assume(dp % gpus_per_node == 0)
    doc = one_leaf(dp=dp, cpu_ports=cpu_ports, cpu_speed=cpu_speed, directions=tuple(sorted(directions)),
                   gpus_per_node=gpus_per_node)
    doc["layout"]["order"] = ["dp", "tp", "pp"]
    doc["leaf_switches"][0]["max_mirror_sessions"] = limit
    try:
        plan = plan_of(doc)
    except ConfigError as exc:
        assert "is infeasible" in str(exc) and "no plan was made" in str(exc)
        return
    (group,) = plan.groups
    sources = group.sources
    assert len(sources) == 3 and len({s.position for s in sources}) == 3
    assert len({s.cpu_nic for s in sources}) == 3
    assert all(s.load_gbps == 100 * (2 if s.direction == "both" else 1) <= cpu_speed for s in sources)
    assert all(s.direction in directions for s in sources)
    hops = [h for s in sources for h in stream_hops(s.position, s.direction, dp)]
    assert all(group.coverage[k] == chunk_coverage(dp, hops)[k] for k in range(dp))
    nodes = [f"gpu{(p // gpus_per_node)}" for p in range(dp)]
    assert all(nodes[h] != nodes[(h + 1) % dp] for h in hops)  # only hops that leave a server
    if len(set(hops)) == len(hops):
        assert min(group.coverage) >= len(hops) - 1
    for s in report_dict(plan)["switches"]:
        assert s["session_limit"] is None or s["sessions"] <= s["session_limit"]
