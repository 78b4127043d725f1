"""NVIDIA Cumulus Linux NVUE: ``nv set system port-mirror session ID span|erspan ...``.

From the NVUE command reference ("Port Mirror", Cumulus Linux 5.x,
docs.nvidia.com/networking-ethernet-software/nvue-reference): session ids 0..7; SPAN takes
``span source-port``, ``span destination``, ``span direction ingress|egress``; ERSPAN takes
``erspan source-port``, ``erspan destination source-ip``, ``erspan destination dest-ip`` and
``erspan direction`` (the tree ``nv show system port-mirror session -o json`` prints). One
direction per session and no "both", so a both-direction source takes two sessions. NVUE has
no ERSPAN TTL or DSCP setting: the switch's own values go out, and the rendered file says
which policy values it could not apply.
"""

from __future__ import annotations

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec, comment_for

SPEC = VendorSpec(
    name="nvue", title="NVIDIA Cumulus NVUE", max_sessions=8, session_numbers=(0, 7), name_pattern=None,
    encapsulations=frozenset({"none", "erspan2"}), direction_per_session=True, has_both=False,
)
KEYWORD = {"rx": "ingress", "tx": "egress"}


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    lines = [f"# {switch.name}: gradtap mirror sessions (NVIDIA Cumulus NVUE)"]
    for s in sessions:
        assert s.direction in KEYWORD
        prefix = f"nv set system port-mirror session {s.id} {'span' if s.erspan is None else 'erspan'}"
        for m in s.members:
            lines += [f"# {comment_for(m)}", f"{prefix} source-port {m.port}"]
        if s.erspan is None:
            lines.append(f"{prefix} destination {s.destination}")
        else:
            lines += [f"# NVUE sets no ERSPAN ttl/dscp: the switch's defaults apply, not the policy's "
                      f"ttl {s.erspan.ttl} dscp {s.erspan.dscp}",
                      f"{prefix} destination source-ip {s.erspan.src_ip}",
                      f"{prefix} destination dest-ip {s.erspan.dst_ip}"]
        lines.append(f"{prefix} direction {KEYWORD[s.direction]}")
    lines.append("nv config apply")
    undo = [f"# {switch.name}: remove gradtap mirror sessions (NVIDIA Cumulus NVUE)"]
    undo += [f"nv unset system port-mirror session {s.id}" for s in sessions] + ["nv config apply"]
    return SwitchConfig(switch.name, SPEC.name, apply={"sh": "\n".join(lines) + "\n"},
                        teardown={"sh": "\n".join(undo) + "\n"})
