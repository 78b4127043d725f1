"""The capture-source interface every source fills (suricata's source slots).

A source's life: construct it with its options (nothing touches the kernel yet), then

- :meth:`CaptureSource.open` -- claim the kernel resources; a missing feature, privilege,
  interface or namespace raises :class:`CaptureError` saying what is missing and what to do;
- :meth:`CaptureSource.run` -- move frames into a :class:`FrameRing` until a stop flag is
  set or the source runs out (a file); built on :meth:`CaptureSource.receive`, one bounded
  wait plus whatever is ready;
- :meth:`CaptureSource.stats` -- counters, kernel drops next to ring drops;
- :meth:`CaptureSource.close` -- give everything back (idempotent).

Every source's ``stats()`` holds at least :data:`COMMON_STATS`; a source adds its own
kernel counters, named in its ``COUNTERS``. Sources live in :mod:`gradtap.capture.registry`.
"""

from __future__ import annotations

import errno
import os
import socket
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import ClassVar

from pyroute2 import netns as namespaces

from gradtap.capture.ring import FrameRing
from gradtap.core.errors import CaptureError

#: ``stats()`` keys every source reports. ``received``: frames the source took from the
#: kernel or file; ``kernel_drops``: frames the kernel dropped before the source saw them;
#: ``ring_drops``, ``truncated``, ``frames``, ``bytes``: from the ring (see ``FrameRing.stats``).
COMMON_STATS = ("received", "kernel_drops", "frames", "bytes", "ring_drops", "truncated")
#: Seconds one ``receive`` waits at most inside ``run`` (bounds the reaction to a stop).
POLL_S = 0.05


class CaptureSource(ABC):
    """One capture source. Subclasses set ``name``, ``summary``, ``COUNTERS`` and fill the slots."""

    name: ClassVar[str]
    summary: ClassVar[str]
    #: Source-specific counters, in the order they are published to the ring.
    COUNTERS: ClassVar[tuple[str, ...]] = ()
    #: What a full ring does to a frame: live sources drop it (counted), files wait.
    drop_when_full: ClassVar[bool] = True

    def __init__(self):
        self.ring: FrameRing | None = None
        self.received = 0

    @classmethod
    def probe(cls) -> str | None:
        """Why this source cannot run on this host (missing kernel feature or privilege), or
        None if it can. Cheap, and leaves nothing behind; ``open`` still checks everything."""
        return None

    @abstractmethod
    def locate(self) -> None:
        """Check that what this source reads is there (its interface, in its namespace; its
        file); CaptureError naming it otherwise. Opens and holds nothing: a command checks
        every stream this way before its start-up work, and ``open`` checks again."""

    @abstractmethod
    def open(self) -> None:
        """Acquire the kernel resources (sockets, maps, programs, files)."""

    @abstractmethod
    def receive(self, ring: FrameRing, timeout: float) -> int | None:
        """Wait at most ``timeout`` seconds for frames and move those ready into ``ring``.
        Returns the frames taken from the source (0 if none came), or None once it is
        exhausted (end of a file)."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """The source's own counters: ``received``, ``kernel_drops`` and ``COUNTERS``."""

    @classmethod
    def counter_names(cls) -> tuple[str, ...]:
        """Names of :meth:`counters`, in the order a worker publishes them to the ring."""
        return ("received", "kernel_drops") + cls.COUNTERS

    def info(self) -> dict[str, object]:
        """What :meth:`open` settled on (modes, sizes), for logs and the status view."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release everything :meth:`open` acquired; safe to call twice or before open."""

    def run(self, ring: FrameRing, stop, on_tick=None) -> None:
        """Move frames into ``ring`` until ``stop.is_set()`` or the source is exhausted.

        ``on_tick`` (optional) is called after every bounded wait, at most every
        :data:`POLL_S` seconds apart while idle; a worker publishes counters there.
        """
        self.ring = ring
        while not stop.is_set():
            if self.receive(ring, POLL_S) is None:
                break
            if on_tick is not None:
                on_tick()

    def stats(self) -> dict[str, int]:
        """Source counters, then the ring's (``frames``, ``bytes``, ``ring_drops``, ``truncated``)."""
        out = self.counters()
        live = self.ring is not None and self.ring.memory.buf is not None
        ring = self.ring.stats() if live else {}
        out.update({k: ring.get(k, 0) for k in ("frames", "bytes", "ring_drops", "truncated")})
        return out

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc):
        self.close()


def available_memory() -> int:
    """MemAvailable from ``/proc/meminfo``, in bytes: kernel rings are allocated (and pinned)
    whole, so a source checks its size against it before asking."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def privilege_problem(what: str) -> str | None:
    """What is missing for a raw capture in this process, or None."""
    if os.geteuid() != 0:
        return (f"{what} needs CAP_NET_RAW and CAP_NET_ADMIN: run gradtap as root "
                f"(or grant the capabilities: setcap cap_net_raw,cap_net_admin+ep)")
    return None


def require_root(what: str) -> None:
    """Raise if this process lacks the privileges a raw capture needs."""
    problem = privilege_problem(what)
    if problem:
        raise CaptureError(problem)


@contextmanager
def in_netns(name: str | None):
    """Run the body in network namespace ``name`` (``ip netns`` name; None: stay here).

    Sockets and netlink handles made inside keep the namespace after the body ends; only
    the calling thread switches (``setns``), and it switches back even on an error.
    """
    if name is None:
        yield
        return
    if name not in namespaces.listnetns():
        raise CaptureError(f"network namespace {name!r} does not exist (ip netns list shows "
                           f"{', '.join(namespaces.listnetns()) or 'none'})")
    try:
        namespaces.pushns(name)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            raise CaptureError(f"entering network namespace {name!r} needs CAP_SYS_ADMIN: run as root") from exc
        raise CaptureError(f"cannot enter network namespace {name!r}: {os.strerror(exc.errno)}") from exc
    try:
        yield
    finally:
        namespaces.popns()


def interface_index(name: str, netns: str | None, source: str) -> int:
    """Index of interface ``name`` (in ``netns``), or a CaptureError naming both."""
    with in_netns(netns):
        try:
            return socket.if_nametoindex(name)
        except OSError:
            where = f" in network namespace {netns!r}" if netns else ""
            raise CaptureError(f"{source}: no interface {name!r}{where}; check the --stream "
                               f"NAME=IFACE value (ip link show)") from None

