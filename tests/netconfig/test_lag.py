"""LAGs (port-channels): a source on one mirrors its members' traffic; a destination on one is
refused, naming the port, the platform's rule and the fix; a LAG-like name must say what it is."""

from __future__ import annotations

import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.render import render_plan
from gradtap.netconfig.topology import parse_topology
from gradtap.netconfig.vendors import VENDORS
from tests.netconfig import vendor_rules
from tests.netconfig.topologies import one_leaf
from tests.netconfig.vendor_rules import Mirror

#: Each platform's LAG name for rank 0's NIC, cabled to two 50G members.
LAG = {"sonic": "PortChannel0010", "eos": "Port-Channel10", "nxos": "port-channel10", "comware": "Bridge-Aggregation10",
       "junos": "ae0", "nvue": "bond0", "linux": "bond0"}


def lag_doc(vendor: str = "sonic") -> dict:
    """one_leaf with rank 0's NIC on a LAG of Ethernet200 + Ethernet201 (2 x 50G)."""
    doc = one_leaf(vendor=vendor)
    ports = doc["leaf_switches"][0]["ports"]
    ports += [{"name": "Ethernet200", "speed_gbps": 50}, {"name": "Ethernet201", "speed_gbps": 50},
              {"name": LAG[vendor], "speed_gbps": 100, "lag_members": ["Ethernet200", "Ethernet201"]}]
    doc["gpu_nodes"][0]["gpus"][0]["port"] = LAG[vendor]
    if vendor == "linux":
        for port in ports:
            port["linux_ifname"] = port["name"].replace("Ethernet", "e")
    return doc


def refused(doc: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_topology(doc)
    return str(err.value)


def test_a_lag_destination_is_refused_with_the_platforms_rule_and_the_fix():
    doc = lag_doc()
    doc["gpu_nodes"][0]["gpus"][0]["port"] = "Ethernet0"
    doc["cpu_nodes"][0]["ports"][0]["port"] = "PortChannel0010"
    message = refused(doc)
    assert ("cpu_nodes[0].ports[0].port: leaf0 PortChannel0010 is a LAG, and a mirror destination must be one physical "
            "port: SONiC's `config mirror_session span add` refuses it") in message
    assert "cable ckpt0 c0 to a port outside any LAG" in message
    linux = lag_doc("linux")
    linux["gpu_nodes"][0]["gpus"][0]["port"] = "Ethernet0"
    linux["cpu_nodes"][0]["ports"][0]["port"] = "bond0"
    assert "tc mirred to a bond sends each copy out of one slave" in refused(linux)
    eos = lag_doc("eos")
    eos["gpu_nodes"][0]["gpus"][0]["port"] = "Ethernet0"
    eos["cpu_nodes"][0]["ports"][0]["port"] = "Port-Channel10"
    assert "gradtap renders no LAG destination for this platform (not confirmed in its documentation)" in refused(eos)
    comware = lag_doc("comware")
    comware["gpu_nodes"][0]["gpus"][0]["port"] = "Ethernet0"
    comware["cpu_nodes"][0]["ports"][0]["port"] = "Bridge-Aggregation10"
    assert "aggregate interface cannot be configured as the monitor port" in refused(comware)


def test_a_lag_member_is_not_cabled_by_itself():
    doc = lag_doc()
    doc["cpu_nodes"][0]["ports"][0]["port"] = "Ethernet200"
    assert ("leaf0 Ethernet200 is a member of LAG PortChannel0010; cable ckpt0 c0 to PortChannel0010 or take "
            "Ethernet200 out of its lag_members") in refused(doc)


@pytest.mark.parametrize("name", ["Port-Channel10", "port-channel7", "PortChannel0010", "ae0", "bond1",
                                  "Bridge-Aggregation3", "Po12"])
def test_a_lag_name_without_members_does_not_pass_unchecked(name):
    doc = one_leaf()
    doc["leaf_switches"][0]["ports"].append({"name": name, "speed_gbps": 100})
    assert f"{name!r} names a LAG (port-channel, ae, PortChannel, bond, ...); list its member ports in lag_members" \
        in refused(doc)


def test_lag_members_exist_once_and_add_up_to_its_speed():
    doc = lag_doc()
    lag = doc["leaf_switches"][0]["ports"][-1]
    lag["lag_members"] = ["Ethernet200", "Ethernet999", "Ethernet200"]
    message = refused(doc)
    assert "lag_members[1]: 'Ethernet999' is not a port of leaf switch 'leaf0'" in message
    assert "lag_members[2]: 'Ethernet200' is already a member of PortChannel0010" in message
    assert "speed_gbps: 100 is not allowed (the members of PortChannel0010 add up to 50 Gbps)" in message


@pytest.mark.parametrize("vendor", list(VENDORS))
def test_a_source_on_a_lag_mirrors_its_members_or_the_lag_where_the_platform_takes_it(vendor):
    plan = plan_topology(parse_topology(lag_doc(vendor)))
    (lagged,) = [s for s in plan.groups[0].sources if s.port == LAG[vendor]]
    assert lagged.lag_members == ["Ethernet200", "Ethernet201"] and lagged.load_gbps == 100
    (config,) = render_plan(plan)
    ifname = (lambda p: p.replace("Ethernet", "e")) if vendor == "linux" else (lambda p: p)
    ports = {ifname(p["name"]) for p in lag_doc(vendor)["leaf_switches"][0]["ports"]}
    result = vendor_rules.check(vendor, config.apply, config.teardown, ports)
    assert not result.problems, result.problems
    # SONiC's src_port takes a PortChannel (sonic-mirror-session.yang); the others mirror the members.
    shown = [LAG[vendor]] if vendor == "sonic" else ["Ethernet200", "Ethernet201"]
    dest = ifname(lagged.dest_port)
    assert {m for m in result.mirrors if m.destination == dest} == {Mirror(ifname(p), "rx", dest) for p in shown}
