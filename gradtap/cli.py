"""The ``gradtap`` command line: one entry point, one subcommand per job.

Each subcommand lives in a module of ``gradtap.commands`` named after it and registers
itself on :data:`app`; this module only assembles them. The command modules import nothing
heavy (PyTorch, Numba, the stages) until a command runs, so ``--help`` and argument errors
answer at once.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from gradtap.core.errors import GradtapError


class _FlagsShowNoType:
    """Typer's help labels a flag such as ``--json`` or ``--help`` with a value type
    (``<bool>``), though a flag takes no value: show none."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class Command(_FlagsShowNoType, TyperCommand):
    pass


class Group(_FlagsShowNoType, TyperGroup):
    pass


class App(typer.Typer):
    """A ``typer.Typer`` whose groups and commands are :class:`Group` and :class:`Command`."""

    def __init__(self, **kwargs):
        super().__init__(cls=Group, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                         **kwargs)

    def command(self, *args, **kwargs):
        return super().command(*args, cls=Command, **kwargs)


app = App(name="gradtap", help="Rebuild an always-current training checkpoint from mirrored RoCEv2 allreduce "
                               "traffic.")
err_console = Console(stderr=True, soft_wrap=True)  # one error, one line, whatever the width


@app.callback()
def _root() -> None:
    """Rebuild an always-current training checkpoint from mirrored RoCEv2 allreduce traffic."""


def _register() -> None:
    # Imported for their side effect of adding commands to ``app``, in the registry's order.
    from gradtap.commands import COMMAND_MODULES  # noqa: F401


def main() -> None:
    _register()
    try:
        app()
    except GradtapError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)
