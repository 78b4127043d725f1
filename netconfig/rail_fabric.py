"""Expand a ``rail_fabric`` section into explicit GPU nodes, leaf switches and CPU nodes.

Rail-optimised clusters (FlowCheck's Table 2 layouts) connect GPU k of every node to the
rail-k leaf switch of the node's pod, so thousands of cables follow from a dozen numbers.
Names are generated so that plans and configs stay readable:

- leaf switch ``leaf-p{pod}-r{rail}``; its ports, in order: one GPU downlink per node of the
  pod, then the CPU-node ports, then the uplinks, then free ports;
- GPU node ``gpu{n:04d}`` with NICs ``rail0``..``rail{k}``;
- CPU node ``ckpt-p{pod}-r{rail}-{c}`` with NICs ``nic0``.., all cabled to that one leaf.
"""

from __future__ import annotations

import math

from gradtap.core.errors import ConfigError
from gradtap.netconfig.topology import CpuNode, CpuPort, GpuNic, GpuNode, LeafSwitch, RailFabric, SwitchPort, Topology
from gradtap.netconfig.validation import issue


def leaf_name(pod: int, rail: int) -> str:
    return f"leaf-p{pod}-r{rail}"


def _port_names(fabric: RailFabric, source: str) -> list[str]:
    try:
        names = [fabric.port_name_format.format(i=i * fabric.port_index_step, n=i + 1)
                 for i in range(fabric.leaf_ports)]
    except (KeyError, IndexError, ValueError):
        raise ConfigError(issue(source, ("rail_fabric", "port_name_format"),
                                f"{fabric.port_name_format!r} is not allowed (use only the fields {{i}} "
                                "and {n}, e.g. 'Ethernet{i}')")) from None
    if len(set(names)) != len(names):
        raise ConfigError(issue(source, ("rail_fabric", "port_name_format"),
                                f"{fabric.port_name_format!r} gives several ports the same name "
                                "(include {i} or {n})"))
    return names


def expand_rail_fabric(topo: Topology, source: str) -> Topology:
    """Return ``topo`` with its ``rail_fabric`` turned into explicit hardware lists."""
    fabric = topo.rail_fabric
    assert fabric is not None
    if topo.gpu_nodes or topo.leaf_switches or topo.cpu_nodes:
        raise ConfigError(issue(source, ("rail_fabric",), "cannot be combined with explicit gpu_nodes, "
                                "leaf_switches or cpu_nodes (use one or the other)"))
    cpu_ports = fabric.cpu_nodes_per_leaf * fabric.cpu_node_ports
    needed = fabric.nodes_per_leaf + cpu_ports + fabric.uplink_ports
    if needed > fabric.leaf_ports:
        raise ConfigError(issue(source, ("rail_fabric", "leaf_ports"),
                                f"{fabric.leaf_ports} is not allowed (must be >= {needed}: "
                                f"{fabric.nodes_per_leaf} GPU downlinks + {cpu_ports} CPU-node ports + "
                                f"{fabric.uplink_ports} uplinks)"))
    names = _port_names(fabric, source)
    pods = math.ceil(fabric.gpu_nodes / fabric.nodes_per_leaf)
    first_uplink = fabric.nodes_per_leaf + cpu_ports

    def port(index: int) -> SwitchPort:
        is_cpu = fabric.nodes_per_leaf <= index < first_uplink
        return SwitchPort(name=names[index],
                          speed_gbps=fabric.cpu_port_speed_gbps if is_cpu else fabric.gpu_port_speed_gbps,
                          uplink=first_uplink <= index < first_uplink + fabric.uplink_ports)

    leaves = [LeafSwitch(name=leaf_name(pod, rail), vendor=fabric.leaf_vendor,
                         ports=[port(i) for i in range(fabric.leaf_ports)],
                         max_mirror_sessions=fabric.max_mirror_sessions)
              for pod in range(pods) for rail in range(fabric.gpus_per_node)]
    gpu_nodes = [GpuNode(name=f"gpu{n:04d}",
                         gpus=[GpuNic(nic=f"rail{rail}", switch=leaf_name(n // fabric.nodes_per_leaf, rail),
                                      port=names[n % fabric.nodes_per_leaf])
                               for rail in range(fabric.gpus_per_node)])
                 for n in range(fabric.gpu_nodes)]
    cpu_nodes = [CpuNode(name=f"ckpt-p{pod}-r{rail}-{c}", max_dp_groups=fabric.cpu_node_max_dp_groups,
                         ports=[CpuPort(nic=f"nic{j}", switch=leaf_name(pod, rail),
                                        port=names[fabric.nodes_per_leaf + c * fabric.cpu_node_ports + j])
                                for j in range(fabric.cpu_node_ports)])
                 for pod in range(pods) for rail in range(fabric.gpus_per_node)
                 for c in range(fabric.cpu_nodes_per_leaf)]
    return topo.model_copy(update={"gpu_nodes": gpu_nodes, "leaf_switches": leaves, "cpu_nodes": cpu_nodes})
