"""``gradtap resync CKPT``: hand a trainer checkpoint to a running appliance whose replica is
stale (the client of ``gradtap.control.ControlServer``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from gradtap.cli import app

console = Console(stderr=True)


@app.command("resync")
def resync_command(
    checkpoint: Path = typer.Argument(..., exists=True, metavar="CKPT",
                                      help="a trainer checkpoint file, or a gradtap snapshot directory"),
    appliance: str = typer.Option("http://127.0.0.1:9465", "--appliance", metavar="URL",
                                  help="the running appliance's control endpoint (`gradtap run --control-port`)"),
) -> None:
    """Hand a trainer checkpoint to a running appliance whose replica is stale."""
    from gradtap.checkpoints import load_checkpoint
    from gradtap.control import request_resync

    load_checkpoint(checkpoint)             # refuse a bad file here rather than in the appliance
    answer = request_resync(appliance, checkpoint)
    console.print(f"the appliance takes the checkpoint of iteration {answer['iteration']}: a stale replica "
                  "resynchronises from it when the streams reach that iteration")
