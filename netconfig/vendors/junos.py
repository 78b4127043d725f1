"""Juniper Junos: port-mirroring analyzers with ingress/egress inputs, on ELS and non-ELS switches.

Syntax from Juniper's "Configuring Port Mirroring Local and Remote Analysis": on Enhanced
Layer 2 Software (ELS) ``set forwarding-options analyzer NAME input ingress|egress interface
IF.UNIT`` and ``... output interface IF.UNIT``; on non-ELS EX switches the same statements
under ``ethernet-switching-options analyzer``, which allows a single analyzer. Output
interfaces must be ``family ethernet-switching``. Junos has no "both" input: a
both-direction source gets an ingress and an egress input in the same analyzer.

Everything the apply adds lives in the configuration group ``gradtap``, inherited through
``apply-groups``. The teardown deletes the group and its ``apply-groups`` entry, and so takes
away exactly what the apply added: an output port that already had ``family
ethernet-switching`` keeps it (explicit configuration is not inherited configuration), and
one with another family fails the apply's commit instead of being changed.
"""

from __future__ import annotations

from gradtap.core.errors import ConfigError
from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="junos", title="Juniper Junos", max_sessions=4, session_numbers=None,
    name_pattern=r"[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}", encapsulations=frozenset({"none"}),
    direction_per_session=False, has_both=True,
)
INPUTS = {"rx": ("ingress",), "tx": ("egress",), "both": ("ingress", "egress")}
#: The configuration group holding everything gradtap adds.
GROUP = "gradtap"
#: Where the analyzer statements live, by CLI style.
ANALYZER = {True: "forwarding-options analyzer", False: "ethernet-switching-options analyzer"}


def logical(port: str) -> str:
    """Junos analyzers take logical interfaces; unit 0 unless the port names one."""
    return port if "." in port else f"{port}.0"


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    if not switch.junos_els and len(sessions) > 1:
        raise ConfigError(f"{SPEC.title} on {switch.name}: the plan needs {len(sessions)} analyzers, but a "
                          f"non-ELS EX switch (ethernet-switching-options analyzer) has one; give the sources "
                          f"on {switch.name} one CPU port, or set junos_els: true if it runs ELS")
    style = "ELS" if switch.junos_els else "non-ELS"
    analyzer = f"set groups {GROUP} {ANALYZER[switch.junos_els]}"
    lines = [f"# {switch.name}: gradtap mirror sessions (Juniper Junos, {style})",
             f"# all of it in group {GROUP}: the teardown deletes the group, leaving the ports as they were"]
    for s in sessions:
        physical = str(s.destination).split(".")[0]
        lines.append(f"set groups {GROUP} interfaces {physical} unit 0 family ethernet-switching")
        for m in s.members:
            lines.append(f"# {comment_for(m)}")
            lines += [f"{analyzer} {s.id} input {way} interface {logical(m.port)}" for way in INPUTS[m.direction]]
        lines.append(f"{analyzer} {s.id} output interface {logical(str(s.destination))}")
    lines += [f"set apply-groups {GROUP}", "commit"]
    undo = [f"# {switch.name}: remove gradtap mirror sessions (Juniper Junos, {style})",
            f"# analyzers {', '.join(str(s.id) for s in sessions)} and what group {GROUP} added to their outputs",
            f"delete apply-groups {GROUP}", f"delete groups {GROUP}", "commit"]
    return SwitchConfig(switch.name, SPEC.name, apply={"set": "\n".join(lines) + "\n"},
                        teardown={"set": "\n".join(undo) + "\n"})
