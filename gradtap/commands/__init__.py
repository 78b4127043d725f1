"""Subcommands of ``gradtap``. Each module named here adds its commands to ``gradtap.cli.app``
when imported; this tuple is the explicit registry the CLI reads."""

from importlib import import_module

COMMAND_MODULES = ("demo", "simulate", "inspect", "replay", "run", "netconfig")

for _name in COMMAND_MODULES:
    import_module(f"gradtap.commands.{_name}")
