"""The cost model: FlowCheck's comparison reproduced from FlowCheck's own inputs, each input
validated, the report's cost section, and why the 175B layout takes 48 CPU nodes, not 16."""

import json

import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.cost import CostModel, daily_cost
from gradtap.netconfig.plan import Plan, load_plan, save_plan
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.report import report_dict
from gradtap.netconfig.hardware import CpuNode
from gradtap.netconfig.topology import Topology, check_references, load_topology, parse_topology
from tests.netconfig.topologies import EXAMPLES, edited, one_leaf

#: FlowCheck (EuroSys '25), § on cost: 8xA100 server $30/h, CPU server with an RDMA NIC $1.37/h
#: (Alibaba Cloud, Sep 2024), 175B on 1536 GPUs, two failures a day, hourly checkpoints.
PAPER = dict(cpu_node_usd_per_hour=1.37, gpu_server_usd_per_hour=30, gpus_per_server=8,
             failures_per_day=2, checkpoint_interval_h=1, checkpoint_stall_s=0, gradtap_lost_s_per_failure=0)


def test_the_papers_figures_follow_from_the_papers_inputs():
    cost = daily_cost(CostModel(**PAPER), gpus=1536, cpu_nodes=16)
    assert cost.gpu_servers == 192
    # 192 servers x $30/h x (2 failures x 1/2 h) of lost work a day
    assert cost.ordinary_lost_work == 5760.0
    assert cost.ordinary_stall == 0.0
    assert cost.ordinary == 5760.0
    # 16 CPU nodes x $1.37/h x 24 h, no lost work: the paper's $526/day
    assert cost.gradtap_cpu_nodes == pytest.approx(526.08, abs=1e-9)
    assert round(cost.gradtap) == 526
    assert cost.ratio == pytest.approx(5760 / 526.08)


def test_the_defaults_are_the_papers_inputs():
    assert CostModel() == CostModel(**PAPER)


def test_stall_and_gradtap_lost_work():
    # 24 saves a day x 120 s stall x 192 servers x $30/h; gradtap: 2 failures x (60 s) of all servers
    model = CostModel(**{**PAPER, "checkpoint_stall_s": 120, "gradtap_lost_s_per_failure": 60})
    cost = daily_cost(model, gpus=1536, cpu_nodes=48)
    assert cost.ordinary_stall == pytest.approx(24 * 120 / 3600 * 192 * 30)  # $4,608
    assert cost.gradtap_lost_work == pytest.approx(2 * 60 / 3600 * 192 * 30)  # $192
    assert cost.gradtap == pytest.approx(48 * 1.37 * 24 + 192)
    # a longer interval halves the saves' stall and doubles the lost work
    slow = daily_cost(model.model_copy(update={"checkpoint_interval_h": 2}), gpus=1536, cpu_nodes=48)
    assert (slow.ordinary_stall, slow.ordinary_lost_work) == pytest.approx((cost.ordinary_stall / 2, 11520))


def test_the_shipped_175b_topology_carries_the_papers_inputs_and_reproduces_its_comparison():
    topo = load_topology(EXAMPLES / "gpt-175b-1536gpu.yaml")
    assert topo.cost == CostModel(**PAPER, reference_cpu_nodes=16)
    cost = report_dict(plan_topology(topo))["cost"]
    assert set(cost["sources"].values()) == {"topology"}
    assert cost["gpus"] == 1536 and cost["gpu_servers"] == 192
    assert cost["reference"]["ordinary_usd_per_day"]["total"] == 5760.0
    assert cost["reference"]["gradtap_usd_per_day"]["total"] == pytest.approx(526.08)
    assert cost["plan"]["cpu_nodes"] == 48
    assert cost["plan"]["gradtap_usd_per_day"]["total"] == pytest.approx(48 * 1.37 * 24)  # $1,578.24

    # Why 48: 96 DP groups x 3 egress streams x 400 Gbps = 115.2 Tbps at line rate; a CPU node of
    # the example has 3 x 800G ports (2.4 Tbps), so 2 groups each. At 16 nodes each must take 6
    # groups, 18 streams, 7.2 Tbps: 9 ports of 800G.
    assert cost["sizing"]["plan"] == {"cpu_nodes": 48, "dp_groups_per_node": 2, "streams_per_node": 6,
                                      "gbps_per_node": 2400.0, "port_gbps": 800.0, "ports_per_node": 3,
                                      "capacity_gbps_per_node": 2400.0, "ingest_limit_gbps": 2457.6}
    assert cost["sizing"]["reference"] == {"cpu_nodes": 16, "dp_groups_per_node": 6, "streams_per_node": 18,
                                           "gbps_per_node": 7200.0, "port_gbps": 800.0, "ports_per_node": 9,
                                           "ingest_limit_gbps": 2457.6}  # 7.2 Tb/s a node is beyond it


def test_16_cpu_nodes_fit_only_with_nine_800g_ports_each():
    """The planner packs six DP groups per CPU node when the hardware has the ports and the node
    says it takes 7.2 Tb/s in: each node cabled with three 800G ports to each of three leaves (the
    ports the 48-node layout gives one node per leaf). With the default ingest limit (2457.6 Gb/s,
    a two-socket server's memory bandwidth over two passes), or the example's three ports per
    node, 16 nodes cannot take the groups, and the refusal names the limit."""
    topo = load_topology(EXAMPLES / "gpt-175b-1536gpu.yaml")
    by_leaf: dict[str, list] = {}
    for node in topo.cpu_nodes:
        by_leaf.setdefault(node.ports[0].switch, []).extend(node.ports)
    leaves = sorted(by_leaf)
    assert len(leaves) == 48
    nine = [{"name": f"ckpt{i:02d}", "max_dp_groups": 6, "max_ingest_gbps": 7200,
             "ports": [{"nic": f"nic{j}", "switch": p.switch, "port": p.port}
                       for j, p in enumerate(p for leaf in leaves[3 * i:3 * i + 3] for p in by_leaf[leaf])]}
            for i in range(16)]
    packed = plan_topology(_with_cpu_nodes(topo, nine))
    assert len(packed.cpu_nodes) == 16
    assert {len(n.groups) for n in packed.cpu_nodes} == {6}
    assert {(n.load_gbps, n.capacity_gbps) for n in packed.cpu_nodes} == {(7200.0, 7200.0)}
    assert all(s.encapsulation == "none" for g in packed.groups for s in g.sources)
    assert report_dict(packed)["cost"]["plan"]["gradtap_usd_per_day"]["total"] == pytest.approx(526.08)

    default_ingest = [{k: v for k, v in n.items() if k != "max_ingest_gbps"} for n in nine]
    with pytest.raises(ConfigError, match=r"(?s)infeasible \(64 of 96 DP groups.*CPU node ckpt00 takes in at most "
                                          r"2457.6 Gbps \(cpu_nodes max_ingest_gbps\) and has 57.6 left"):
        plan_topology(_with_cpu_nodes(topo, default_ingest))
    three = [{**n, "ports": n["ports"][:3]} for n in nine]
    with pytest.raises(ConfigError, match=r"infeasible \(64 of 96 DP groups"):
        plan_topology(_with_cpu_nodes(topo, three))


def _with_cpu_nodes(topo: Topology, cpu_nodes: list[dict]) -> Topology:
    """``topo`` with its CPU nodes replaced, cross-checked as a topology file's would be."""
    topo = topo.model_copy(update={"cpu_nodes": [CpuNode.model_validate(n) for n in cpu_nodes]})
    assert check_references(topo, "test") == []
    return topo


def test_the_report_says_which_inputs_are_flowchecks_defaults():
    doc = one_leaf()
    doc["cost"] = {"gpu_server_usd_per_hour": 98.32}
    cost = report_dict(plan_topology(parse_topology(doc)))["cost"]
    assert cost["sources"]["gpu_server_usd_per_hour"] == "topology"
    assert cost["sources"]["cpu_node_usd_per_hour"] == "FlowCheck default"
    assert cost["reference"] is None and cost["sizing"]["reference"] is None


def test_a_saved_plan_keeps_which_inputs_were_given(tmp_path):
    doc = one_leaf()
    doc["cost"] = {"failures_per_day": 5}
    plan = plan_topology(parse_topology(doc))
    save_plan(plan, tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["cost"] == {"failures_per_day": 5.0}
    again = load_plan(tmp_path / "plan.json")
    assert report_dict(again)["cost"] == report_dict(plan)["cost"]


def test_a_plan_written_before_the_cost_section_still_loads(tmp_path):
    plan = plan_topology(parse_topology(one_leaf()))
    data = json.loads(plan.model_dump_json())
    del data["cost"]
    data["mirror"].update(cpu_node_price_per_hour=4.0, currency="USD")
    old = Plan.model_validate(data)
    assert report_dict(old)["cost"]["sources"]["cpu_node_usd_per_hour"] == "FlowCheck default"


@pytest.mark.parametrize("field, value, message", [
    ("cpu_node_usd_per_hour", -1, "cost.cpu_node_usd_per_hour: -1 is not allowed (must be >= 0; USD per hour "
                                  "for one CPU mirror node, e.g. 1.37 (FlowCheck))"),
    ("gpu_server_usd_per_hour", float("nan"), "cost.gpu_server_usd_per_hour: nan is not allowed (must be >= 0;"),
    ("failures_per_day", float("inf"), "cost.failures_per_day: inf is not allowed (must be finite;"),
    ("checkpoint_interval_h", 0, "cost.checkpoint_interval_h: 0 is not allowed (must be > 0 and finite; "
                                 "hours between ordinary checkpoints, e.g. 1 (FlowCheck))"),
    ("checkpoint_stall_s", -5, "cost.checkpoint_stall_s: -5 is not allowed (must be >= 0; seconds the GPUs"),
    ("gradtap_lost_s_per_failure", -1, "cost.gradtap_lost_s_per_failure: -1 is not allowed"),
    ("gpus_per_server", 0, "cost.gpus_per_server: 0 is not allowed (must be >= 1; GPUs per priced GPU server"),
    ("reference_cpu_nodes", 0, "cost.reference_cpu_nodes: 0 is not allowed (must be >= 1;"),
    ("gpus_per_server", "eight", "cost.gpus_per_server: 'eight' is not allowed (must be an integer)"),
    ("price", 1, "cost.price: unknown field; allowed fields: cpu_node_usd_per_hour,"),
])
def test_each_bad_input_is_named_with_its_value_and_fix(field, value, message):
    with pytest.raises(ConfigError) as err:
        parse_topology(edited(one_leaf(), **{"cost": {field: value}}))
    assert message in str(err.value)


def test_the_old_price_field_says_where_it_went():
    with pytest.raises(ConfigError) as err:
        parse_topology(edited(one_leaf(), **{"mirror.cpu_node_price_per_hour": 4.0}))
    assert "mirror: cpu_node_price_per_hour and currency moved to the cost: section" in str(err.value)


def test_the_cost_tables_fit_80_columns():
    import io

    from rich.console import Console

    from gradtap.commands.netconfig import print_cost

    out = io.StringIO()
    print_cost(report_dict(plan_topology(load_topology(EXAMPLES / "gpt-175b-1536gpu.yaml")))["cost"],
               Console(file=out, width=80))
    text = out.getvalue()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "526.08" in text and "5,760.00" in text and "1,578.24" in text and "10.95x" in text
    words = " ".join(text.split())
    assert "16 x 6 DP groups = 18 streams, 7,200 Gbps" in words
    # The plan's nodes fit the default ingest limit; FlowCheck's 16 would not.
    assert "3 ports of 800 Gbps; a node takes in 2,457.6 Gbps CPU nodes, reference" in words
    assert "9 ports of 800 Gbps; a node takes in 2,457.6 Gbps (exceeded)" in words
