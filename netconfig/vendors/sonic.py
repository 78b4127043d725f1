"""SONiC: CONFIG_DB ``MIRROR_SESSION`` entries and the equivalent ``config mirror_session`` commands.

Constraints from the ``sonic-mirror-session`` YANG model (sonic-buildimage,
``src/sonic-yang-models/yang-models/sonic-mirror-session.yang``): name pattern
``[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}``, type SPAN|ERSPAN, direction RX|TX|BOTH (one per
session), ``dst_port`` only for SPAN, ``src_ip``/``dst_ip``/``gre_type``/``dscp``/``ttl``
only for ERSPAN; ``src_port`` is a comma-separated port list. CLI syntax from
sonic-utilities ``doc/Command-Reference.md`` ("config mirror_session").
"""

from __future__ import annotations

import json

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec

SPEC = VendorSpec(
    name="sonic", title="SONiC", max_sessions=4, session_numbers=None,
    name_pattern=r"[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}", encapsulations=frozenset({"none", "erspan2"}),
    direction_per_session=True, has_both=True,
)
#: GRE protocol type of ERSPAN type II, the YANG model's default ``gre_type``.
GRE_TYPE_ERSPAN2 = "0x88be"
#: ``config mirror_session erspan add`` takes the queue positionally before the source ports,
#: so the commands must name one; CONFIG_DB states the same queue, so both renderings are equal.
ERSPAN_QUEUE = "0"


def _entry(session: Session) -> dict[str, str]:
    assert session.direction is not None
    ports = ",".join(dict.fromkeys(m.port for m in session.members))
    if session.erspan is None:
        return {"type": "SPAN", "dst_port": str(session.destination), "src_port": ports,
                "direction": session.direction.upper()}
    e = session.erspan
    return {"type": "ERSPAN", "src_ip": e.src_ip, "dst_ip": e.dst_ip, "gre_type": GRE_TYPE_ERSPAN2,
            "dscp": str(e.dscp), "ttl": str(e.ttl), "queue": ERSPAN_QUEUE, "src_port": ports,
            "direction": session.direction.upper()}


def _command(session: Session) -> str:
    entry = _entry(session)
    if session.erspan is None:
        return (f"config mirror_session span add {session.id} {entry['dst_port']} {entry['src_port']} "
                f"{entry['direction'].lower()}")
    # Positional: name src_ip dst_ip dscp ttl [gre_type] [queue] [src_port] [direction].
    return (f"config mirror_session erspan add {session.id} {entry['src_ip']} {entry['dst_ip']} {entry['dscp']} "
            f"{entry['ttl']} {entry['gre_type']} {entry['queue']} {entry['src_port']} {entry['direction'].lower()}")


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    config_db = {"MIRROR_SESSION": {str(s.id): _entry(s) for s in sessions}}
    commands = [f"# {switch.name}: gradtap mirror sessions (SONiC)"] + [_command(s) for s in sessions]
    patch = [{"op": "remove", "path": f"/MIRROR_SESSION/{s.id}"} for s in sessions]
    undo = [f"# {switch.name}: remove gradtap mirror sessions (SONiC)"]
    undo += [f"config mirror_session remove {s.id}" for s in sessions]
    return SwitchConfig(
        switch.name, SPEC.name,
        apply={"config_db.json": json.dumps(config_db, indent=4) + "\n", "commands.sh": "\n".join(commands) + "\n"},
        teardown={"apply-patch.json": json.dumps(patch, indent=4) + "\n", "commands.sh": "\n".join(undo) + "\n"},
    )
