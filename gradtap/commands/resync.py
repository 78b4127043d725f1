"""``gradtap resync CKPT``: hand a trainer checkpoint to a running appliance whose replica is
stale (the client of ``gradtap.control_server.ControlServer``)."""

from __future__ import annotations

from pathlib import Path

import click

from gradtap.cli import app


@app.command("resync")
@click.argument("checkpoint", type=click.Path(exists=True, path_type=Path), metavar="CKPT",
                help="a trainer checkpoint file, or a gradtap snapshot directory; it must lie under one of the "
                     "appliance's --resync-dir")
@click.option("--appliance", default="http://127.0.0.1:9465", metavar="URL",
              help="the running appliance's control endpoint (`gradtap run --control-port`)")
@click.option("--token-file", required=True, type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="the appliance's control token file (gradtap run --control-token-file; default there "
                   "OUT/control.token)")
def resync_command(checkpoint: Path, appliance: str, token_file: Path) -> None:
    """Hand a trainer checkpoint to a running appliance whose replica is stale."""
    from rich.console import Console

    from gradtap.checkpoints import load_checkpoint
    from gradtap.control import request_resync

    # A bad file is refused here rather than in the appliance, from a map of it: the tensors are
    # the appliance's to read (a 10 B-parameter checkpoint would hold 120 GB in this process).
    load_checkpoint(checkpoint, mapped=True)
    answer = request_resync(appliance, checkpoint, token_file)
    Console(stderr=True).print(f"the appliance takes the checkpoint of iteration {answer['iteration']}: a stale "
                               "replica resynchronises from it when the streams reach that iteration")
