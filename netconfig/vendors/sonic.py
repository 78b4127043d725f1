"""SONiC: CONFIG_DB ``MIRROR_SESSION`` entries and the equivalent ``config mirror_session`` commands.

Constraints from the ``sonic-mirror-session`` YANG model (sonic-buildimage,
``src/sonic-yang-models/yang-models/sonic-mirror-session.yang``): name pattern
``[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}``, type SPAN|ERSPAN, direction RX|TX|BOTH (one per
session), ``dst_port`` only for SPAN, ``src_ip``/``dst_ip``/``gre_type``/``dscp``/``ttl``
only for ERSPAN; ``src_port`` is a comma-separated port list. CLI syntax from
sonic-utilities ``doc/Command-Reference.md`` ("config mirror_session").

Two rules of the switch's own tools shape the files:

- ``generic_config_updater`` refuses a patch whose result has an empty table ("will result in
  empty tables which is not allowed in ConfigDb", sonic-utilities
  ``generic_config_updater/generic_updater.py``). The teardown patch therefore removes the
  ``MIRROR_SESSION`` table itself, which is right only while gradtap's sessions are the only
  ones on the switch; the apply script checks exactly that before it adds any.
- ``config mirror_session span add`` refuses a destination port that is a VLAN or PortChannel
  member or a router interface (``validate_mirror_session_config`` in sonic-utilities
  ``config/main.py``). The topology does not know a port's switching config, so the apply
  script checks CONFIG_DB for it and stops, naming the command that removes it.
"""

from __future__ import annotations

import json
from shlex import quote

from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec

SPEC = VendorSpec(
    name="sonic", title="SONiC", max_sessions=4, session_numbers=None,
    name_pattern=r"[a-zA-Z0-9][-a-zA-Z0-9_]{0,31}", encapsulations=frozenset({"none", "erspan2"}),
    direction_per_session=True, has_both=True,
    # sonic-mirror-session.yang, src_port: "Supports both port and port-channel as arguments".
    lag_source=True,
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


#: CONFIG_DB keys (``sonic-db-cli CONFIG_DB keys`` patterns) that make ``config mirror_session``
#: refuse a SPAN destination, and what removes each.
DESTINATION_REFUSED = (
    ("VLAN_MEMBER|*|{port}", "is a VLAN member (remove it: config vlan member del <vlan> {port})"),
    ("PORTCHANNEL_MEMBER|*|{port}", "is a PortChannel member (remove it: config portchannel member del <pc> {port})"),
    ("INTERFACE|{port}", "is a router interface (remove it: config interface ip remove {port} <ip/len>)"),
    ("INTERFACE|{port}|*", "has an IP address (remove it: config interface ip remove {port} <ip/len>)"),
)


def _preconditions(sessions: list[Session]) -> list[str]:
    """Shell checks that stop the apply script before any change the switch would refuse."""
    lines = ["set -e", 'refuse_if_set() { if [ -n "$(sonic-db-cli CONFIG_DB keys "$1")" ]; then '
             'echo "gradtap: $2" >&2; exit 1; fi; }',
             "# gradtap owns MIRROR_SESSION: the teardown patch removes the whole table (no empty tables)",
             f"refuse_if_set {quote('MIRROR_SESSION|*')} "
             f"{quote('MIRROR_SESSION already holds sessions; the gradtap teardown would remove them')}"]
    for port in dict.fromkeys(str(s.destination) for s in sessions if s.erspan is None):
        lines.append(f"# {port} is a SPAN destination: config mirror_session refuses VLAN, PortChannel or IP config")
        lines += [f"refuse_if_set {quote(key.format(port=port))} {quote(f'{port} ' + why.format(port=port))}"
                  for key, why in DESTINATION_REFUSED]
    return lines


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    config_db = {"MIRROR_SESSION": {str(s.id): _entry(s) for s in sessions}}
    commands = [f"# {switch.name}: gradtap mirror sessions (SONiC)", *_preconditions(sessions)]
    commands += [_command(s) for s in sessions]
    # The whole table, not its entries: the apply refused to share it, and an emptied table
    # is a patch generic_config_updater rejects.
    patch = [{"op": "remove", "path": "/MIRROR_SESSION"}] if sessions else []
    undo = [f"# {switch.name}: remove gradtap mirror sessions (SONiC)"]
    undo += [f"config mirror_session remove {s.id}" for s in sessions]
    return SwitchConfig(
        switch.name, SPEC.name,
        apply={"config_db.json": json.dumps(config_db, indent=4) + "\n", "commands.sh": "\n".join(commands) + "\n"},
        teardown={"apply-patch.json": json.dumps(patch, indent=4) + "\n", "commands.sh": "\n".join(undo) + "\n"},
    )
