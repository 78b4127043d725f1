"""The ``gradtap`` command line: one entry point, one subcommand per job.

Each subcommand lives in a module of ``gradtap.commands`` named after it and registers
itself on :data:`app`; this module only assembles them. The command line is plain Click,
and the command modules import nothing heavy (Rich, pydantic, PyTorch, Numba, the stages)
until a command runs, so ``--help`` and argument errors answer at once: on a 2-core machine
Typer's own start-up (pydantic for its parameter adapters, ``rich.markdown`` for its help)
took half a second before any command code ran.
"""

from __future__ import annotations

import sys

import click

from gradtap.core.errors import GradtapError


class Command(click.Command):
    """A subcommand whose one-sentence summary in its group's listing wraps onto more lines
    instead of being cut at one line with ``...`` (Click's default)."""

    def get_short_help_str(self, limit: int = 45) -> str:
        return super().get_short_help_str(limit=sys.maxsize)


class Group(Command, click.Group):
    """A group of commands listed in the order they were added, which is the registry's
    (``gradtap.commands.COMMAND_MODULES``), not alphabetically; its commands and subgroups
    are :class:`Command` and :class:`Group`."""

    command_class = Command
    group_class = type              # Click's spelling for "subgroups are of this same class"

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


# ``show_default``: every option with a default shows it (``[default: 9464]``); subcommands'
# contexts inherit the setting from this one.
app = Group("gradtap", context_settings={"show_default": True},
            help="Rebuild an always-current training checkpoint from mirrored RoCEv2 allreduce traffic.")


def _register() -> None:
    # Imported for their side effect of adding commands to ``app``, in the registry's order.
    from gradtap.commands import COMMAND_MODULES  # noqa: F401


def main() -> None:
    """The ``gradtap`` console script. Usage errors are Click's (exit status 2); a
    :class:`GradtapError` from a command is one ``error: ...`` line on stderr, exit status 2."""
    _register()
    try:
        app.main(prog_name="gradtap")
    except GradtapError as exc:
        # Plain text, not Rich markup: a message may hold brackets such as ``[0, 1]``.
        click.echo(f"{click.style('error:', fg='red', bold=True)} {exc}", err=True)
        sys.exit(2)
