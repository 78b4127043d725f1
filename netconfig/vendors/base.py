"""What every vendor renderer shares: its documented constraints and session grouping.

A *session* is one configured mirror session on a switch (SONiC ``MIRROR_SESSION``, EOS or
NX-OS ``monitor session``, Comware ``mirroring-group``, Junos ``analyzer``, NVUE
``port-mirror session``, one tc filter per Linux hook). Sources that share a destination
share a session; vendors that fix one direction per session (SONiC, NVUE) split by
direction, and NVUE, which has no "both", splits a "both" source into an RX and a TX
session. The planner counts sessions with the same function, so a plan that fits a
switch's session limit renders within it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from gradtap.core.errors import ConfigError
from gradtap.netconfig.hardware import LeafSwitch
from gradtap.netconfig.plan import PlannedSource, SwitchInfo
from gradtap.netconfig.topology import Direction, MirrorPolicy

SwitchDirection = Literal["rx", "tx", "both"]
#: GPU-NIC view -> switch-port view: what the NIC transmits, the switch port receives.
SWITCH_DIRECTION: dict[str, SwitchDirection] = {"egress": "rx", "ingress": "tx", "both": "both"}


@dataclass(frozen=True)
class VendorSpec:
    """A platform's documented mirror-session constraints (see docs/netconfig.md for sources)."""

    name: str
    title: str
    #: Default session limit when the switch gives none (None: no limit).
    max_sessions: int | None
    #: Inclusive range of session numbers, for platforms with numbered sessions.
    session_numbers: tuple[int, int] | None
    #: Full-match pattern of a session name, for platforms with named sessions.
    name_pattern: str | None
    #: Encapsulations this renderer can produce: "none" and the ERSPAN versions.
    encapsulations: frozenset[str]
    #: All sources of a session share one direction (SONiC MIRROR_SESSION, NVUE).
    direction_per_session: bool
    #: False: the platform has no "both" keyword, a "both" source needs an RX and a TX session.
    has_both: bool
    #: Switch-port directions an ERSPAN session may mirror.
    erspan_directions: frozenset[str] = frozenset({"rx", "tx", "both"})
    #: ERSPAN sessions leave by a port the config names (``erspan_monitor_port``).
    erspan_monitor_port: bool = False
    #: ERSPAN destinations per switch (None: only the session limit counts).
    max_erspan_sessions: int | None = None
    #: A LAG source is configured as the LAG itself; False: as its member ports.
    lag_source: bool = False


@dataclass(frozen=True)
class ErspanTarget:
    dst_ip: str
    src_ip: str
    version: int
    dscp: int
    ttl: int


@dataclass(frozen=True)
class Member:
    """One source port of a session, in the switch port's view."""

    port: str
    direction: SwitchDirection
    source: PlannedSource


@dataclass(frozen=True)
class Session:
    index: int
    #: Session name (named platforms) or number (numbered platforms).
    id: str | int
    #: SPAN destination port, or None for ERSPAN.
    destination: str | None
    erspan: ErspanTarget | None
    #: Shared direction, for platforms with one direction per session; else None.
    direction: SwitchDirection | None
    members: tuple[Member, ...]


@dataclass(frozen=True)
class SwitchConfig:
    """Rendered text for one switch: file suffix -> contents, to apply and to undo."""

    switch: str
    vendor: str
    apply: dict[str, str]
    teardown: dict[str, str]


def _legs(spec: VendorSpec, direction: Direction) -> tuple[SwitchDirection, ...]:
    sw = SWITCH_DIRECTION[direction]
    return ("rx", "tx") if sw == "both" and not spec.has_both else (sw,)


def session_keys(spec: VendorSpec, sources: Iterable[tuple[str, Direction]]) -> list[tuple[str, str | None]]:
    """Distinct session keys for (destination key, NIC direction) pairs, in first-seen order."""
    keys: dict[tuple[str, str | None], None] = {}
    for dest, direction in sources:
        for leg in _legs(spec, direction):
            keys[dest, leg if spec.direction_per_session else None] = None
    return list(keys)


def destination_key(source: PlannedSource) -> str:
    return source.dest_port if source.encapsulation == "none" else f"erspan:{source.erspan_dst_ip}"


#: A non-ELS Junos EX switch has one analyzer (``ethernet-switching-options analyzer``).
NON_ELS_ANALYZERS = 1


def session_limit(spec: VendorSpec, switch: LeafSwitch | SwitchInfo, policy: MirrorPolicy) -> int | None:
    """The switch's own limit, else the policy's limit for the vendor, else the vendor default;
    always one on a non-ELS Junos switch."""
    if spec.name == "junos" and not switch.junos_els:
        return NON_ELS_ANALYZERS
    return switch.max_mirror_sessions or policy.session_limits.get(spec.name) or spec.max_sessions


def build_sessions(spec: VendorSpec, switch: SwitchInfo, sources: list[PlannedSource],
                   policy: MirrorPolicy) -> list[Session]:
    """Group ``switch``'s sources into sessions, name or number them, and check the platform's limits."""
    for src in sources:
        if src.encapsulation not in spec.encapsulations:
            can = sorted(spec.encapsulations - {"none"}) or ["no ERSPAN"]
            raise ConfigError(f"{spec.title} on {switch.name}: source {src.group}/{src.name} ({src.port}) needs "
                              f"{src.encapsulation} because CPU node {src.cpu_node} is cabled to "
                              f"{src.dest_switch}, not {src.switch}; {spec.title} renders {', '.join(can)}")
    for src in sources:
        if src.encapsulation != "none" and SWITCH_DIRECTION[src.direction] not in spec.erspan_directions:
            raise ConfigError(f"{spec.title} on {switch.name}: source {src.group}/{src.name} ({src.port}) is mirrored "
                              f"{SWITCH_DIRECTION[src.direction]} through ERSPAN, but {spec.title}'s ERSPAN takes "
                              f"only {'/'.join(sorted(spec.erspan_directions))} sources")
    keys = session_keys(spec, ((destination_key(s), s.direction) for s in sources))
    limit = session_limit(spec, switch, policy)
    if limit is not None and len(keys) > limit:
        hint = (f"set leaf_switches[].max_mirror_sessions or mirror.session_limits.{spec.name} if the ASIC "
                f"allows more" if switch.junos_els or spec.name != "junos" else
                "a non-ELS EX switch (ethernet-switching-options analyzer) has one analyzer; give its sources "
                "one CPU port, or set leaf_switches[].junos_els: true if it runs ELS")
        raise ConfigError(f"{spec.title} on {switch.name}: the plan needs {len(keys)} mirror sessions, but the "
                          f"switch allows {limit} ({hint})")
    sessions = []
    for index, key in enumerate(keys):
        dest, shared = key
        members = tuple(Member(port, leg, s) for s in sources if destination_key(s) == dest
                        for port in source_ports(spec, s)
                        for leg in _legs(spec, s.direction) if shared in (None, leg))
        first = members[0].source
        target = None if first.encapsulation == "none" else ErspanTarget(
            first.erspan_dst_ip or "", _erspan_source(spec, switch), 3 if first.encapsulation == "erspan3" else 2,
            policy.erspan.dscp, policy.erspan.ttl)
        sessions.append(Session(index, _session_id(spec, switch, index),
                                first.dest_port if target is None else None, target, shared, members))
    return sessions


def source_ports(spec: VendorSpec, source: PlannedSource) -> list[str]:
    """The ports a source is configured as: itself, or a LAG's members where the platform takes
    no LAG as mirror source."""
    return source.lag_members if source.lag_members and not spec.lag_source else [source.port]


def _erspan_source(spec: VendorSpec, switch: SwitchInfo) -> str:
    if not switch.erspan_source_ip:
        raise ConfigError(f"{spec.title} on {switch.name}: ERSPAN needs a source address; set "
                          f"leaf_switches[].erspan_source_ip for {switch.name} in the topology")
    return switch.erspan_source_ip


def _session_id(spec: VendorSpec, switch: SwitchInfo, index: int) -> str | int:
    if spec.session_numbers is not None:
        low, high = spec.session_numbers
        base = low if switch.session_id_base is None else switch.session_id_base
        number = base + index
        if not low <= number <= high:
            raise ConfigError(f"{spec.title} on {switch.name}: session number {number} is not allowed "
                              f"(must be {low}..{high}; lower session_id_base)")
        return number
    name = f"gradtap-{index}"
    if spec.name_pattern and not re.fullmatch(spec.name_pattern, name):
        raise ConfigError(f"{spec.title} on {switch.name}: session name {name!r} does not match "
                          f"{spec.name_pattern}")
    return name


def comment_for(member: Member) -> str:
    """Who a mirrored port belongs to, for comments in rendered configs."""
    s = member.source
    return f"{s.group} {s.name}: rank {s.global_rank} ring position {s.position} {s.node} {s.nic} {s.direction}"
