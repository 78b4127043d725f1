import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.layout import dp_groups
from gradtap.netconfig.topology import load_topology, parse_topology
from tests.netconfig.topologies import EXAMPLES


def fabric_doc(**fabric) -> dict:
    base = {"gpu_nodes": 8, "gpus_per_node": 2, "nodes_per_leaf": 4, "gpu_port_speed_gbps": 400,
            "leaf_vendor": "sonic", "leaf_ports": 8, "uplink_ports": 2, "cpu_nodes_per_leaf": 1,
            "cpu_node_ports": 2, "cpu_port_speed_gbps": 800}
    return {"name": "fab", "layout": {"dp": 4, "tp": 2, "pp": 2},
            "mirror": {"loss_rate": 1e-9, "packets_per_iteration": 1e6}, "rail_fabric": {**base, **fabric}}


def test_expansion_cables_rail_k_of_each_node_to_its_pods_rail_k_leaf():
    topo = parse_topology(fabric_doc())
    assert [sw.name for sw in topo.leaf_switches] == ["leaf-p0-r0", "leaf-p0-r1", "leaf-p1-r0", "leaf-p1-r1"]
    node5 = topo.gpu_nodes[5]
    assert (node5.name, [(g.nic, g.switch, g.port) for g in node5.gpus]) == (
        "gpu0005", [("rail0", "leaf-p1-r0", "Ethernet1"), ("rail1", "leaf-p1-r1", "Ethernet1")])
    leaf = topo.leaf_switches[0]
    assert [(p.name, p.speed_gbps, p.uplink) for p in leaf.ports[3:]] == [
        ("Ethernet3", 400, False), ("Ethernet4", 800, False), ("Ethernet5", 800, False),
        ("Ethernet6", 400, True), ("Ethernet7", 400, True)]
    assert [(c.name, [(p.switch, p.port) for p in c.ports]) for c in topo.cpu_nodes[:1]] == [
        ("ckpt-p0-r0-0", [("leaf-p0-r0", "Ethernet4"), ("leaf-p0-r0", "Ethernet5")])]


def test_port_budget_and_format_errors_name_the_rail_fabric_field():
    with pytest.raises(ConfigError) as err:
        parse_topology(fabric_doc(leaf_ports=7))
    assert str(err.value) == ("topology.yaml: rail_fabric.leaf_ports: 7 is not allowed (must be >= 8: "
                              "4 GPU downlinks + 2 CPU-node ports + 2 uplinks)")
    with pytest.raises(ConfigError, match=r"rail_fabric.port_name_format: 'swp\{x\}' is not allowed"):
        parse_topology(fabric_doc(port_name_format="swp{x}"))
    with pytest.raises(ConfigError, match="gives several ports the same name"):
        parse_topology(fabric_doc(port_name_format="swp"))


def test_rail_fabric_excludes_explicit_hardware():
    doc = fabric_doc()
    doc["cpu_nodes"] = [{"name": "x", "ports": [{"nic": "n", "switch": "leaf-p0-r0", "port": "Ethernet4"}]}]
    with pytest.raises(ConfigError, match="rail_fabric: cannot be combined with explicit"):
        parse_topology(doc)


@pytest.mark.parametrize("name,gpus,leaves,groups,group_size", [
    ("gpt-175b-1536gpu", 1536, 48, 96, 16),
    ("mt-nlg-530b-2240gpu", 2240, 72, 280, 8),
    ("gpt-1t-3072gpu", 3072, 96, 512, 6),
])
def test_table_2_layouts(name, gpus, leaves, groups, group_size):
    topo = load_topology(EXAMPLES / f"{name}.yaml")
    assert sum(len(n.gpus) for n in topo.gpu_nodes) == gpus
    assert len(topo.leaf_switches) == leaves
    found = dp_groups(topo)
    assert (len(found), {g.size for g in found}) == (groups, {group_size})
    # Tensor parallelism fills a server, so every DP group has one GPU per server on one rail.
    for g in found:
        assert len({s.node for s in g.seats}) == group_size
        assert len({s.nic for s in g.seats}) == 1
