"""H3C Comware: local ``mirroring-group`` with ``mirroring-port`` sources and a ``monitor-port``,
which for Layer 3 remote mirroring (ERSPAN) carries the encapsulation parameters.

Local mirroring (SPAN), from the FlowCheck README (the prototype's switch) and H3C's Comware
mirroring command references: ``mirroring-group ID local``, ``mirroring-group ID mirroring-port
IF {inbound|outbound|both}``, ``mirroring-group ID monitor-port IF``, removed with ``undo
mirroring-group ID``. The group-id range is model-specific (1-7, 1-9 and 1-15 appear in H3C's
references); the default limit is the smallest of these.

ERSPAN, from H3C's configuration guide "Configuring port mirroring", section "Configuring Layer 3
remote port mirroring (ERSPAN in encapsulation parameter mode)": a local mirroring group on the
source device whose monitor port is given the encapsulation, ``mirroring-group ID monitor-port
IF destination-ip D source-ip S [dscp N | vlan V | vrf-instance NAME]*``; the packets are GRE
with protocol 0x88BE (ERSPAN type II) and routed to D, S being the monitor port's address. That
guide documents ``inbound`` sources only for this mode, one monitor port per group, no TTL
setting, and neither aggregate interfaces as source or monitor ports nor aggregate members as
monitor ports ("You can configure member ports of a Layer 2 or Layer 3 aggregate interface as
mirroring source ports"). So gradtap mirrors a LAG through its members, sends ERSPAN out of the
switch's ``erspan_monitor_port`` (an uplink) to one destination per switch, and writes the
policy's DSCP; the rendered file says the TTL is the switch's.
"""

from __future__ import annotations

from gradtap.core.errors import ConfigError
from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="comware", title="H3C Comware", max_sessions=7, session_numbers=(1, 15), name_pattern=None,
    encapsulations=frozenset({"none", "erspan2"}), direction_per_session=False, has_both=True,
    erspan_directions=frozenset({"rx"}), erspan_monitor_port=True, max_erspan_sessions=1,
)
KEYWORD = {"rx": "inbound", "tx": "outbound", "both": "both"}


def _monitor_port(switch: SwitchInfo, session: Session) -> str:
    if session.erspan is None:
        return str(session.destination)
    if switch.erspan_monitor_port is None:
        raise ConfigError(f"{SPEC.title} on {switch.name}: ERSPAN leaves by the mirroring group's monitor port; set "
                          f"leaf_switches[].erspan_monitor_port for {switch.name} to the uplink it should use")
    e = session.erspan
    return (f"{switch.erspan_monitor_port} destination-ip {e.dst_ip} source-ip {e.src_ip} dscp {e.dscp}")


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    remote = [s for s in sessions if s.erspan is not None]
    if len(remote) > 1:
        raise ConfigError(f"{SPEC.title} on {switch.name}: the plan sends ERSPAN to {len(remote)} destinations, but "
                          f"gradtap gives a Comware switch one ERSPAN monitor port (erspan_monitor_port)")
    lines = [f"# {switch.name}: gradtap mirror sessions (H3C Comware)", "system-view"]
    for s in sessions:
        lines.append(f"mirroring-group {s.id} local")
        for m in s.members:
            lines.append(f"# {comment_for(m)}")
            lines.append(f"mirroring-group {s.id} mirroring-port {m.port} {KEYWORD[m.direction]}")
        if s.erspan is not None:
            lines.append(f"# ERSPAN II to {s.erspan.dst_ip}; Comware sets no ERSPAN TTL: the switch's default "
                         f"applies, not the policy's ttl {s.erspan.ttl}")
        lines.append(f"mirroring-group {s.id} monitor-port {_monitor_port(switch, s)}")
    lines.append("return")
    undo = [f"# {switch.name}: remove gradtap mirror sessions (H3C Comware)", "system-view"]
    undo += [f"undo mirroring-group {s.id}" for s in sessions] + ["return"]
    return SwitchConfig(switch.name, SPEC.name, apply={"cfg": "\n".join(lines) + "\n"},
                        teardown={"cfg": "\n".join(undo) + "\n"})
