"""Cisco NX-OS: ``monitor session N type local`` with ``switchport monitor`` destinations, or
``type erspan-source`` sessions.

Session numbers 1..32 and at most four active SPAN sessions per forwarding engine (Cisco
Nexus 9000 NX-OS System Management Configuration Guide, "Configuring SPAN"); sessions are
created shut, hence ``no shut``. ERSPAN type III uses ``header-type 3``. An ERSPAN source
session takes the policy's outer-header ``ip ttl`` and ``ip dscp`` ("Configuring ERSPAN",
Nexus 9000 System Management Configuration Guide). Teardown undoes ``switchport monitor`` on
every local destination; ``switchport`` itself stays (a destination must already be a
switched port for the apply to succeed, see docs/netconfig.md).
"""

from __future__ import annotations

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="nxos", title="Cisco NX-OS", max_sessions=4, session_numbers=(1, 32), name_pattern=None,
    encapsulations=frozenset({"none", "erspan2", "erspan3"}), direction_per_session=False, has_both=True,
)


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    lines = [f"! {switch.name}: gradtap mirror sessions (Cisco NX-OS)"]
    local = [s for s in sessions if s.erspan is None]
    remote = [s for s in sessions if s.erspan is not None]
    for s in local:
        lines += [f"interface {s.destination}", "  switchport", "  switchport monitor"]
    if remote:
        lines.append(f"monitor erspan origin ip-address {remote[0].erspan.src_ip} global")
    for s in sessions:
        kind = "local" if s.erspan is None else "erspan-source"
        lines += [f"monitor session {s.id} type {kind}", "  description gradtap"]
        if s.erspan is not None:
            lines += [f"  erspan-id {s.id}", "  vrf default", f"  destination ip {s.erspan.dst_ip}",
                      f"  ip ttl {s.erspan.ttl}", f"  ip dscp {s.erspan.dscp}"]
            if s.erspan.version == 3:
                lines.append("  header-type 3")
        for m in s.members:
            lines += [f"  ! {comment_for(m)}", f"  source interface {m.port} {m.direction}"]
        if s.erspan is None:
            lines.append(f"  destination interface {s.destination}")
        lines.append("  no shut")
    undo = [f"! {switch.name}: remove gradtap mirror sessions (Cisco NX-OS)"]
    undo += [f"no monitor session {s.id}" for s in sessions]
    for s in local:
        undo += [f"interface {s.destination}", "  no switchport monitor"]
    if remote:
        undo.append("! the ERSPAN origin address stays configured: other sessions may use it")
    return SwitchConfig(switch.name, SPEC.name, apply={"cfg": "\n".join(lines) + "\n"},
                        teardown={"cfg": "\n".join(undo) + "\n"})
