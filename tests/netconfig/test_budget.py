"""What the planner budgets: CPU-port capacity (with ERSPAN's overhead and the utilization cap), the
ERSPAN path through the routed fabric (path MTU, route, uplinks, spine), and the reason an
infeasible plan gives, which must be the true one."""

from __future__ import annotations

import pytest
import yaml

from gradtap.netconfig.encapsulation import mirrored_gbps, outer_ip_bytes, overhead_bytes
from gradtap.netconfig.planner import plan_topology
from gradtap.netconfig.report import report_dict
from gradtap.netconfig.topology import load_topology
from tests.netconfig.test_planner import infeasible, plan_of
from tests.netconfig.topologies import EXAMPLES, edited, one_leaf


def erspan_doc() -> dict:
    return yaml.safe_load((EXAMPLES / "erspan-two-leaf.yaml").read_text())


# --- headers: the numbers the budgets rest on -------------------------------------------------

def test_erspan_packet_sizes_by_type_and_outer_ip():
    # 4202 B frame + GRE 8 + ERSPAN II 8 / III 12 (+8 optional subheader) + IPv4 20 / IPv6 40
    assert outer_ip_bytes(4202, "erspan2", 4) == 4238
    assert outer_ip_bytes(4202, "erspan3", 4) == 4250
    assert outer_ip_bytes(4202, "erspan2", 6) == 4258
    assert outer_ip_bytes(4202, "erspan3", 6) == 4270
    assert overhead_bytes("none", 4) == 0
    assert overhead_bytes("erspan2", 4) == 14 + 4 + 20 + 8 + 8


def test_an_encapsulated_line_rate_stream_exceeds_line_rate():
    assert mirrored_gbps(400, 4202, "none") == 400
    # (4202 + 20 + 54) / (4202 + 20) of 400 Gbps
    assert mirrored_gbps(400, 4202, "erspan2") == pytest.approx(405.116, abs=1e-3)
    assert mirrored_gbps(400, 4202, "erspan3", 6) == pytest.approx(400 * (4222 + 86) / 4222)


# --- ERSPAN through L3 ------------------------------------------------------------------------

def test_the_plan_names_the_erspan_route_and_its_load_includes_the_header():
    plan = plan_topology(load_topology(EXAMPLES / "erspan-two-leaf.yaml"))
    (remote,) = [s for s in plan.groups[0].sources if s.encapsulation != "none"]
    assert remote.load_gbps == pytest.approx(405.116, abs=1e-3)
    assert remote.erspan_route == ("leaf-a uplink -> spine -> leaf-b Ethernet80 (10.0.1.12, in 10.0.1.0/24: "
                                   "fabric.routes[0]); 4238 B IPv4 packets <= path MTU 9100")
    assert plan.fabric is not None and plan.fabric.spine_load_gbps == pytest.approx(remote.load_gbps)
    assert report_dict(plan)["erspan_routes"] == [f"tp0-pp0 m0: {remote.erspan_route}"]


def test_erspan_without_a_described_fabric_is_refused():
    doc = erspan_doc()
    del doc["fabric"]
    assert ("ERSPAN from leaf-a to ckpt0 nic2 (10.0.1.12 on leaf-b) crosses the routed fabric, which the "
            "topology does not describe") in infeasible(doc)


@pytest.mark.parametrize("version,packet", [(2, 4238), (3, 4250)])
def test_erspan_over_the_path_mtu_is_refused_with_the_sizes(version, packet):
    doc = edited(erspan_doc(), **{"fabric.path_mtu": 4236, "mirror.erspan.version": version,
                                  "leaf_switches.0.vendor": "nxos"})
    assert (f"a 4202 B frame in ERSPAN{version} over IPv4 is a {packet} B packet, over fabric.path_mtu 4236"
            in infeasible(doc))
    fits = edited(doc, **{"fabric.path_mtu": packet})
    assert plan_of(fits).groups[0].sources[0].erspan_route.endswith(f"{packet} B IPv4 packets <= path MTU {packet}")


def test_erspan_needs_a_route_to_the_destination_on_its_leaf():
    doc = edited(erspan_doc(), **{"fabric.routes": [{"prefix": "10.9.0.0/16", "leaf": "leaf-b"}]})
    assert "no fabric.routes prefix holds 10.0.1.12, so the switch has no route to it" in infeasible(doc)
    wrong = edited(erspan_doc(), **{"fabric.routes": [{"prefix": "10.0.1.0/24", "leaf": "leaf-a"}]})
    assert "fabric.routes[0] routes 10.0.1.0/24 to leaf-a, not to leaf-b" in infeasible(wrong)
    unknown = edited(erspan_doc(), **{"fabric.routes": [{"prefix": "10.0.1.0/24", "leaf": "leaf-z"}]})
    assert "fabric.routes[0].leaf: 'leaf-z' is not a leaf switch of this topology" in infeasible(unknown)


def test_one_erspan_stream_must_fit_one_uplink_and_the_spine():
    thin = edited(erspan_doc(), **{"fabric.uplink_free_fraction": 0.5})
    assert ("405.1 Gbps of ERSPAN up leaf-a's uplinks, over the 400 Gbps free on one (ECMP may put every "
            "session on the same uplink)") in infeasible(thin)
    spine = edited(erspan_doc(), **{"fabric.spine_free_gbps": 400})
    assert "405.1 Gbps of ERSPAN across the spine, over fabric.spine_free_gbps 400" in infeasible(spine)
    doc = erspan_doc()
    for leaf in doc["leaf_switches"]:
        leaf["ports"] = [p for p in leaf["ports"] if not p.get("uplink")]
        leaf.pop("erspan_monitor_port", None)
    assert "leaf-a has no uplink port (uplink: true) for ERSPAN to cross the spine" in infeasible(doc)


def test_an_erspan_stream_does_not_fit_a_cpu_port_of_its_line_rate():
    doc = erspan_doc()
    for port in doc["leaf_switches"][1]["ports"]:
        if port["name"] in ("Ethernet64", "Ethernet72", "Ethernet80"):
            port["speed_gbps"] = 400
    message = infeasible(doc)
    # nic0 and nic1 took the two local streams; nic2 is free but 400 < 405.1
    assert ("no unused port on leaf-a (or reachable by ERSPAN) has 400 Gbps free to mirror egress (Gbps free: "
            "nic2 400 of 400 (needs 405.1 with ERSPAN2))") in message


# --- CPU-port oversubscription ----------------------------------------------------------------

def test_the_utilization_cap_keeps_headroom_and_says_so_with_numbers():
    doc = edited(one_leaf(), **{"mirror.cpu_port_max_utilization": 0.9})
    message = infeasible(doc)
    assert ("no unused port on leaf0 (or reachable by ERSPAN) has 100 Gbps free within "
            "mirror.cpu_port_max_utilization 0.9 to mirror egress (Gbps free: c0 90 of 100, c1 90 of 100, "
            "c2 90 of 100)") in message
    assert plan_of(edited(one_leaf(cpu_speed=200), **{"mirror.cpu_port_max_utilization": 0.5})).groups


def test_a_cpu_port_shared_by_two_groups_at_full_load_is_reported():
    plan = plan_topology(load_topology(EXAMPLES / "gpt-175b-1536gpu.yaml"))
    (warning,) = report_dict(plan)["warnings"]
    assert warning.startswith("144 CPU port(s) shared by several DP groups run at 100% when their allgathers "
                              "overlap, e.g. ckpt-p0-r0-0 nic0 (800 of 800 Gbps, tp0-pp0, tp0-pp1)")
    for node in plan.cpu_nodes:
        assert all(p.load_gbps <= p.speed_gbps for p in node.ports)
    assert report_dict(plan_topology(load_topology(EXAMPLES / "flowcheck-testbed.yaml")))["warnings"] == []


def test_two_groups_never_oversubscribe_a_port_they_share():
    doc = edited(one_leaf(dp=8, cpu_ports=3, cpu_speed=150), **{"layout": {"dp": 4, "tp": 2}})
    doc["gpu_nodes"] = [{"name": f"gpu{n}", "gpus": [{"nic": f"nic{g}", "switch": "leaf0",
                                                      "port": f"Ethernet{2 * n + g}"} for g in range(2)]}
                        for n in range(4)]
    doc["cpu_nodes"][0]["max_dp_groups"] = 2
    message = infeasible(doc)  # 3 ports x 150 Gbps: the second group's 100 Gbps streams do not fit
    assert "1 of 2 DP groups cannot be mirrored" in message
    assert "Gbps free: c0 50 of 150, c1 50 of 150, c2 50 of 150" in message


# --- the reason given is the true one ---------------------------------------------------------

def test_a_session_limit_is_not_reported_as_missing_bandwidth():
    message = infeasible(edited(one_leaf(), **{"leaf_switches.0.max_mirror_sessions": 2}))
    assert "leaf0 (SONiC) would exceed its limit of 2 mirror sessions" in message
    assert "Gbps free" not in message  # the third port was free; only the session limit stood in the way


def test_a_full_group_says_its_ports_are_taken():
    message = infeasible(one_leaf(cpu_ports=2))
    assert "each of the node's 2 ports already carries one of this group's streams" in message
