"""The capture sources gradtap knows, by name: the list the command line shows and opens.

Every source registers whatever the host: one whose kernel feature or privilege is missing
says so in :func:`available` and, when opened, raises :class:`CaptureError` naming what is
missing and what to enable.
"""

from __future__ import annotations

from gradtap.capture.af_packet import AfPacketSource
from gradtap.capture.af_xdp import AfXdpSource
from gradtap.capture.pcap_source import PcapSource
from gradtap.capture.source import CaptureSource
from gradtap.core.errors import ConfigError

SOURCES: dict[str, type[CaptureSource]] = {
    PcapSource.name: PcapSource,
    AfPacketSource.name: AfPacketSource,
    AfXdpSource.name: AfXdpSource,
}


def source_class(name: str) -> type[CaptureSource]:
    """The class registered as ``name``; ConfigError listing the names otherwise."""
    try:
        return SOURCES[name]
    except KeyError:
        raise ConfigError(f"capture source {name!r} is unknown; choose one of {', '.join(SOURCES)}") from None


def make_source(name: str, *args, **options) -> CaptureSource:
    """A new (not yet opened) source ``name`` built with its own parameters, e.g.
    ``make_source("af_xdp", "eth2", netns=None, queue=0)`` or ``make_source("pcap", path)``."""
    return source_class(name)(*args, **options)


def available() -> dict[str, str | None]:
    """Each source's :meth:`CaptureSource.probe`: None where it can run, else why not."""
    return {name: cls.probe() for name, cls in SOURCES.items()}
