"""Subcommands of ``gradtap``. Each module named here adds its command to ``gradtap.cli.app``
when imported; this tuple is the explicit registry the CLI reads, in the order of the data
flow, which is the order ``gradtap --help`` lists them in.

A command module imports only Click and the standard library at the top; Rich and the stages
(PyTorch, Numba, pydantic, pyroute2, ...) are imported inside the handler, when the command
runs, so that ``gradtap --help`` and argument errors answer at once.
"""

from importlib import import_module

COMMAND_MODULES = ("demo", "simulate", "inspect", "discover", "replay", "verify", "run", "resync", "export", "restore",
                   "netconfig")

for _name in COMMAND_MODULES:
    import_module(f"gradtap.commands.{_name}")
