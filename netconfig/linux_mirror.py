"""Apply and remove a plan's mirroring on Linux interfaces through netlink (pyroute2).

Per mirrored hook: a clsact qdisc on the interface, a match-all filter on its ingress or
egress hook, and a ``mirred egress mirror`` action to the destination interface. The
filter is ``cls_matchall`` where the kernel has it; kernels built without it (like the one
gradtap's CI runs on) get a u32 filter with one all-zero key, which also matches every
frame. Detection is by trying: the first ``matchall`` add that fails with ENOENT or
EOPNOTSUPP ("classifier not found") switches the run to u32.

gradtap's filters are the ones at tc priorities :data:`gradtap.netconfig.vendors.linux.PRIORITY`
(one per hook); nothing else is touched. That makes both verbs idempotent:

- ``apply`` leaves a correct filter alone, replaces one at our priority that mirrors
  elsewhere, and adds missing ones; applying twice equals applying once;
- ``teardown`` deletes our priorities on the planned hooks (absent ones are fine), then
  deletes the clsact qdisc of an interface only if no filter at all is left on it.

Kernel errors keep their errno (:class:`gradtap.core.errors.NetlinkError`) and name the interface.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from socket import htons

from pyroute2 import IPRoute, NetNS, netns as namespaces, protocols
from pyroute2.netlink.exceptions import NetlinkError as PyrouteNetlinkError
from pyroute2.netlink.rtnl import TC_H_CLSACT

from gradtap.core.errors import ConfigError, NetlinkError
from gradtap.netconfig.plan import Plan
from gradtap.netconfig.vendors import linux
from gradtap.netconfig.vendors.base import build_sessions
from gradtap.netconfig.vendors.linux import PRIORITY, Hook, TcMirror

CLSACT_HANDLE = 0xFFFF0000
# linux/pkt_sched.h: TC_H_MIN_INGRESS / TC_H_MIN_EGRESS under the clsact major.
PARENT: dict[Hook, int] = {"ingress": (TC_H_CLSACT & 0xFFFF0000) | 0xFFF2,
                           "egress": (TC_H_CLSACT & 0xFFFF0000) | 0xFFF3}
#: tc_mirred.h TCA_EGRESS_MIRROR: the only mirred action gradtap installs.
EGRESS_MIRROR = 2
_NO_CLASSIFIER = (errno.ENOENT, errno.EOPNOTSUPP)


@dataclass
class ApplyResult:
    created: list[TcMirror] = field(default_factory=list)
    replaced: list[TcMirror] = field(default_factory=list)
    unchanged: list[TcMirror] = field(default_factory=list)
    #: "matchall" or "u32": the classifier new filters were created with (None if none were).
    classifier: str | None = None


@dataclass
class TeardownResult:
    removed: list[TcMirror] = field(default_factory=list)
    absent: list[TcMirror] = field(default_factory=list)
    qdiscs_removed: list[str] = field(default_factory=list)


def plan_mirrors(plan: Plan, switch: str | None = None) -> tuple[str, list[TcMirror]]:
    """The switch to act on and its tc mirrors. ``switch`` may be omitted if one switch mirrors."""
    mirroring = [sw.name for sw in plan.switches if plan.sources_on(sw.name)]
    if switch is None:
        if len(mirroring) != 1:
            raise ConfigError(f"the plan mirrors on {len(mirroring)} switches ({', '.join(mirroring)}); "
                              "choose the Linux one with --switch")
        switch = mirroring[0]
    info = plan.switch(switch)
    sessions = build_sessions(linux.SPEC, info, plan.sources_on(switch), plan.mirror)
    return switch, linux.tc_mirrors(info, sessions)


class _Link:
    """One netlink socket (in ``netns`` or the current namespace) with errors that name the interface."""

    def __init__(self, netns: str | None):
        self.netns = netns
        self.where = f" in netns {netns!r}" if netns else ""
        # NetNS() would create a missing namespace; acting on an empty one helps nobody.
        if netns and netns not in namespaces.listnetns():
            raise NetlinkError(f"network namespace {netns!r} does not exist", errno=errno.ENOENT)
        try:
            self.ipr = NetNS(netns) if netns else IPRoute()
        except (OSError, PyrouteNetlinkError) as exc:
            code = getattr(exc, "code", None) or getattr(exc, "errno", None)
            raise NetlinkError(f"cannot open netlink{self.where}: {exc}", errno=code) from exc
        self._index: dict[str, int] = {}

    def close(self) -> None:
        self.ipr.close()

    def call(self, what: str, ifname: str, method: str, /, *args, **kwargs):
        try:
            return getattr(self.ipr, method)(*args, **kwargs)
        except PyrouteNetlinkError as exc:
            raise NetlinkError(f"{what} on interface {ifname!r}{self.where}: {os.strerror(exc.code)} "
                               f"(errno {exc.code})", errno=exc.code) from exc

    def index(self, ifname: str) -> int:
        if ifname not in self._index:
            found = self.call("looking up", ifname, "link_lookup", ifname=ifname)
            if not found:
                raise NetlinkError(f"interface {ifname!r} not found{self.where}", errno=errno.ENODEV)
            self._index[ifname] = found[0]
        return self._index[ifname]

    def clsact_kind(self, ifname: str) -> str | None:
        """Kind of the qdisc in the clsact/ingress slot of ``ifname`` (None if empty)."""
        for msg in self.call("listing qdiscs", ifname, "get_qdiscs", index=self.index(ifname)):
            if msg["index"] == self.index(ifname) and msg["handle"] == CLSACT_HANDLE:
                return msg.get_attr("TCA_KIND")
        return None

    def filters(self, ifname: str, hook: Hook) -> list:
        return list(self.call(f"listing {hook} filters", ifname, "get_filters",
                              index=self.index(ifname), parent=PARENT[hook]))


def _mirred_targets(msg) -> set[int]:
    """Interface indexes that the egress-mirror actions of one filter message send to."""
    options = msg.get_attr("TCA_OPTIONS")
    if options is None:
        return set()
    actions = options.get_attr("TCA_U32_ACT") or options.get_attr("TCA_MATCHALL_ACT")
    targets = set()
    for _, action in (actions or {}).get("attrs", []):
        if action.get_attr("TCA_ACT_KIND") == "mirred":
            parms = action.get_attr("TCA_ACT_OPTIONS").get_attr("TCA_MIRRED_PARMS")
            if parms["eaction"] == EGRESS_MIRROR:
                targets.add(parms["ifindex"])
    return targets


def _ours(link: _Link, mirror: TcMirror) -> list:
    return [m for m in link.filters(mirror.ifname, mirror.hook) if m["info"] >> 16 == PRIORITY[mirror.hook]]


def _delete_ours(link: _Link, mirror: TcMirror) -> bool:
    """Delete every filter at our priority on this hook; False if there was none."""
    # tcm_info carries the priority: a delete without it would remove every filter of the hook.
    info = (PRIORITY[mirror.hook] << 16) | htons(protocols.ETH_P_ALL)
    try:
        link.ipr.tc("del-filter", index=link.index(mirror.ifname), parent=PARENT[mirror.hook], info=info)
    except PyrouteNetlinkError as exc:
        if exc.code == errno.ENOENT:
            return False
        raise NetlinkError(f"deleting the {mirror.hook} mirror filter on interface {mirror.ifname!r}{link.where}: "
                           f"{os.strerror(exc.code)} (errno {exc.code})", errno=exc.code) from exc
    return True


def _add(link: _Link, mirror: TcMirror, result: ApplyResult) -> None:
    action = {"kind": "mirred", "direction": "egress", "action": "mirror", "ifindex": link.index(mirror.dest_ifname)}
    common = {"parent": PARENT[mirror.hook], "prio": PRIORITY[mirror.hook], "protocol": protocols.ETH_P_ALL,
              "action": action}
    index = link.index(mirror.ifname)
    what = f"adding the {mirror.hook} mirror filter to {mirror.dest_ifname}"
    if result.classifier in (None, "matchall"):
        try:
            link.ipr.tc("add-filter", "matchall", index, **common)
            result.classifier = "matchall"
            return
        except PyrouteNetlinkError as exc:
            if exc.code not in _NO_CLASSIFIER:
                raise NetlinkError(f"{what} on interface {mirror.ifname!r}{link.where}: {os.strerror(exc.code)} "
                                   f"(errno {exc.code})", errno=exc.code) from exc
            result.classifier = "u32"
    # u32 with one key matching 0 bits at offset 0: every frame.
    link.call(what, mirror.ifname, "tc", "add-filter", "u32", index, target=0, keys=["0x0/0x0+0"], **common)


def apply_mirrors(mirrors: list[TcMirror], netns: str | None = None) -> ApplyResult:
    """Make the kernel hold exactly these mirror filters at gradtap's priorities (idempotent)."""
    result = ApplyResult()
    link = _Link(netns)
    try:
        for ifname in dict.fromkeys(m.ifname for m in mirrors):
            kind = link.clsact_kind(ifname)
            if kind is None:
                link.call("adding a clsact qdisc", ifname, "tc", "add", "clsact", link.index(ifname))
            elif kind != "clsact":
                raise NetlinkError(f"interface {ifname!r}{link.where} has a {kind!r} qdisc where clsact must go; "
                                   f"remove it first (tc qdisc del dev {ifname} {kind})", errno=errno.EEXIST)
        for mirror in mirrors:
            existing = _ours(link, mirror)
            targets = set().union(*(_mirred_targets(m) for m in existing)) if existing else set()
            if targets == {link.index(mirror.dest_ifname)}:
                result.unchanged.append(mirror)
                continue
            if existing:
                _delete_ours(link, mirror)
                result.replaced.append(mirror)
            else:
                result.created.append(mirror)
            _add(link, mirror, result)
    finally:
        link.close()
    return result


def teardown_mirrors(mirrors: list[TcMirror], netns: str | None = None) -> TeardownResult:
    """Remove gradtap's filters on these hooks, and clsact qdiscs left without any filter."""
    result = TeardownResult()
    link = _Link(netns)
    try:
        ifnames = dict.fromkeys(m.ifname for m in mirrors)
        has_clsact = {ifname: link.clsact_kind(ifname) == "clsact" for ifname in ifnames}
        for mirror in mirrors:
            # Without a clsact qdisc the hooks hold no filters (and the kernel rejects the delete).
            removed = has_clsact[mirror.ifname] and _delete_ours(link, mirror)
            (result.removed if removed else result.absent).append(mirror)
        for ifname, present in has_clsact.items():
            if present and not link.filters(ifname, "ingress") and not link.filters(ifname, "egress"):
                link.call("deleting the clsact qdisc", ifname, "tc", "del", "clsact", link.index(ifname))
                result.qdiscs_removed.append(ifname)
    finally:
        link.close()
    return result
