"""The ``gradtap`` command line: one entry point, one subcommand per job.

Each subcommand lives in a module of ``gradtap.commands`` named after it and registers
itself on :data:`app`; this module only assembles them.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from gradtap.core.errors import GradtapError

app = typer.Typer(
    name="gradtap",
    help="Rebuild an always-current training checkpoint from mirrored RoCEv2 allreduce traffic.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err_console = Console(stderr=True, soft_wrap=True)  # one error, one line, whatever the width


@app.callback()
def _root() -> None:
    """Rebuild an always-current training checkpoint from mirrored RoCEv2 allreduce traffic."""


def _register() -> None:
    # Imported for their side effect of adding commands to ``app``.
    from gradtap.commands import COMMAND_MODULES  # noqa: F401


def main() -> None:
    _register()
    try:
        app()
    except GradtapError as exc:
        err_console.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)
