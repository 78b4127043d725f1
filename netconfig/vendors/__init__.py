"""Vendor renderers: the explicit registry the planner and the CLI read.

Each module holds ``SPEC`` (its documented constraints, :class:`base.VendorSpec`) and
``render(switch, sessions) -> SwitchConfig`` (config and matching teardown).
"""

from __future__ import annotations

from types import ModuleType

from gradtap.core.errors import ConfigError
from gradtap.netconfig.vendors import comware, eos, junos, linux, nvue, nxos, sonic
from gradtap.netconfig.vendors.base import VendorSpec

VENDORS: dict[str, ModuleType] = {m.SPEC.name: m for m in (sonic, eos, nxos, comware, junos, nvue, linux)}


def vendor(name: str) -> ModuleType:
    if name not in VENDORS:
        raise ConfigError(f"vendor {name!r} is not supported (choose one of: {', '.join(VENDORS)})")
    return VENDORS[name]


def spec(name: str) -> VendorSpec:
    return vendor(name).SPEC
