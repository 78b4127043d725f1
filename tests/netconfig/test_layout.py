from gradtap.netconfig.layout import dp_groups, global_rank, seats
from gradtap.netconfig.topology import parse_topology
from tests.netconfig.topologies import edited, one_leaf


def two_by_four() -> dict:
    """dp 4 x tp 2 on four 2-GPU servers."""
    return edited(one_leaf(dp=8, gpus_per_node=2), **{"layout": {"dp": 4, "tp": 2}})


def test_megatron_order_puts_tensor_parallel_ranks_side_by_side():
    topo = parse_topology(two_by_four())
    assert [global_rank(topo, tp, dp, 0) for dp in range(4) for tp in range(2)] == list(range(8))
    (g0, g1) = dp_groups(topo)
    assert (g0.id, [s.global_rank for s in g0.seats]) == ("tp0-pp0", [0, 2, 4, 6])
    assert (g1.id, [s.node for s in g1.seats]) == ("tp1-pp0", ["gpu0", "gpu1", "gpu2", "gpu3"])
    assert all(g0.hop_on_network(h) for h in range(4))


def test_dp_fastest_order_keeps_dp_groups_inside_servers():
    topo = parse_topology(edited(two_by_four(), **{"layout.order": ["dp", "tp", "pp"]}))
    group = dp_groups(topo)[0]
    assert [s.node for s in group.seats] == ["gpu0", "gpu0", "gpu1", "gpu1"]
    assert [group.hop_on_network(h) for h in range(4)] == [False, True, False, True]


def test_ring_order_overrides():
    doc = two_by_four()
    doc["layout"]["ring_order"] = [0, 2, 1, 3]
    doc["layout"]["ring_order_by_group"] = {"tp1-pp0": [3, 2, 1, 0]}
    g0, g1 = dp_groups(parse_topology(doc))
    assert (g0.dp_ranks, [s.global_rank for s in g0.seats]) == ((0, 2, 1, 3), [0, 4, 2, 6])
    assert g1.dp_ranks == (3, 2, 1, 0)


def test_seats_carry_the_cabled_port_and_its_speed():
    topo = parse_topology(one_leaf(dp=4))
    assert [(s.global_rank, s.node, s.switch, s.port, s.speed_gbps) for s in seats(topo)][:2] == [
        (0, "gpu0", "leaf0", "Ethernet0", 100), (1, "gpu1", "leaf0", "Ethernet1", 100)]
