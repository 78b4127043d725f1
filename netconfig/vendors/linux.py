"""Linux: mirror sessions as tc filters -- a clsact qdisc, a match-all filter and a ``mirred
egress mirror`` action per mirrored hook.

A Linux host (or bridge) acting as the switch mirrors a port's received frames on the tc
*ingress* hook and its transmitted frames on the *egress* hook. A switch port receives what
the GPU NIC transmits, so NIC egress (switch RX) is the ingress hook and NIC ingress is the
egress hook. Which Linux interface is which switch port comes from the topology's
``linux_ifname`` (or the port name itself when it is a valid interface name).

This module maps a plan to :class:`TcMirror` records and renders them as ``tc`` commands;
:mod:`gradtap.netconfig.linux_mirror` applies the same records through netlink.
"""

from __future__ import annotations

import re
from shlex import quote
from dataclasses import dataclass
from typing import Literal

from gradtap.core.errors import ConfigError
from gradtap.netconfig.hardware import LINUX_IFNAME
from gradtap.netconfig.plan import SwitchInfo
from gradtap.netconfig.vendors.base import Session, SwitchConfig, VendorSpec

SPEC = VendorSpec(
    name="linux", title="Linux tc", max_sessions=None, session_numbers=None, name_pattern=None,
    encapsulations=frozenset({"none"}), direction_per_session=False, has_both=True,
)
Hook = Literal["ingress", "egress"]
HOOKS: dict[str, tuple[Hook, ...]] = {"rx": ("ingress",), "tx": ("egress",), "both": ("ingress", "egress")}
#: tc priorities that mark gradtap's filters, one per hook: u32 on a clsact qdisc lists the
#: hash tables of both hooks under a priority that is used on both, so they must differ.
PRIORITY: dict[Hook, int] = {"ingress": 0xC7A1, "egress": 0xC7A2}


@dataclass(frozen=True, order=True)
class TcMirror:
    """Mirror every frame on hook ``hook`` of ``ifname`` to the transmit side of ``dest_ifname``."""

    ifname: str
    hook: Hook
    dest_ifname: str


def ifname_of(switch: SwitchInfo, port: str) -> str:
    ifname = switch.linux_ifnames.get(port, port)
    if not re.fullmatch(LINUX_IFNAME, ifname):
        raise ConfigError(f"switch {switch.name} port {port!r}: {ifname!r} is not a Linux interface name "
                          f"(1 to 15 of letters, digits and _.@+-); set linux_ifname for it in the "
                          f"topology's leaf_switches[].ports")
    return ifname


def tc_mirrors(switch: SwitchInfo, sessions: list[Session]) -> list[TcMirror]:
    """The tc filters that implement ``sessions``, one per (interface, hook), in session order."""
    mirrors: dict[tuple[str, Hook], TcMirror] = {}
    for s in sessions:
        dest = ifname_of(switch, str(s.destination))
        for m in s.members:
            for hook in HOOKS[m.direction]:
                mirror = TcMirror(ifname_of(switch, m.port), hook, dest)
                if (mirror.ifname, hook) in mirrors:
                    raise ConfigError(f"switch {switch.name}: {mirror.ifname} {hook} is mirrored twice")
                mirrors[mirror.ifname, hook] = mirror
    return list(mirrors.values())


def render(switch: SwitchInfo, sessions: list[Session]) -> SwitchConfig:
    mirrors = tc_mirrors(switch, sessions)
    ifnames = list(dict.fromkeys(m.ifname for m in mirrors))
    lines = [f"# {switch.name}: gradtap mirror sessions (Linux tc: clsact, u32 match-all, mirred)"]
    # Names are validated (LINUX_IFNAME) and quoted as well: the script is run by root.
    lines += [f"tc qdisc add dev {quote(ifname)} clsact" for ifname in ifnames]
    lines += [f"tc filter add dev {quote(m.ifname)} {m.hook} protocol all prio {PRIORITY[m.hook]} u32 match u32 0 0 "
              f"action mirred egress mirror dev {quote(m.dest_ifname)}" for m in mirrors]
    undo = [f"# {switch.name}: remove gradtap mirror sessions (Linux tc)"]
    undo += [f"tc filter del dev {quote(m.ifname)} {m.hook} protocol all prio {PRIORITY[m.hook]}" for m in mirrors]
    undo.append("# delete clsact only where no other filter is left (`gradtap netconfig teardown --linux` checks)")
    undo += [f"tc qdisc del dev {quote(ifname)} clsact" for ifname in ifnames]
    return SwitchConfig(switch.name, SPEC.name, apply={"sh": "\n".join(lines) + "\n"},
                        teardown={"sh": "\n".join(undo) + "\n"})
