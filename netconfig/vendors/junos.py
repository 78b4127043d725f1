"""Juniper Junos (ELS): ``forwarding-options analyzer`` with ingress/egress inputs.

Syntax from Juniper's "Configuring Port Mirroring Local and Remote Analysis" (ELS): ``set
forwarding-options analyzer NAME input ingress|egress interface IF``, ``... output interface
IF``; output interfaces must be ``family ethernet-switching``. Junos has no "both" input:
a both-direction source gets an ingress and an egress input in the same analyzer.
"""

from __future__ import annotations

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="junos", title="Juniper Junos", max_sessions=4, session_numbers=None,
    name_pattern=r"[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}", encapsulations=frozenset({"none"}),
    direction_per_session=False, has_both=True,
)
INPUTS = {"rx": ("ingress",), "tx": ("egress",), "both": ("ingress", "egress")}


def logical(port: str) -> str:
    """Junos analyzers take logical interfaces; unit 0 unless the port names one."""
    return port if "." in port else f"{port}.0"


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    lines = [f"# {switch.name}: gradtap mirror sessions (Juniper Junos)"]
    for s in sessions:
        physical = str(s.destination).split(".")[0]
        lines.append(f"set interfaces {physical} unit 0 family ethernet-switching")
        for m in s.members:
            lines.append(f"# {comment_for(m)}")
            lines += [f"set forwarding-options analyzer {s.id} input {way} interface {logical(m.port)}"
                      for way in INPUTS[m.direction]]
        lines.append(f"set forwarding-options analyzer {s.id} output interface {logical(str(s.destination))}")
    lines.append("commit")
    undo = [f"# {switch.name}: remove gradtap mirror sessions (Juniper Junos)"]
    for s in sessions:
        undo.append(f"delete forwarding-options analyzer {s.id}")
        undo.append(f"delete interfaces {str(s.destination).split('.')[0]} unit 0 family ethernet-switching")
    undo.append("commit")
    return SwitchConfig(switch.name, SPEC.name, apply={"set": "\n".join(lines) + "\n"},
                        teardown={"set": "\n".join(undo) + "\n"})
