import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.topology import load_topology, parse_topology
from tests.netconfig.topologies import EXAMPLES, edited, one_leaf


def problems(doc: dict) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_topology(doc)
    return str(err.value).splitlines()


def three_leaves() -> dict:
    doc = one_leaf()
    doc["leaf_switches"] += [{"name": f"leaf{i}", "vendor": "eos",
                              "ports": [{"name": f"Ethernet{j}", "speed_gbps": 400} for j in range(8)]}
                             for i in (1, 2)]
    return doc


def test_a_bad_number_names_file_path_value_and_bound():
    assert problems(edited(three_leaves(), **{"leaf_switches.2.ports.5.speed_gbps": -1})) == [
        "topology.yaml: leaf_switches[2].ports[5].speed_gbps: -1 is not allowed (must be > 0)"]


def test_every_problem_is_reported_at_once():
    doc = edited(one_leaf(), **{"layout.dp": 1, "mirror.loss_rate": 2, "leaf_switches.0.vendor": "cisco"})
    lines = problems(doc)
    assert lines[0] == "topology.yaml: layout.dp: 1 is not allowed (must be >= 2)"
    assert "topology.yaml: mirror.loss_rate: 2 is not allowed (must be < 1)" in lines
    assert any(line.startswith("topology.yaml: leaf_switches[0].vendor: 'cisco' is not allowed (must be one of")
               for line in lines)


def test_unknown_and_missing_fields():
    doc = one_leaf()
    doc["mirror"]["loss"] = 1e-9
    del doc["mirror"]["loss_rate"]
    lines = problems(doc)
    assert "topology.yaml: mirror.loss_rate: is required but missing" in lines
    unknown = next(line for line in lines if line.startswith("topology.yaml: mirror.loss:"))
    assert "unknown field; allowed fields: loss_rate, packets_per_iteration" in unknown


def test_types_and_patterns():
    lines = problems(edited(one_leaf(), **{"layout.tp": "two", "leaf_switches.0.ports.1.linux_ifname": "a/b",
                                           "mirror.sources_per_group": 2}))
    assert "topology.yaml: layout.tp: 'two' is not allowed (must be an integer)" in lines
    assert any(line.startswith("topology.yaml: leaf_switches[0].ports[1].linux_ifname: 'a/b' is not allowed "
                               "(must match the pattern") for line in lines)
    assert "topology.yaml: mirror.sources_per_group: 2 is not allowed (must be >= 3)" in lines


@pytest.mark.parametrize("ifname", ["m0;reboot", "m0 x", "$(id)", "a`b`", "m0|sh", "..", ".", "sixteen-chars-xx",
                                    "m0&", "'m0'", "m0\\n"])
def test_interface_names_are_what_the_kernel_takes_and_carry_no_shell(ifname):
    lines = problems(edited(one_leaf(), **{"leaf_switches.0.ports.1.linux_ifname": ifname}))
    assert any(line.startswith("topology.yaml: leaf_switches[0].ports[1].linux_ifname:") for line in lines), lines


@pytest.mark.parametrize("ifname", ["m0", "eth0.100", "veth-a_1", "bond0+", "x" * 15])
def test_interface_names_the_kernel_takes_are_accepted(ifname):
    parse_topology(edited(one_leaf(), **{"leaf_switches.0.ports.1.linux_ifname": ifname}))


def test_order_must_be_a_permutation():
    assert problems(edited(one_leaf(), **{"layout.order": ["tp", "tp", "pp"]})) == [
        "topology.yaml: layout.order: ['tp', 'tp', 'pp'] is not allowed (must name tp, dp and pp once each)"]


def test_cabling_references_are_checked():
    doc = one_leaf()
    doc["gpu_nodes"][1]["gpus"][0]["port"] = "Ethernet99"
    doc["gpu_nodes"][2]["gpus"][0]["switch"] = "leaf9"
    doc["cpu_nodes"][0]["ports"][0]["port"] = "Ethernet3"  # already GPU 3's
    doc["leaf_switches"][0]["ports"][7]["uplink"] = True
    assert problems(doc) == [
        "topology.yaml: gpu_nodes[1].gpus[0].port: 'Ethernet99' is not a port of leaf switch 'leaf0'",
        "topology.yaml: gpu_nodes[2].gpus[0].switch: 'leaf9' is not a leaf switch of this topology (known: leaf0)",
        "topology.yaml: gpu_nodes[7].gpus[0].port: leaf0 Ethernet7 is an uplink and cannot be cabled to gpu7 nic0",
        "topology.yaml: cpu_nodes[0].ports[0].port: leaf0 Ethernet3 is already cabled to gpu3 nic0",
    ]


def test_sizes_ring_orders_and_names():
    doc = edited(one_leaf(), **{"layout.ring_order": [0, 1, 2, 3, 4, 5, 6, 6]})
    doc["layout"]["ring_order_by_group"] = {"tp1-pp0": list(range(8))}
    doc["gpu_nodes"][1]["name"] = "gpu0"
    doc["gpu_nodes"].pop()
    lines = problems(doc)
    assert "topology.yaml: gpu_nodes[1].name: 'gpu0' is used twice" in lines
    assert "topology.yaml: layout: dp 8 x tp 1 x pp 1 = 8 ranks, but gpu_nodes list 7 GPUs" in lines
    assert ("topology.yaml: layout.ring_order: [0, 1, 2, 3, 4, 5, 6, 6] is not allowed "
            "(must list each DP rank 0..7 once)") in lines
    assert ("topology.yaml: layout.ring_order_by_group.tp1-pp0: 'tp1-pp0' is not a DP group of this layout "
            "(ids look like 'tp0-pp0')") in lines


def test_duplicate_ports_and_linux_names():
    doc = one_leaf()
    doc["leaf_switches"][0]["ports"][1]["name"] = "Ethernet0"
    doc["leaf_switches"][0]["ports"][2]["linux_ifname"] = "eth0"
    doc["leaf_switches"][0]["ports"][3]["linux_ifname"] = "eth0"
    lines = problems(doc)
    assert "topology.yaml: leaf_switches[0].ports[1].name: 'Ethernet0' is used twice on switch 'leaf0'" in lines
    assert "topology.yaml: leaf_switches[0].ports[3].linux_ifname: 'eth0' names two ports of switch 'leaf0'" in lines


def test_not_a_mapping_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_topology([1, 2])
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: cannot read topology"):
        load_topology(bad)


def test_the_file_name_prefixes_messages(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("name: x\nlayout: {dp: 0}\n")
    with pytest.raises(ConfigError) as err:
        load_topology(path)
    assert str(err.value).startswith("cluster.yaml: layout.dp: 0 is not allowed (must be >= 2)")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_examples_load(path):
    topo = load_topology(path)
    layout = topo.layout
    assert sum(len(n.gpus) for n in topo.gpu_nodes) == layout.dp * layout.tp * layout.pp
