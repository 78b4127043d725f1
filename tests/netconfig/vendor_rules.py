"""Each switch platform's own rules for a mirror configuration, written independently of the renderers.

A validator reads a rendered configuration as the platform would (its own parser, written
from the platform's documentation, sharing nothing with ``netconfig/vendors``), reports every
rule it breaks, and returns what the configuration *does*: the set of :class:`Mirror` records
``(source port, switch-port direction rx|tx, destination)``. The tests compare that meaning
with the plan, so a renderer that emits well-formed text mirroring the wrong thing fails too.

Sources of the rules (each check below names its rule):

- **SONiC**: the ``sonic-mirror-session`` YANG model, sonic-net/sonic-buildimage
  ``src/sonic-yang-models/yang-models/sonic-mirror-session.yang`` (revision 2021-06-15): list
  ``MIRROR_SESSION_LIST`` keyed by ``name`` (pattern ``[a-zA-Z0-9]{1}([-a-zA-Z0-9_]{0,31})``,
  length 1..32); ``type`` enum SPAN|ERSPAN (default ERSPAN); ``src_ip``/``dst_ip``
  (inet:ip-address), ``gre_type`` (pattern ``0[xX][0-9a-fA-F]*`` or decimal 0..65535, length
  1..6), ``dscp`` (uint8 0..63), ``ttl`` (uint8 0..255) only *when* type = ERSPAN; ``queue``
  uint8; ``dst_port`` only when type = SPAN, a leafref to ``PORT_LIST/name`` or ``CPU``;
  ``src_port`` string of length 1..2048; ``direction`` enum RX|TX|BOTH (default BOTH);
  ``policer`` a leafref to ``POLICER_LIST``. The ``config mirror_session`` commands follow
  sonic-net/sonic-utilities ``config/main.py``: ``span add <name> <dst_port> [src_port]
  [direction] [queue]``, ``erspan add <name> <src_ip> <dst_ip> <dscp> <ttl> [gre_type] [queue]
  [src_port] [direction]``, ``remove <name>``; ``validate_mirror_session_config`` and
  ``interface_has_mirror_config`` reject an existing name, an unknown port, a destination that
  is also a source, a destination already used by another session, and a source already
  mirrored in the same direction (matched with ``re.search``, so ``Ethernet4`` also "matches"
  ``Ethernet44``: sonic-net/sonic-buildimage issue #16604, modelled here because a real
  switch behaves so).
- **Arista EOS**: ``monitor session NAME source IF [rx|tx|both]`` (no direction = both) and
  ``monitor session NAME destination IF | tunnel mode gre source A destination B``, the syntax
  Arista AVD's ``eos_cli_config_gen/templates/eos/monitor-sessions.j2`` generates; a session
  associates a set of source ports with a mirror destination port ("Introduction to Port
  Mirroring", eos.arista.com), and a destination is not a source.
- **Cisco NX-OS**: ``monitor session N [type local|erspan-source]`` (N 1..32) with ``source
  interface IF [rx|tx|both]``, ``destination interface IF`` (a port in ``switchport monitor``
  mode), ERSPAN ``erspan-id`` (1..1023), ``vrf``, ``destination ip``, a global ``monitor erspan
  origin ip-address``, and ``no shut`` since sessions are created shut (Cisco Nexus 9000 NX-OS
  System Management Configuration Guide 7.x, "Configuring SPAN": one destination port per SPAN
  session, at most 48 source interfaces per session; the Nexus SPAN guides' "Characteristics of
  Source/Destination Ports": a source port cannot be a destination port, and "the same
  destination interface cannot be used for multiple SPAN sessions").
- **Juniper Junos (ELS)**: ``set forwarding-options analyzer NAME input ingress|egress
  interface IF.UNIT`` and ``... output interface IF.UNIT``; the output must be an
  ``ethernet-switching`` family interface; no ``both`` keyword.
- **H3C Comware**: ``mirroring-group N local``, ``mirroring-group N mirroring-port IF
  inbound|outbound|both``, ``mirroring-group N monitor-port IF`` in system view, removed with
  ``undo mirroring-group N``; a group must exist before ports join it, and a monitor port is
  not a mirroring port.
- **NVIDIA Cumulus NVUE**: ``nv set system port-mirror session ID span source-port IF``,
  ``... span destination IF``, ``... span direction ingress|egress`` (ID "a number between 0
  and 7"), ``nv unset system port-mirror session ID``, ``nv config apply`` (NVUE command
  reference, "Port Mirror", docs.nvidia.com/networking-ethernet-software/nvue-reference).
- **Linux tc**: ``tc qdisc add dev IF clsact`` before filters on IF (tc-bpf(8)/clsact);
  ``tc filter add dev IF ingress|egress protocol all prio P u32 match u32 0 0 action mirred
  egress mirror dev DEST`` (tc-u32(8), tc-mirred(8)); ``prio`` is 16 bits and 0 means "let the
  kernel choose", so teardown by priority needs a fixed nonzero one; interface names follow
  the kernel's ``dev_valid_name()`` (1..15 bytes, no ``/``, ``:`` or whitespace).

Direction words, per platform, in the switch port's view (``rx`` = frames the port receives,
which is what the attached GPU NIC transmits).
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections import Counter, defaultdict
import copy
from dataclasses import dataclass, field

#: A planned source's direction is the GPU NIC's; the switch port sees it reversed.
NIC_TO_PORT = {"egress": ("rx",), "ingress": ("tx",), "both": ("rx", "tx")}


@dataclass(frozen=True, order=True)
class Mirror:
    """One mirrored (port, direction) and where its copies go (a port, or ``erspan:<ip>``)."""

    port: str
    direction: str
    destination: str


@dataclass
class Result:
    mirrors: set[Mirror] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)          # session ids created, in order
    removed: list[str] = field(default_factory=list)           # session ids the teardown removes
    #: ERSPAN destination (``erspan:<ip>``) -> (ttl, dscp) of the outer header the config sets,
    #: None where it leaves a platform default.
    erspan: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)

    def bad(self, message: str) -> None:
        self.problems.append(message)

    def add(self, port: str, direction: str, destination: str) -> None:
        legs = ("rx", "tx") if direction == "both" else (direction,)
        for leg in legs:
            mirror = Mirror(port, leg, destination)
            if mirror in self.mirrors:
                self.bad(f"{port} {leg} is mirrored to {destination} twice")
            self.mirrors.add(mirror)


def _lines(text: str, comment: tuple[str, ...] = ("#", "!")) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(comment)]


def _ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
        return True
    except ValueError:
        return False


def _common(result: Result, ports: set[str], sources: dict[str, set[str]], destinations: dict[str, list[str]],
            session_limit: int | None, exclusive_destination: bool = False) -> None:
    """Rules every platform shares: ports exist, a destination is never a source, sessions
    have sources; with ``exclusive_destination`` (where the platform documents it) a
    destination port serves one session."""
    for session, members in sources.items():
        for port in members:
            if port not in ports:
                result.bad(f"session {session}: source {port!r} is not a port of this switch")
    used_as_source = {p for members in sources.values() for p in members}
    for port, sessions in destinations.items():
        if port.startswith("erspan:"):
            continue
        if port not in ports:
            result.bad(f"destination {port!r} is not a port of this switch")
        if port in used_as_source:
            result.bad(f"destination {port} is also a mirror source")
        if exclusive_destination and len(sessions) > 1:
            result.bad(f"destination {port} serves several sessions: {sessions}")
    for session in sources:
        if not sources[session]:
            result.bad(f"session {session} has no source")
    if session_limit is not None and len(sources) > session_limit:
        result.bad(f"{len(sources)} sessions, but the switch allows {session_limit}")


# -- SONiC ----------------------------------------------------------------------------------------

YANG_NAME = re.compile(r"[a-zA-Z0-9]{1}([-a-zA-Z0-9_]{0,31})")
YANG_GRE_TYPE = re.compile(r"0[xX][0-9a-fA-F]*|([0-9]|[1-5]?[0-9]{2,4}|6[1-4][0-9]{3}|65[1-4][0-9]{2}|655[1-2][0-9]"
                           r"|6553[0-5])")
YANG_LEAVES = {"type", "src_ip", "dst_ip", "gre_type", "dscp", "ttl", "queue", "dst_port", "src_port", "direction",
               "policer"}
YANG_ERSPAN_ONLY = {"src_ip", "dst_ip", "gre_type", "dscp", "ttl"}
YANG_UINT8 = re.compile(r"0|[1-9][0-9]{0,2}")   # YANG integer lexical form, decimal


def _yang_uint(value: str, low: int, high: int) -> bool:
    return isinstance(value, str) and bool(YANG_UINT8.fullmatch(value)) and low <= int(value) <= high


def sonic_config_db(doc: dict, ports: set[str], result: Result) -> dict[str, dict[str, str]]:
    """Check CONFIG_DB JSON against the sonic-mirror-session YANG model; return its table."""
    if set(doc) != {"MIRROR_SESSION"}:
        result.bad(f"config_db.json holds tables {sorted(doc)}, expected only MIRROR_SESSION")
    table = doc.get("MIRROR_SESSION", {})
    for name, entry in table.items():
        where = f"MIRROR_SESSION|{name}"
        if not YANG_NAME.fullmatch(name) or not 1 <= len(name) <= 32:
            result.bad(f"{where}: name does not match the YANG pattern/length")
        if not all(isinstance(v, str) for v in entry.values()):
            result.bad(f"{where}: CONFIG_DB fields are strings, got {entry}")
            continue
        if set(entry) - YANG_LEAVES:
            result.bad(f"{where}: unknown leaves {sorted(set(entry) - YANG_LEAVES)}")
        kind = entry.get("type", "ERSPAN")        # the YANG default
        if kind not in ("SPAN", "ERSPAN"):
            result.bad(f"{where}: type {kind!r} is not SPAN or ERSPAN")
        direction = entry.get("direction", "BOTH")
        if direction not in ("RX", "TX", "BOTH"):
            result.bad(f"{where}: direction {direction!r} is not RX, TX or BOTH")
        if kind == "SPAN":
            present = set(entry) & YANG_ERSPAN_ONLY
            if present:
                result.bad(f"{where}: {sorted(present)} exist only when type = 'ERSPAN'")
            dst = entry.get("dst_port")
            if dst is None:
                result.bad(f"{where}: a SPAN session needs dst_port")
            elif dst != "CPU" and dst not in ports:
                result.bad(f"{where}: dst_port {dst!r} is not in PORT (leafref)")
        else:
            if "dst_port" in entry:
                result.bad(f"{where}: dst_port exists only when type = 'SPAN'")
            for leaf in ("src_ip", "dst_ip"):
                try:
                    ipaddress.ip_address(entry.get(leaf, ""))
                except ValueError:
                    result.bad(f"{where}: {leaf} {entry.get(leaf)!r} is not an inet:ip-address")
            gre = entry.get("gre_type", "0x88be")
            if not YANG_GRE_TYPE.fullmatch(gre) or not 1 <= len(gre) <= 6:
                result.bad(f"{where}: gre_type {gre!r} breaks its pattern/length")
            if "dscp" in entry and not _yang_uint(entry["dscp"], 0, 63):
                result.bad(f"{where}: dscp {entry['dscp']!r} is not in 0..63")
            if "ttl" in entry and not _yang_uint(entry["ttl"], 0, 255):
                result.bad(f"{where}: ttl {entry['ttl']!r} is not in 0..255")
        if "queue" in entry and not _yang_uint(entry["queue"], 0, 255):
            result.bad(f"{where}: queue {entry['queue']!r} is not a uint8")
        if "policer" in entry:
            result.bad(f"{where}: policer {entry['policer']!r} refers to no POLICER entry (leafref)")
        src = entry.get("src_port", "")
        if not 1 <= len(src) <= 2048:
            result.bad(f"{where}: src_port has {len(src)} characters (YANG length 1..2048)")
    return table


def _gre_number(text: str) -> int:
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def sonic_commands(text: str, ports: set[str], result: Result) -> dict[str, dict[str, str]]:
    """Run ``config mirror_session`` lines the way sonic-utilities' click commands and
    ``validate_mirror_session_config`` would, against an initially empty MIRROR_SESSION table."""
    table: dict[str, dict[str, str]] = {}
    checked: set[str] = set()     # CONFIG_DB key patterns the script refuses to find
    if "set -e" not in text.splitlines():
        result.bad("commands.sh does not stop at the first failure (set -e)")
    for line in _lines(text, ("#",)):
        words = shlex.split(line)
        if line in ("set -e", SONIC_REFUSE_HELPER):
            continue
        if words[:1] == ["refuse_if_set"] and len(words) == 3:
            checked.add(words[1])
            continue
        if words[:2] != ["config", "mirror_session"] or len(words) < 4:
            result.bad(f"not a mirror_session command: {line!r}")
            continue
        verb = words[2:4]
        args = words[4:]
        if verb == ["span", "add"] and 2 <= len(args) <= 5:
            name, dst_port, src_port, direction, queue = (args + [None] * 5)[:5]
            entry = {"type": "SPAN", "dst_port": dst_port}
        elif verb == ["erspan", "add"] and 5 <= len(args) <= 9:
            name, src_ip, dst_ip, dscp, ttl, gre, queue, src_port, direction = (args + [None] * 9)[:9]
            entry = {"type": "ERSPAN", "src_ip": src_ip, "dst_ip": dst_ip, "dscp": dscp, "ttl": ttl}
            dst_port = None
            if not (_ipv4(src_ip) and _ipv4(dst_ip)):
                result.bad(f"{line!r}: src_ip/dst_ip must be IPv4 addresses (validate_ipv4_address)")
            if not (dscp.isdigit() and int(dscp) <= 63) or not (ttl.isdigit() and int(ttl) <= 255):
                result.bad(f"{line!r}: dscp must be in 0..63 and ttl in 0..255 (DSCP_RANGE, TTL_RANGE)")
            if gre is not None:
                try:
                    assert 0 <= _gre_number(gre) <= 65535
                    entry["gre_type"] = str(_gre_number(gre))     # validate_gre_type returns the number
                except (ValueError, AssertionError):
                    result.bad(f"{line!r}: {gre!r} is not a valid GRE type")
        elif verb[0] == "remove" and len(words) == 4:
            if words[3] not in table:
                result.bad(f"{line!r}: no such session")
            table.pop(words[3], None)
            continue
        else:
            result.bad(f"{line!r}: wrong arguments for `config mirror_session {' '.join(verb)}`")
            continue
        if queue is not None:
            if not (queue.isdigit() and int(queue) <= 255):
                result.bad(f"{line!r}: queue {queue!r} is not in 0..255 (QUEUE_RANGE)")
            entry["queue"] = queue
        if src_port:
            entry["src_port"] = src_port
            entry["direction"] = (direction or "both").upper()     # gather_session_info
        # validate_mirror_session_config, and the script's own stop before it: a destination
        # with VLAN, PortChannel or router-interface config is refused, and gradtap must own
        # MIRROR_SESSION for its whole-table teardown.
        if "MIRROR_SESSION|*" not in checked:
            result.bad(f"{line!r}: runs before the script checks that MIRROR_SESSION holds no other session")
        if dst_port is not None:
            for key in SONIC_DESTINATION_KEYS:
                if key.format(port=dst_port) not in checked:
                    result.bad(f"{line!r}: runs before the script checks that CONFIG_DB has no "
                               f"{key.format(port=dst_port)!r} (config mirror_session refuses such a destination)")
        if name in table:
            result.bad(f"{line!r}: {name} already exists")
        if dst_port is not None and dst_port not in ports:
            result.bad(f"{line!r}: Destination Interface {dst_port} is invalid")
        for port in (src_port or "").split(",") if src_port else []:
            if port not in ports:
                result.bad(f"{line!r}: Source Interface {port} is invalid")
            if dst_port == port:
                result.bad(f"{line!r}: Destination Interface can't be same as Source Interface")
        for other, v in table.items():     # interface_has_mirror_config
            for port in src_port.split(",") if src_port else []:
                if v.get("dst_port") == port:
                    result.bad(f"{line!r}: Source Interface {port} already has mirror config ({other})")
                if "src_port" in v and re.search(port, v["src_port"]) and (
                        v.get("direction") == "BOTH" or (direction or "both").upper() in ("BOTH", v.get("direction"))):
                    result.bad(f"{line!r}: Source Interface {port} already has mirror config in same direction "
                               f"({other})")
            if dst_port and (v.get("dst_port") == dst_port or re.search(dst_port, v.get("src_port", "^$"))):
                result.bad(f"{line!r}: Destination Interface {dst_port} already has mirror config ({other})")
        if direction is not None and direction not in ("rx", "tx", "both"):
            result.bad(f"{line!r}: Direction {direction} is invalid")
        table[name] = entry
    return table


#: The apply script's guard: exit when CONFIG_DB has a key matching the pattern.
SONIC_REFUSE_HELPER = ('refuse_if_set() { if [ -n "$(sonic-db-cli CONFIG_DB keys "$1")" ]; then '
                       'echo "gradtap: $2" >&2; exit 1; fi; }')
#: validate_mirror_session_config: interface_is_in_vlan (VLAN_MEMBER|<vlan>|<port>),
#: interface_is_in_portchannel (PORTCHANNEL_MEMBER|<pc>|<port>), is_port_router_interface
#: (INTERFACE|<port>; addresses live under INTERFACE|<port>|<prefix>).
SONIC_DESTINATION_KEYS = ("VLAN_MEMBER|*|{port}", "PORTCHANNEL_MEMBER|*|{port}", "INTERFACE|{port}",
                          "INTERFACE|{port}|*")


def sonic_teardown_patch(patch: list, running: dict, result: Result) -> dict:
    """Apply the teardown patch as generic_config_updater would: RFC 6902 on the running config
    (only ``remove`` is needed here; RFC 6901 pointers), then its rule "will result in empty
    tables which is not allowed in ConfigDb" (generic_updater.py, ``get_empty_tables``)."""
    after = copy.deepcopy(running)
    for op in patch:
        keys = [k.replace("~1", "/").replace("~0", "~") for k in op.get("path", "").split("/")[1:]]
        node = after
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if op.get("op") != "remove" or not keys or not isinstance(node, dict) or keys[-1] not in node:
            result.bad(f"apply-patch.json: {op} does not apply to the running config")
            continue
        del node[keys[-1]]
    empty = [table for table, entries in after.items() if not entries]
    if empty:
        result.bad(f"apply-patch.json leaves empty tables {empty}, which generic_config_updater rejects")
    return after


def _same_entry(a: dict[str, str], b: dict[str, str]) -> bool:
    """Equal CONFIG_DB entries, with gre_type compared as a number (the CLI stores it so)."""
    norm = lambda e: {k: (_gre_number(v) if k == "gre_type" else v) for k, v in e.items()}  # noqa: E731
    return norm(a) == norm(b)


def check_sonic(files: dict[str, str], teardown: dict[str, str], ports: set[str],
                session_limit: int | None) -> Result:
    result = Result()
    table = sonic_config_db(json.loads(files["config_db.json"]), ports, result)
    cli = sonic_commands(files["commands.sh"], ports, result)
    if set(cli) != set(table) or any(not _same_entry(cli[n], table[n]) for n in table):
        result.bad(f"commands.sh builds {cli}, config_db.json holds {table}")
    sources, destinations = {}, defaultdict(list)
    for name, e in table.items():
        dest = e.get("dst_port") if e.get("type", "ERSPAN") == "SPAN" else f"erspan:{e.get('dst_ip')}"
        members = e.get("src_port", "").split(",")
        sources[name] = set(members)
        destinations[dest].append(name)
        for port in members:
            result.add(port, {"RX": "rx", "TX": "tx", "BOTH": "both"}.get(e.get("direction", "BOTH"), "?"), dest)
    _common(result, ports, sources, destinations, session_limit)
    result.sessions = list(table)
    patch = json.loads(teardown["apply-patch.json"])
    for op in patch:
        if op.get("op") != "remove" or not op.get("path", "").startswith("/MIRROR_SESSION") or len(op) != 2:
            result.bad(f"apply-patch.json: {op} is not a JSON-patch removal of MIRROR_SESSION or its entries")
    # The running config after apply: the ports, and MIRROR_SESSION as the apply left it (the
    # apply script refuses a switch whose MIRROR_SESSION already holds sessions).
    running = {"PORT": {port: {"admin_status": "up"} for port in sorted(ports)}, "MIRROR_SESSION": table}
    after = sonic_teardown_patch(patch, running, result)
    removed = [name for name in table if name not in after.get("MIRROR_SESSION", {})]
    cli_removed = [shlex.split(line)[3] for line in _lines(teardown["commands.sh"], ("#",))
                   if shlex.split(line)[:3] == ["config", "mirror_session", "remove"]]
    if cli_removed != removed or len(_lines(teardown["commands.sh"], ("#",))) != len(cli_removed):
        result.bad(f"teardown commands.sh removes {cli_removed}, apply-patch.json removes {removed}")
    result.removed = removed
    return result


# -- Arista EOS -----------------------------------------------------------------------------------

EOS_SOURCE = re.compile(r"monitor session (\S+) source (\S+)(?: (rx|tx|both))?")
EOS_DEST = re.compile(r"monitor session (\S+) destination (?:tunnel mode gre source (\S+) destination (\S+)"
                      r"(?: ttl (\d+))?(?: dscp (\d+))?|(\S+))")
EOS_REMOVE = re.compile(r"no monitor session (\S+)")


def check_eos(files: dict[str, str], teardown: dict[str, str], ports: set[str],
              session_limit: int | None) -> Result:
    result = Result()
    sources: dict[str, set[str]] = {}
    members: dict[str, list[tuple[str, str]]] = defaultdict(list)
    dests: dict[str, list[str]] = {}
    for line in _lines(files["cfg"], ("!",)):
        if m := EOS_SOURCE.fullmatch(line):
            name, port, direction = m.groups()
            members[name].append((port, direction or "both"))
            sources.setdefault(name, set()).add(port)
        elif m := EOS_DEST.fullmatch(line):
            name, gre_src, gre_dst, ttl, dscp, port = m.groups()
            if port in ("tunnel", "cpu") or (gre_src is not None and not (_ipv4(gre_src) and _ipv4(gre_dst))):
                result.bad(f"{line!r}: not a destination EOS accepts")
            if (ttl and not 1 <= int(ttl) <= 255) or (dscp and not 0 <= int(dscp) <= 63):
                result.bad(f"{line!r}: ttl must be 1..255 and dscp 0..63")
            if gre_dst:
                result.erspan[f"erspan:{gre_dst}"] = (int(ttl) if ttl else None, int(dscp) if dscp else None)
            dests.setdefault(name, []).append(port if port else f"erspan:{gre_dst}")
        else:
            result.bad(f"{line!r}: not an EOS monitor-session command")
    destinations: dict[str, list[str]] = defaultdict(list)
    for name in {**sources, **dests}:
        if not re.fullmatch(r"[A-Za-z0-9][-A-Za-z0-9_]{0,31}", name):
            result.bad(f"session name {name!r} is not a plain EOS session name")
        if len(dests.get(name, [])) != 1:
            result.bad(f"session {name} has destinations {dests.get(name, [])}, expected exactly one")
            continue
        destinations[dests[name][0]].append(name)
        sources.setdefault(name, set())
        for port, direction in members[name]:
            result.add(port, direction, dests[name][0])
    _common(result, ports, sources, destinations, session_limit)
    result.sessions = list(sources)
    for line in _lines(teardown["cfg"], ("!",)):
        if m := EOS_REMOVE.fullmatch(line):
            result.removed.append(m.group(1))
        else:
            result.bad(f"teardown {line!r}: not `no monitor session NAME`")
    return result


# -- Cisco NX-OS ----------------------------------------------------------------------------------

def check_nxos(files: dict[str, str], teardown: dict[str, str], ports: set[str],
               session_limit: int | None) -> Result:
    result = Result()
    monitor_ports: set[str] = set()
    origin = None
    sessions: dict[int, dict] = {}
    mode: tuple[str, object] | None = None
    for line in _lines(files["cfg"], ("!",)):
        sub = line.startswith("  ")
        text = line.strip()
        if not sub:
            mode = None
            if m := re.fullmatch(r"interface (\S+)", text):
                mode = ("interface", m.group(1))
            elif m := re.fullmatch(r"monitor erspan origin ip-address (\S+) global", text):
                origin = m.group(1)
                if not _ipv4(origin):
                    result.bad(f"{line!r}: origin is not an IPv4 address")
            elif m := re.fullmatch(r"monitor session (\d+)(?: type (local|erspan-source))?", text):
                number = int(m.group(1))
                if not 1 <= number <= 32:
                    result.bad(f"{line!r}: session number must be 1..32")
                if number in sessions:
                    result.bad(f"{line!r}: session {number} configured twice")
                sessions[number] = {"type": m.group(2) or "local", "sources": [], "dest": [], "ip": None,
                                    "erspan_id": None, "vrf": None, "up": False}
                mode = ("session", number)
            else:
                result.bad(f"{line!r}: not an NX-OS global command this config may use")
        elif mode and mode[0] == "interface":
            if text == "switchport monitor":
                monitor_ports.add(str(mode[1]))
            elif text != "switchport":
                result.bad(f"{line!r}: unexpected in interface mode")
        elif mode and mode[0] == "session":
            s = sessions[int(mode[1])]
            if m := re.fullmatch(r"source interface (\S+)(?: (rx|tx|both))?", text):
                s["sources"].append((m.group(1), m.group(2) or "both"))
            elif m := re.fullmatch(r"destination interface (\S+)", text):
                s["dest"].append(m.group(1))
            elif m := re.fullmatch(r"destination ip (\S+)", text):
                s["ip"] = m.group(1)
            elif m := re.fullmatch(r"erspan-id (\d+)", text):
                s["erspan_id"] = int(m.group(1))
            elif m := re.fullmatch(r"vrf (\S+)", text):
                s["vrf"] = m.group(1)
            elif m := re.fullmatch(r"ip (ttl|dscp) (\d+)", text):
                low, high = (1, 255) if m.group(1) == "ttl" else (0, 63)
                if s["type"] != "erspan-source" or not low <= int(m.group(2)) <= high:
                    result.bad(f"session {number}: {text!r} needs an erspan-source session and {low}..{high}")
                s[m.group(1)] = int(m.group(2))
            elif text == "no shut":
                s["up"] = True
            elif text in ("header-type 3",) or text.startswith("description "):
                if text == "header-type 3" and s["type"] != "erspan-source":
                    result.bad(f"{line!r}: header-type belongs to ERSPAN source sessions")
            else:
                result.bad(f"{line!r}: not a monitor-session command")
        else:
            result.bad(f"{line!r}: indented line outside a mode")
    sources, destinations = {}, defaultdict(list)
    for number, s in sessions.items():
        if not s["up"]:
            result.bad(f"session {number} stays shut (sessions are created shut; `no shut` is missing)")
        if len(s["sources"]) > 48:
            result.bad(f"session {number} has {len(s['sources'])} sources (at most 48 per session)")
        if s["type"] == "local":
            if len(s["dest"]) != 1 or s["ip"] is not None:
                result.bad(f"local session {number}: needs exactly one destination interface, got {s['dest']}")
                continue
            dest = s["dest"][0]
            if dest not in monitor_ports:
                result.bad(f"session {number}: destination {dest} is not in `switchport monitor` mode")
        else:
            if s["dest"] or not (s["ip"] and _ipv4(s["ip"])) or s["vrf"] is None \
                    or not (s["erspan_id"] and 1 <= s["erspan_id"] <= 1023) or origin is None:
                result.bad(f"erspan-source session {number}: needs destination ip, vrf, erspan-id 1..1023 and a "
                           f"global origin address, got {s}")
                continue
            dest = f"erspan:{s['ip']}"
            result.erspan[dest] = (s.get("ttl"), s.get("dscp"))
        destinations[dest].append(number)
        sources[number] = {p for p, _ in s["sources"]}
        for port, direction in s["sources"]:
            result.add(port, direction, dest)
    _common(result, ports, sources, destinations, session_limit, exclusive_destination=True)
    result.sessions = [str(n) for n in sessions]
    freed = set()
    iface = None
    for line in _lines(teardown["cfg"], ("!",)):
        text = line.strip()
        if m := re.fullmatch(r"no monitor session (\d+)", text):
            result.removed.append(m.group(1))
        elif m := re.fullmatch(r"interface (\S+)", text):
            iface = m.group(1)
        elif text == "no switchport monitor" and iface:
            freed.add(iface)
        else:
            result.bad(f"teardown {line!r}: unexpected")
    if freed != monitor_ports:
        result.bad(f"teardown returns {sorted(freed)} from monitor mode, apply set {sorted(monitor_ports)}")
    return result


# -- Juniper Junos --------------------------------------------------------------------------------

@dataclass
class JunosConfig:
    """A Junos candidate configuration as ``set`` statements: top-level ones, configuration
    groups, and the groups inherited through ``apply-groups`` (Junos "Configuration Groups")."""

    top: set[str] = field(default_factory=set)
    groups: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    applied: list[str] = field(default_factory=list)

    def effective(self) -> set[str]:
        return self.top.union(*(self.groups[g] for g in self.applied))

    def run(self, line: str) -> bool:
        """Apply one ``set``/``delete`` line; False when it is neither."""
        if m := re.fullmatch(r"set apply-groups (\S+)", line):
            self.applied += [m.group(1)] if m.group(1) not in self.applied else []
        elif m := re.fullmatch(r"delete apply-groups (\S+)", line):
            self.applied = [g for g in self.applied if g != m.group(1)]
        elif m := re.fullmatch(r"set groups (\S+) (.+)", line):
            self.groups[m.group(1)].add(m.group(2))
        elif m := re.fullmatch(r"delete groups (\S+)", line):
            self.groups.pop(m.group(1), None)
        elif m := re.fullmatch(r"set (.+)", line):
            self.top.add(m.group(1))
        elif m := re.fullmatch(r"delete (.+)", line):     # a path and everything under it
            self.top = {t for t in self.top if t != m.group(1) and not t.startswith(m.group(1) + " ")}
        else:
            return False
        return True


JUNOS_ANALYZER = r"(forwarding-options|ethernet-switching-options) analyzer (\S+)"


def check_junos(files: dict[str, str], teardown: dict[str, str], ports: set[str],
                session_limit: int | None) -> Result:
    """ELS analyzers live under ``forwarding-options``, non-ELS EX ones under
    ``ethernet-switching-options`` (one analyzer). The teardown is run against a switch whose
    output ports were already ``family ethernet-switching`` before the apply: it must leave
    that configuration exactly as it found it."""
    result = Result()
    lines = _lines(files["set"], ("#",))
    if not lines or lines[-1] != "commit":
        result.bad("the configuration is never committed")
    statement = re.compile(r"set (?:groups \S+ )?(?:interfaces \S+ unit \d+ family ethernet-switching|"
                           + JUNOS_ANALYZER + r" (?:input (?:ingress|egress)|output) interface \S+)|"
                           r"set apply-groups \S+")
    config = JunosConfig()
    for line in lines[:-1]:
        if not statement.fullmatch(line) or not config.run(line):
            result.bad(f"{line!r}: not a Junos analyzer statement")
    for group in sorted(set(config.groups) - set(config.applied)):
        result.bad(f"group {group} is never applied (no `set apply-groups {group}`): its statements do nothing")
    switching: set[str] = set()
    inputs: dict[str, list[tuple[str, str]]] = defaultdict(list)
    outputs: dict[str, list[str]] = defaultdict(list)
    styles: set[str] = set()
    for text in sorted(config.effective()):
        if m := re.fullmatch(r"interfaces (\S+) unit (\d+) family ethernet-switching", text):
            switching.add(f"{m.group(1)}.{m.group(2)}")
        elif m := re.fullmatch(JUNOS_ANALYZER + r" input (ingress|egress) interface (\S+)", text):
            styles.add(m.group(1))
            inputs[m.group(2)].append((m.group(4), {"ingress": "rx", "egress": "tx"}[m.group(3)]))
        elif m := re.fullmatch(JUNOS_ANALYZER + r" output interface (\S+)", text):
            styles.add(m.group(1))
            outputs[m.group(2)].append(m.group(3))
    if len(styles) > 1:
        result.bad("analyzers under both forwarding-options (ELS) and ethernet-switching-options (non-ELS)")
    if styles == {"ethernet-switching-options"} and len({*inputs, *outputs}) > 1:
        result.bad(f"{len({*inputs, *outputs})} analyzers, but a non-ELS EX switch has one")
    physical = lambda ifl: ifl.rsplit(".", 1)[0] if re.fullmatch(r"\S+\.\d+", ifl) else None  # noqa: E731
    sources, destinations = {}, defaultdict(list)
    for name in {*inputs, *outputs}:
        if len(outputs[name]) != 1:
            result.bad(f"analyzer {name}: outputs {outputs[name]}, expected one")
            continue
        out = outputs[name][0]
        if physical(out) is None:
            result.bad(f"analyzer {name}: output {out!r} is not a logical interface IF.UNIT")
            continue
        if out not in switching:
            result.bad(f"analyzer {name}: output {out} is not family ethernet-switching")
        destinations[physical(out)].append(name)
        sources[name] = set()
        for ifl, direction in inputs[name]:
            if physical(ifl) is None:
                result.bad(f"analyzer {name}: input {ifl!r} is not a logical interface IF.UNIT")
                continue
            sources[name].add(physical(ifl))
            result.add(physical(ifl), direction, physical(out))
    _common(result, ports, sources, destinations, session_limit)
    result.sessions = list(sources)
    # Teardown on a switch whose output ports were switching ports before the apply.
    prior = {f"interfaces {physical(o)} unit 0 family ethernet-switching" for outs in outputs.values() for o in outs
             if physical(o)}
    switch = JunosConfig(top=set(prior))
    for line in lines[:-1]:
        switch.run(line)
    undo = _lines(teardown["set"], ("#",))
    if not undo or undo[-1] != "commit":
        result.bad("the teardown is never committed")
    for line in undo[:-1]:
        if not re.fullmatch(r"delete \S.*", line) or not switch.run(line):
            result.bad(f"teardown {line!r}: unexpected")
    after = switch.effective()
    result.removed = [name for name in sources if not any(re.fullmatch(JUNOS_ANALYZER + r" .*", t)
                                                          and t.split()[2] == name for t in after)]
    if after != prior:
        result.bad(f"after the teardown the switch holds {sorted(after)}, before the apply it held {sorted(prior)}")
    return result


# -- H3C Comware ----------------------------------------------------------------------------------

COMWARE_WAY = {"inbound": "rx", "outbound": "tx", "both": "both"}
#: ``mirroring-group ID monitor-port IF [destination-ip D source-ip S [dscp N | vlan V | vrf-instance NAME]*]``
#: (H3C "Configuring port mirroring", ERSPAN in encapsulation parameter mode).
COMWARE_MONITOR = re.compile(r"mirroring-group (\d+) monitor-port (\S+)(?: destination-ip (\S+) source-ip (\S+)"
                             r"(?: dscp (\d+)| vlan (\d+)| vrf-instance (\S+))*)?")
#: "A Layer 2 or Layer 3 aggregate interface ... cannot be configured as a source port" nor as a monitor port.
COMWARE_AGGREGATE = re.compile(r"(Bridge|Route)-Aggregation\d+", re.IGNORECASE)


def check_comware(files: dict[str, str], teardown: dict[str, str], ports: set[str],
                  session_limit: int | None) -> Result:
    result = Result()
    lines = _lines(files["cfg"], ("#",))
    if lines[:1] != ["system-view"] or lines[-1:] != ["return"]:
        result.bad("mirroring-group commands must run in system view (system-view ... return)")
    groups: dict[int, dict] = {}
    for line in lines[1:-1]:
        if m := re.fullmatch(r"mirroring-group (\d+) (local|remote-source)", line):
            number = int(m.group(1))
            if number in groups:
                result.bad(f"{line!r}: group {number} created twice")
            if m.group(2) != "local":
                result.bad(f"{line!r}: a remote-source group needs a remote-probe VLAN this config lacks")
            groups[number] = {"sources": [], "monitor": []}
        elif m := re.fullmatch(r"mirroring-group (\d+) mirroring-port (\S+) (inbound|outbound|both)", line):
            if int(m.group(1)) not in groups:
                result.bad(f"{line!r}: group {m.group(1)} does not exist yet")
                continue
            groups[int(m.group(1))]["sources"].append((m.group(2), COMWARE_WAY[m.group(3)]))
        elif m := COMWARE_MONITOR.fullmatch(line):
            number, port, dst, src, dscp, vlan, _ = m.groups()
            if int(number) not in groups:
                result.bad(f"{line!r}: group {number} does not exist yet")
                continue
            if COMWARE_AGGREGATE.fullmatch(port):
                result.bad(f"{line!r}: an aggregate interface cannot be a monitor port")
            groups[int(number)]["monitor"].append(port)
            if dst is not None:
                if not (_ipv4(dst) and _ipv4(src)):
                    result.bad(f"{line!r}: destination-ip and source-ip must be IPv4 addresses")
                if (dscp and not 0 <= int(dscp) <= 63) or (vlan and not 1 <= int(vlan) <= 4094):
                    result.bad(f"{line!r}: dscp must be 0..63 and vlan 1..4094")
                groups[int(number)]["erspan"] = dst
                groups[int(number)]["erspan_port"] = port
                result.erspan[f"erspan:{dst}"] = (None, int(dscp) if dscp else None)
        else:
            result.bad(f"{line!r}: not a Comware mirroring-group command")
    sources, destinations = {}, defaultdict(list)
    erspan_ports = {g["erspan_port"] for g in groups.values() if "erspan_port" in g}
    for number, g in groups.items():
        if len(g["monitor"]) != 1:
            result.bad(f"group {number}: monitor ports {g['monitor']}, expected one")
            continue
        destination = f"erspan:{g['erspan']}" if "erspan" in g else g["monitor"][0]
        destinations[destination].append(number)
        if "erspan" not in g and g["monitor"][0] in erspan_ports:
            result.bad(f"group {number}: {g['monitor'][0]} is both a SPAN monitor port and ERSPAN's egress port")
        sources[number] = {p for p, _ in g["sources"]}
        for port, direction in g["sources"]:
            if COMWARE_AGGREGATE.fullmatch(port):
                result.bad(f"group {number}: {port} is an aggregate interface; mirror its member ports")
            if "erspan" in g and direction != "rx":
                result.bad(f"group {number}: ERSPAN in encapsulation parameter mode takes inbound sources only")
            result.add(port, direction, destination)
    for port in erspan_ports:
        if port not in ports:
            result.bad(f"ERSPAN monitor port {port!r} is not a port of this switch")
        if any(port in members for members in sources.values()):
            result.bad(f"ERSPAN monitor port {port} is also a mirror source")
    _common(result, ports, sources, destinations, session_limit)
    result.sessions = [str(n) for n in groups]
    undo = _lines(teardown["cfg"], ("#",))
    if undo[:1] != ["system-view"] or undo[-1:] != ["return"]:
        result.bad("teardown must run in system view")
    for line in undo[1:-1]:
        if m := re.fullmatch(r"undo mirroring-group (\d+)", line):
            result.removed.append(m.group(1))
        else:
            result.bad(f"teardown {line!r}: unexpected")
    return result


# -- NVIDIA Cumulus NVUE --------------------------------------------------------------------------

NVUE_WAY = {"ingress": "rx", "egress": "tx"}


def check_nvue(files: dict[str, str], teardown: dict[str, str], ports: set[str],
               session_limit: int | None) -> Result:
    result = Result()
    lines = _lines(files["sh"], ("#",))
    if lines[-1:] != ["nv config apply"]:
        result.bad("the pending NVUE configuration is never applied")
    sessions: dict[int, dict] = {}
    for line in lines[:-1]:
        m = re.fullmatch(r"nv set system port-mirror session (\d+) (span|erspan) (source-port|destination|direction|"
                         r"destination source-ip|destination dest-ip) (\S+)", line)
        if not m:
            result.bad(f"{line!r}: not an NVUE port-mirror span/erspan command")
            continue
        number, kind, what, value = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if not 0 <= number <= 7:
            result.bad(f"{line!r}: session id must be 0..7")
        allowed = {"span": ("source-port", "destination", "direction"),
                   "erspan": ("source-port", "direction", "destination source-ip", "destination dest-ip")}[kind]
        if what not in allowed:
            result.bad(f"{line!r}: {kind} has no {what!r}")
            continue
        s = sessions.setdefault(number, {"kind": set(), "source-port": [], "destination": [], "direction": [],
                                         "destination source-ip": [], "destination dest-ip": []})
        s["kind"].add(kind)
        s[what].append(value)
    sources, destinations = {}, defaultdict(list)
    for number, s in sessions.items():
        erspan = s["kind"] == {"erspan"}
        dests = [f"erspan:{ip}" for ip in s["destination dest-ip"]] if erspan else s["destination"]
        if len(s["kind"]) != 1 or len(dests) != 1 or len(s["direction"]) != 1 or s["direction"][0] not in NVUE_WAY:
            result.bad(f"session {number}: needs one kind, one destination and one direction ingress|egress, got {s}")
            continue
        if erspan and not (len(s["destination source-ip"]) == 1 and _ipv4(s["destination source-ip"][0])
                           and _ipv4(s["destination dest-ip"][0])):
            result.bad(f"session {number}: ERSPAN needs one IPv4 source-ip and dest-ip, got {s}")
        dest = dests[0]
        destinations[dest].append(number)
        sources[number] = set(s["source-port"])
        for port in s["source-port"]:
            result.add(port, NVUE_WAY[s["direction"][0]], dest)
    _common(result, ports, sources, destinations, session_limit)
    result.sessions = [str(n) for n in sessions]
    undo = _lines(teardown["sh"], ("#",))
    if undo[-1:] != ["nv config apply"]:
        result.bad("the teardown is never applied")
    for line in undo[:-1]:
        if m := re.fullmatch(r"nv unset system port-mirror session (\d+)", line):
            result.removed.append(m.group(1))
        else:
            result.bad(f"teardown {line!r}: unexpected")
    return result


# -- Linux tc -------------------------------------------------------------------------------------

LINUX_IFNAME = re.compile(r"[^/:\s]{1,15}")
TC_HOOK_WAY = {"ingress": "rx", "egress": "tx"}


def check_linux(files: dict[str, str], teardown: dict[str, str], ports: set[str],
                session_limit: int | None) -> Result:
    """``ports`` are the switch's Linux interface names here."""
    result = Result()
    clsact: set[str] = set()
    filters: dict[tuple[str, str], tuple[int, str]] = {}
    for line in _lines(files["sh"], ("#",)):
        if m := re.fullmatch(r"tc qdisc add dev (\S+) clsact", line):
            if m.group(1) in clsact:
                result.bad(f"{line!r}: clsact added twice (the second add fails with EEXIST)")
            clsact.add(m.group(1))
        elif m := re.fullmatch(r"tc filter add dev (\S+) (ingress|egress) protocol all prio (\d+) u32 match u32 0 0 "
                               r"action mirred egress mirror dev (\S+)", line):
            dev, hook, prio, dest = m.group(1), m.group(2), int(m.group(3)), m.group(4)
            if dev not in clsact:
                result.bad(f"{line!r}: no clsact qdisc on {dev} yet")
            if not 1 <= prio <= 0xFFFF:
                result.bad(f"{line!r}: prio must be 1..65535 to be removable by priority")
            if (dev, hook) in filters:
                result.bad(f"{line!r}: {dev} {hook} already has a gradtap filter")
            if dest == dev:
                result.bad(f"{line!r}: mirrors {dev} to itself")
            filters[dev, hook] = (prio, dest)
        else:
            result.bad(f"{line!r}: not a tc command of a mirror")
    for dev in {d for d, _ in filters} | clsact | {dest for _, dest in filters.values()}:
        if not LINUX_IFNAME.fullmatch(dev) or len(dev.encode()) > 15:
            result.bad(f"{dev!r} is not a valid Linux interface name")
    by_dev = defaultdict(set)
    for (dev, hook), (prio, _) in filters.items():
        by_dev[dev, prio].add(hook)
    for (dev, prio), hooks in by_dev.items():
        if len(hooks) > 1:
            result.bad(f"{dev}: ingress and egress filters share prio {prio} (u32 lists both hooks' tables "
                       "under one priority)")
    sources, destinations = {}, defaultdict(list)
    for (dev, hook), (_, dest) in filters.items():
        result.add(dev, TC_HOOK_WAY[hook], dest)
        sources.setdefault(dest, set()).add(dev)
    for dest in sources:
        destinations[dest].append(dest)       # a tc "session" is a destination
    _common(result, ports, sources, destinations, session_limit)
    removed_filters, removed_qdiscs = {}, set()
    for line in _lines(teardown["sh"], ("#",)):
        if m := re.fullmatch(r"tc filter del dev (\S+) (ingress|egress) protocol all prio (\d+)", line):
            removed_filters[m.group(1), m.group(2)] = int(m.group(3))
        elif m := re.fullmatch(r"tc qdisc del dev (\S+) clsact", line):
            removed_qdiscs.add(m.group(1))
        else:
            result.bad(f"teardown {line!r}: unexpected")
    if removed_filters != {k: p for k, (p, _) in filters.items()} or removed_qdiscs != clsact:
        result.bad("the teardown does not remove exactly the filters and qdiscs the apply adds")
    result.sessions = result.removed = sorted(sources)
    return result


CHECKS = {"sonic": check_sonic, "eos": check_eos, "nxos": check_nxos, "junos": check_junos,
          "comware": check_comware, "nvue": check_nvue, "linux": check_linux}


def check(vendor: str, apply: dict[str, str], teardown: dict[str, str], ports: set[str],
          session_limit: int | None = None) -> Result:
    """Validate one switch's rendered files (``SwitchConfig.apply``/``teardown``) for ``vendor``."""
    result = CHECKS[vendor](apply, teardown, ports, session_limit)
    if Counter(result.removed) != Counter(result.sessions):
        result.bad(f"the teardown removes {result.removed}, the apply creates {result.sessions}")
    return result
