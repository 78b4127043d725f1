"""The appliances' job-spec sections a plan implies: one per DP group, or, for a group whose
streams arrive at several CPU nodes, one per node with its ``appliance.mirror_group``.

Every node of a mirror group lists the same ``mirrors:`` in the same order (the group merger
takes a block an owner lacks from the streams that hold it in turn, in job order) and captures only its own
streams. Its ``mirror_group`` gives its rank (the group's nodes sorted by name), the group's size,
the rendezvous, the timeout and every node's streams by rank, from which the nodes choose which
buckets each steps so that each lacks least (``workload/shards.py``; docs/group.md)::

    appliance:
      mirror_group: {rank: 1, world_size: 2, rendezvous: "tcp://10.0.9.1:29500", timeout_s: 60,
                     streams: [[m0, m1], [m2]]}

The rendezvous is ``tcp://HOST:PORT`` of the rank-0 node (its topology ``address``, else its
name as a host name), ports counted up from :attr:`Rendezvous.port_base` so that no two groups
whose rank 0 is on one node share one; or ``file:///DIR/gradtap-TOPOLOGY-GROUP`` when the
operator names a directory every node mounts. ``interface`` is the node's ``group_interface``.
A group on one node gets no ``mirror_group``: one appliance, as before mirror groups.

With the operator's own job spec (:func:`complete_job`), a section becomes a whole job spec,
validated by :func:`gradtap.workload.spec.parse_job` before it is written.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

from gradtap.core.errors import ConfigError
from gradtap.netconfig.plan import CpuNodeUse, GroupPlan, Plan
from gradtap.workload.spec import dump_job, load_job, parse_job

#: torch.distributed's default rendezvous port (MASTER_PORT in its env:// examples, torchrun's
#: --master-port); the first group whose rank 0 is on a node listens here, the next one up.
DEFAULT_PORT_BASE = 29500
#: MirrorGroupSpec's default timeout, seconds.
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Rendezvous:
    """Where a mirror group's nodes meet: TCP on the rank-0 node from ``port_base`` up, or a file in
    ``shared_dir`` (an absolute path every CPU node mounts); ``timeout_s`` for every wait."""

    port_base: int = DEFAULT_PORT_BASE
    shared_dir: PurePosixPath | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 1 <= self.port_base <= 65535:
            raise ConfigError(f"--rendezvous-port {self.port_base} is not a TCP port (give 1..65535, e.g. "
                              f"{DEFAULT_PORT_BASE})")
        if self.shared_dir is not None:
            text = str(self.shared_dir)
            if not self.shared_dir.is_absolute() or any(c.isspace() for c in text):
                raise ConfigError(f"--rendezvous-dir {text!r} is not an absolute path without spaces (give the "
                                  "directory every CPU node mounts, e.g. /shared/gradtap)")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"--group-timeout {self.timeout_s} is not allowed (give seconds > 0, e.g. 60)")


@dataclass(frozen=True)
class SpecFile:
    """One job-spec section file: for a group (``node`` is its only node) or one node of a group."""

    #: Path under the plan directory: ``mirrors/GROUP.yaml`` or ``mirrors/GROUP.NODE.yaml``.
    path: str
    group: GroupPlan
    node: str
    #: ``mirrors:`` and, for a mirror group, ``appliance: {mirror_group: ...}``.
    section: dict[str, Any]
    #: What the file's comment header says: where each stream is captured, what this node does.
    comments: tuple[str, ...]

    def text(self) -> str:
        return "".join(f"# {line}\n" for line in self.comments) + yaml.safe_dump(self.section, sort_keys=False)


def mirrors_section(group: GroupPlan) -> dict:
    """The job spec's ``mirrors:`` section for the appliance(s) of ``group``.

    ``rank`` is the ring position (equal to the DP rank under NCCL's default ring order).
    """
    return {"mirrors": [{"name": s.name, "rank": s.position, "direction": s.direction,
                         "encapsulation": s.encapsulation} for s in group.sources]}


def _host(node: CpuNodeUse) -> str:
    host = node.address or node.name
    return f"[{host}]" if ":" in host else host


def rendezvous_urls(plan: Plan, rendezvous: Rendezvous) -> dict[str, str]:
    """Group id -> rendezvous URL, for every group spread over several nodes."""
    nodes = {n.name: n for n in plan.cpu_nodes}
    urls: dict[str, str] = {}
    listening: Counter[str] = Counter()
    for group in plan.groups:
        if not group.spread:
            continue
        if rendezvous.shared_dir is not None:
            urls[group.id] = f"file://{rendezvous.shared_dir}/gradtap-{plan.topology}-{group.id}"
            continue
        first = group.cpu_nodes[0].name
        port = rendezvous.port_base + listening[first]
        listening[first] += 1
        if port > 65535:
            raise ConfigError(f"--rendezvous-port {rendezvous.port_base}: CPU node {first} is rank 0 of "
                              f"{listening[first]} mirror groups, which need ports up to {port}, beyond 65535; "
                              f"give a base of at most {65536 - listening[first]}, or --rendezvous-dir")
        urls[group.id] = f"tcp://{_host(nodes[first])}:{port}"
    return urls


def _stream_lines(group: GroupPlan) -> list[str]:
    lines = []
    for s in group.sources:
        how = "switch-local SPAN" if s.encapsulation == "none" else (
            f"{s.encapsulation.upper()} from {s.switch} to {s.erspan_dst_ip}; the appliance opens GRE/ERSPAN itself")
        lines.append(f"{s.name}: {s.node} {s.nic} ({s.switch} {s.port}) {s.direction} -> "
                     f"{s.cpu_node} {s.cpu_nic} via {how}")
    return lines


def spec_files(plan: Plan, rendezvous: Rendezvous = Rendezvous()) -> list[SpecFile]:
    """Every job-spec section file of ``plan``: one per single-node group, one per node of a spread
    group (in rank order)."""
    urls = rendezvous_urls(plan, rendezvous)
    nodes = {n.name: n for n in plan.cpu_nodes}
    files = []
    for group in plan.groups:
        head = f"Mirror streams of DP group {group.id} (topology {plan.topology}), written by `gradtap netconfig plan`."
        streams = _stream_lines(group)
        if not group.spread:
            (only,) = group.cpu_nodes
            files.append(SpecFile(f"mirrors/{group.id}.yaml", group, only.name, mirrors_section(group),
                                  (head, f"The gradtap appliance for this group runs on CPU node {only.name}.",
                                   *streams)))
            continue
        for member in group.cpu_nodes:
            node = nodes[member.name]
            section: dict[str, Any] = {
                **mirrors_section(group),
                "appliance": {"mirror_group": {
                    "rank": member.rank, "world_size": len(group.cpu_nodes), "rendezvous": urls[group.id],
                    "timeout_s": rendezvous.timeout_s, "streams": [n.sources for n in group.cpu_nodes],
                    **({"interface": node.group_interface} if node.group_interface else {})}}}
            nics = {s.name: s.cpu_nic for s in group.sources}
            mine = ", ".join(f"{name} (NIC {nics[name]})" for name in member.sources)
            lacks = ("its streams carry every allgather chunk, so its peers send it almost nothing (coverage "
                     "bitmaps and digests)" if not member.uncovered_chunks else
                     f"its streams lack allgather chunk(s) {', '.join(map(str, member.uncovered_chunks))} of every "
                     f"bucket, which its peers send it: about {member.exchange_share:.2%} of its mirrored bytes")
            where = ("" if node.address else f"; the topology gives {member.name} no address, so its name is the "
                     "rendezvous host")
            files.append(SpecFile(
                f"mirrors/{group.id}.{member.name}.yaml", group, member.name, section,
                (head, f"CPU node {member.name} is rank {member.rank} of the group's {len(group.cpu_nodes)} nodes "
                       f"({', '.join(n.name for n in group.cpu_nodes)}){where}.",
                 f"Every node lists all {len(group.sources)} streams, in this order; this one captures {mine}: "
                 "gradtap run JOB " + " ".join(f"--stream {n}=IFACE" for n in member.sources) + ".",
                 f"Expected exchange: {lacks}.", *streams)))
    return files


def job_document(path: str) -> dict[str, Any]:
    """The operator's job spec at ``path``, loaded and validated, as a document whose relative
    paths are resolved (so that the complete specs written elsewhere still find its files)."""
    return yaml.safe_load(dump_job(load_job(path)))


def complete_job(job: dict[str, Any], file: SpecFile, source: str) -> str:
    """``job`` (a job-spec document, see :func:`job_document`) with the file's ``mirrors:`` and
    ``appliance.mirror_group``, validated; ``source`` names the job spec in errors."""
    ranks = job.get("ring", {}).get("ranks", []) if isinstance(job.get("ring"), dict) else []
    if len(ranks) != file.group.size:
        raise ConfigError(f"{source}: ring.ranks lists {len(ranks)} ranks, but DP group {file.group.id} has "
                          f"{file.group.size}; give each group the job spec of its own ring (--job with {{group}})")
    doc = copy.deepcopy(job)
    doc["mirrors"] = file.section["mirrors"]
    appliance = dict(doc.get("appliance") or {})
    appliance.pop("mirror_group", None)
    appliance.update(file.section.get("appliance", {}))
    doc["appliance"] = appliance
    parse_job(doc, f"{source} with the plan's sections for {file.group.id} on {file.node}")
    # The document as validated (libyaml's emitter where PyYAML has it: a Table 2 plan writes hundreds).
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return "".join(f"# {line}\n" for line in file.comments) + yaml.dump(doc, Dumper=dumper, sort_keys=False)
