"""H3C Comware: local ``mirroring-group`` with ``mirroring-port`` sources and a ``monitor-port``.

Syntax from the FlowCheck README (the prototype's switch) and H3C's Comware mirroring
command references: ``mirroring-group ID local``, ``mirroring-group ID mirroring-port IF
{inbound|outbound|both}``, ``mirroring-group ID monitor-port IF``, removed with
``undo mirroring-group ID``. The group-id range is model-specific (1-7, 1-9 and 1-15 appear
in H3C's references); the default limit is the smallest of these.
"""

from __future__ import annotations

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="comware", title="H3C Comware", max_sessions=7, session_numbers=(1, 15), name_pattern=None,
    encapsulations=frozenset({"none"}), direction_per_session=False, has_both=True,
)
KEYWORD = {"rx": "inbound", "tx": "outbound", "both": "both"}


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    lines = [f"# {switch.name}: gradtap mirror sessions (H3C Comware)", "system-view"]
    for s in sessions:
        lines.append(f"mirroring-group {s.id} local")
        for m in s.members:
            lines.append(f"# {comment_for(m)}")
            lines.append(f"mirroring-group {s.id} mirroring-port {m.port} {KEYWORD[m.direction]}")
        lines.append(f"mirroring-group {s.id} monitor-port {s.destination}")
    lines.append("return")
    undo = [f"# {switch.name}: remove gradtap mirror sessions (H3C Comware)", "system-view"]
    undo += [f"undo mirroring-group {s.id}" for s in sessions] + ["return"]
    return SwitchConfig(switch.name, SPEC.name, apply={"cfg": "\n".join(lines) + "\n"},
                        teardown={"cfg": "\n".join(undo) + "\n"})
