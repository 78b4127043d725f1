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
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from gradtap.core.errors import ConfigError
from gradtap.netconfig.hardware import (DEFAULT_MAX_INGEST_GBPS, CpuNode, CpuPort, GpuNic, GpuNode, LeafSwitch,
                                        SwitchPort, Vendor)
from gradtap.netconfig.validation import issue


class RailFabric(BaseModel):
    """A rail-optimised cluster: GPU k of every node is cabled to the rail-k leaf of its pod.

    Node ``n`` sits in pod ``n // nodes_per_leaf``; each pod has one leaf per rail. Leaf
    ports are used in this order: GPU downlinks, CPU-node ports, uplinks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    nodes_per_leaf: int = Field(ge=1)
    gpu_port_speed_gbps: float = Field(gt=0)
    leaf_vendor: Vendor
    leaf_ports: int = Field(ge=1)
    uplink_ports: int = Field(0, ge=0)
    #: Port names: ``{i}`` is the 0-based port index times ``port_index_step``, ``{n}`` is 1-based.
    port_name_format: str = "Ethernet{i}"
    port_index_step: int = Field(1, ge=1)
    max_mirror_sessions: int | None = Field(None, ge=1)
    cpu_nodes_per_leaf: int = Field(ge=1)
    cpu_node_ports: int = Field(ge=1)
    cpu_port_speed_gbps: float = Field(gt=0)
    cpu_node_max_dp_groups: int = Field(1, ge=1)
    cpu_node_max_ingest_gbps: float = Field(DEFAULT_MAX_INGEST_GBPS, gt=0)


class Hardware(NamedTuple):
    """The explicit lists a ``rail_fabric`` section stands for."""

    gpu_nodes: list[GpuNode]
    leaf_switches: list[LeafSwitch]
    cpu_nodes: list[CpuNode]


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


def expand_rail_fabric(fabric: RailFabric, source: str) -> Hardware:
    """The GPU nodes, leaf switches and CPU nodes that ``fabric`` describes; problems are
    reported against ``source`` (the topology file's name)."""
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
                         max_ingest_gbps=fabric.cpu_node_max_ingest_gbps,
                         ports=[CpuPort(nic=f"nic{j}", switch=leaf_name(pod, rail),
                                        port=names[fabric.nodes_per_leaf + c * fabric.cpu_node_ports + j])
                                for j in range(fabric.cpu_node_ports)])
                 for pod in range(pods) for rail in range(fabric.gpus_per_node)
                 for c in range(fabric.cpu_nodes_per_leaf)]
    return Hardware(gpu_nodes, leaves, cpu_nodes)
