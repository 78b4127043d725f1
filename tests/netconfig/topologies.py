"""Small topology documents for tests (plain dicts, as YAML would give them)."""

from __future__ import annotations

import copy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "configs" / "topologies"


def one_leaf(dp: int = 8, cpu_ports: int = 3, cpu_speed: float = 100, vendor: str = "sonic",
             directions: tuple[str, ...] = ("egress",), gpus_per_node: int = 1) -> dict:
    """``dp`` ranks on one leaf (``gpus_per_node`` per server) and one CPU node on the same leaf."""
    ports = [{"name": f"Ethernet{i}", "speed_gbps": 100} for i in range(dp)]
    ports += [{"name": f"Ethernet{100 + k}", "speed_gbps": cpu_speed} for k in range(cpu_ports)]
    nodes = [{"name": f"gpu{n}",
              "gpus": [{"nic": f"nic{g}", "switch": "leaf0", "port": f"Ethernet{n * gpus_per_node + g}"}
                       for g in range(gpus_per_node)]}
             for n in range(dp // gpus_per_node)]
    return {
        "name": "one-leaf",
        "layout": {"dp": dp},
        "mirror": {"loss_rate": 1e-9, "packets_per_iteration": 16e6, "directions": list(directions)},
        "leaf_switches": [{"name": "leaf0", "vendor": vendor, "ports": ports}],
        "gpu_nodes": nodes,
        "cpu_nodes": [{"name": "ckpt0", "ports": [{"nic": f"c{k}", "switch": "leaf0", "port": f"Ethernet{100 + k}"}
                                                  for k in range(cpu_ports)]}],
    }


def edited(doc: dict, **changes) -> dict:
    """A deep copy of ``doc`` with dotted-path changes applied: ``edited(d, **{"layout.dp": 4})``."""
    out = copy.deepcopy(doc)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return out
