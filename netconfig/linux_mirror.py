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
  elsewhere, and adds missing ones; applying twice equals applying once. When a step fails,
  it undoes what it did before raising: filters it added are deleted, filters it replaced
  point where they did, clsact qdiscs it added are deleted;
- ``teardown`` deletes our priorities on the given hooks (absent ones are fine), then deletes
  a clsact qdisc only if gradtap added it and no filter at all is left on it: a clsact that
  was there before (even an empty one) stays.

What was applied is recorded per host (:class:`MirrorRecord`, a JSON file written atomically:
temporary file, fsync, rename, directory fsync). :func:`apply_recorded` applies a plan's
mirrors, removes those of the previous record that the plan no longer has, and records the
result; :func:`teardown_recorded` removes what the record holds, so a teardown after
re-planning removes the mirrors that are running, not the ones a new plan names.

Kernel errors keep their errno (:class:`gradtap.core.errors.NetlinkError`) and name the interface.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from socket import htons
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

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
    #: Interfaces whose clsact qdisc this apply added.
    qdiscs_added: list[str] = field(default_factory=list)
    #: "matchall" or "u32": the classifier new filters were created with (None if none were).
    classifier: str | None = None
    #: Mirrors of the previous record that the new plan no longer has, removed (apply_recorded).
    stale_removed: list[TcMirror] = field(default_factory=list)
    #: For each replaced mirror, the interface indexes its filter mirrored to before.
    previous_targets: dict[TcMirror, set[int]] = field(default_factory=dict)


@dataclass
class TeardownResult:
    removed: list[TcMirror] = field(default_factory=list)
    absent: list[TcMirror] = field(default_factory=list)
    qdiscs_removed: list[str] = field(default_factory=list)
    #: clsact qdiscs left in place because gradtap did not add them.
    qdiscs_kept: list[str] = field(default_factory=list)


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


def _add(link: _Link, mirror: TcMirror, result: ApplyResult, dest_index: int | None = None) -> None:
    """Add our filter for ``mirror`` (to ``dest_index`` instead of its destination, when given)."""
    dest = link.index(mirror.dest_ifname) if dest_index is None else dest_index
    action = {"kind": "mirred", "direction": "egress", "action": "mirror", "ifindex": dest}
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
    """Make the kernel hold these mirror filters at gradtap's priorities (idempotent); on failure,
    undo this call's changes and raise the first error, saying what was rolled back."""
    result = ApplyResult()
    link = _Link(netns)
    try:
        checked: set[str] = set()
        for mirror in mirrors:
            if mirror.ifname not in checked:
                _ensure_clsact(link, mirror.ifname, result)
                checked.add(mirror.ifname)
            existing = _ours(link, mirror)
            targets = set().union(*(_mirred_targets(m) for m in existing)) if existing else set()
            if targets == {link.index(mirror.dest_ifname)}:
                result.unchanged.append(mirror)
                continue
            if existing:
                _delete_ours(link, mirror)
                result.replaced.append(mirror)
                result.previous_targets[mirror] = targets
            else:
                result.created.append(mirror)
            _add(link, mirror, result)
    except NetlinkError as exc:
        undone = _roll_back(link, result)
        raise NetlinkError(f"{exc}; {undone}", errno=exc.errno) from exc
    finally:
        link.close()
    return result


def _ensure_clsact(link: _Link, ifname: str, result: ApplyResult) -> None:
    kind = link.clsact_kind(ifname)
    if kind is None:
        link.call("adding a clsact qdisc", ifname, "tc", "add", "clsact", link.index(ifname))
        result.qdiscs_added.append(ifname)
    elif kind != "clsact":
        raise NetlinkError(f"interface {ifname!r}{link.where} has a {kind!r} qdisc where clsact must go; "
                           f"remove it first (tc qdisc del dev {ifname} {kind})", errno=errno.EEXIST)


def _roll_back(link: _Link, result: ApplyResult) -> str:
    """Undo a failed apply's changes, newest first; say what was undone and what could not be."""
    failed = []
    # The mirror being added when the error came may have been deleted (replaced) but not re-added.
    for mirror in reversed(result.created + result.replaced):
        try:
            _delete_ours(link, mirror)
            for target in sorted(result.previous_targets.get(mirror, ())):
                _add(link, mirror, ApplyResult(classifier=result.classifier), dest_index=target)
        except NetlinkError as exc:
            failed.append(str(exc))
    for ifname in reversed(result.qdiscs_added):
        try:
            link.call("deleting the clsact qdisc", ifname, "tc", "del", "clsact", link.index(ifname))
        except NetlinkError as exc:
            failed.append(str(exc))
    done = (f"rolled back: {len(result.created)} added and {len(result.replaced)} replaced mirror filters, "
            f"{len(result.qdiscs_added)} added clsact qdiscs")
    return done + (f"; rollback FAILED for: {'; '.join(failed)}" if failed else "")


def teardown_mirrors(mirrors: list[TcMirror], netns: str | None = None,
                     qdiscs_added: set[str] = frozenset()) -> TeardownResult:
    """Remove gradtap's filters on these hooks, then the clsact qdiscs of ``qdiscs_added``
    (those gradtap created) that are left without any filter; other clsact qdiscs stay."""
    result = TeardownResult()
    link = _Link(netns)
    try:
        has_clsact = {}
        for ifname in dict.fromkeys(m.ifname for m in mirrors):
            try:
                has_clsact[ifname] = link.clsact_kind(ifname) == "clsact"
            except NetlinkError as exc:
                if exc.errno != errno.ENODEV:
                    raise
                has_clsact[ifname] = False   # the interface is gone, and its qdiscs and filters with it
        for mirror in mirrors:
            # Without a clsact qdisc the hooks hold no filters (and the kernel rejects the delete).
            removed = has_clsact[mirror.ifname] and _delete_ours(link, mirror)
            (result.removed if removed else result.absent).append(mirror)
        for ifname, present in has_clsact.items():
            if not present:
                continue
            if ifname not in qdiscs_added:
                result.qdiscs_kept.append(ifname)
            elif not link.filters(ifname, "ingress") and not link.filters(ifname, "egress"):
                link.call("deleting the clsact qdisc", ifname, "tc", "del", "clsact", link.index(ifname))
                result.qdiscs_removed.append(ifname)
    finally:
        link.close()
    return result


class MirrorRecord(BaseModel):
    """What ``apply --linux`` installed on this host: its mirrors and the clsact qdiscs it added."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["gradtap-linux-mirrors/1"] = "gradtap-linux-mirrors/1"
    switch: str
    netns: str | None = None
    mirrors: list[TcMirror] = []
    qdiscs_added: list[str] = []


#: Where records live unless ``--state`` names a file: one per (switch, namespace) on this host.
STATE_DIR = Path("/var/lib/gradtap/netconfig")


def default_state_path(switch: str, netns: str | None) -> Path:
    return STATE_DIR / (f"{switch}@{netns}.json" if netns else f"{switch}.json")


def load_record(path: Path) -> MirrorRecord | None:
    """The record at ``path``, or None if there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the record of applied mirrors: {exc.strerror}") from None
    try:
        return MirrorRecord.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ConfigError(f"{path}: not a record of applied mirrors ({exc}); it is written by `gradtap netconfig "
                          f"apply --linux`: move it away only once the mirrors it names are gone") from None


def save_record(record: MirrorRecord, path: Path) -> None:
    """Write ``record`` atomically: a reader sees the old record or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(record.model_dump_json(indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def apply_recorded(switch: str, mirrors: list[TcMirror], state: Path, netns: str | None = None) -> ApplyResult:
    """Apply ``mirrors``, remove the previously recorded mirrors the new set lacks, and record the
    result at ``state``. A failed apply is rolled back and leaves the record as it was."""
    previous = load_record(state)
    if previous is not None and (previous.switch, previous.netns) != (switch, netns):
        raise ConfigError(f"{state} records mirrors of switch {previous.switch!r}"
                          f"{f' in netns {previous.netns!r}' if previous.netns else ''}, not {switch!r}"
                          f"{f' in netns {netns!r}' if netns else ''}; pass another --state")
    result = apply_mirrors(mirrors, netns)
    owned = set(previous.qdiscs_added if previous else ()) | set(result.qdiscs_added)
    hooks = {(m.ifname, m.hook) for m in mirrors}
    stale = [m for m in (previous.mirrors if previous else []) if (m.ifname, m.hook) not in hooks]
    if stale:
        # Recorded first, so that a failure below leaves every mirror that may be live on record.
        save_record(MirrorRecord(switch=switch, netns=netns, mirrors=mirrors + stale, qdiscs_added=sorted(owned)),
                    state)
        # qdiscs of interfaces the new plan still uses keep their filters, so they stay.
        removed = teardown_mirrors(stale, netns, owned)
        result.stale_removed = removed.removed
        owned -= set(removed.qdiscs_removed)
    save_record(MirrorRecord(switch=switch, netns=netns, mirrors=mirrors, qdiscs_added=sorted(owned)), state)
    return result


def teardown_recorded(state: Path) -> tuple[MirrorRecord, TeardownResult]:
    """Remove what the record at ``state`` holds, then the record."""
    record = load_record(state)
    if record is None:
        raise ConfigError(f"{state}: no record of applied mirrors here, so nothing gradtap applied on this host is "
                          f"known; pass the --state the apply used")
    result = teardown_mirrors(record.mirrors, record.netns, set(record.qdiscs_added))
    state.unlink()
    return record, result
