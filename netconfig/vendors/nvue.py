"""NVIDIA Cumulus Linux NVUE: ``nv set system port-mirror session ID span ...``.

From the NVUE command reference ("Port Mirror", Cumulus Linux 5.x): session ids 0..7;
``span source-port``, ``span destination``, ``span direction ingress|egress`` -- one direction
per session and no "both", so a both-direction source takes two sessions.
"""

from __future__ import annotations

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="nvue", title="NVIDIA Cumulus NVUE", max_sessions=8, session_numbers=(0, 7), name_pattern=None,
    encapsulations=frozenset({"none"}), direction_per_session=True, has_both=False,
)
KEYWORD = {"rx": "ingress", "tx": "egress"}


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    lines = [f"# {switch.name}: gradtap mirror sessions (NVIDIA Cumulus NVUE)"]
    for s in sessions:
        assert s.direction in KEYWORD
        prefix = f"nv set system port-mirror session {s.id} span"
        for m in s.members:
            lines += [f"# {comment_for(m)}", f"{prefix} source-port {m.port}"]
        lines += [f"{prefix} destination {s.destination}", f"{prefix} direction {KEYWORD[s.direction]}"]
    lines.append("nv config apply")
    undo = [f"# {switch.name}: remove gradtap mirror sessions (NVIDIA Cumulus NVUE)"]
    undo += [f"nv unset system port-mirror session {s.id}" for s in sessions] + ["nv config apply"]
    return SwitchConfig(switch.name, SPEC.name, apply={"sh": "\n".join(lines) + "\n"},
                        teardown={"sh": "\n".join(undo) + "\n"})
