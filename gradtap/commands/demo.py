"""``gradtap demo``: simulate, replay, verify and resume on a small job (``gradtap/demo.py``)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import click

from gradtap.cli import app


@app.command()
@click.option("--out", "-o", type=click.Path(path_type=Path), metavar="DIR",
              help="keep everything in this directory (its sim/ and replay/ are replaced); "
                   "default: a temporary directory")
@click.option("--keep", is_flag=True,
              help="keep the temporary directory (about 260 MB) instead of removing it at the end")
@click.option("--iterations", "-n", type=click.IntRange(min=2), default=6, metavar="N",
              help="training iterations to capture")
@click.option("--seed", type=int, default=0, metavar="SEED", help="seed of the model, the data shards and the faults")
def demo(out: Path | None, keep: bool, iterations: int, seed: int) -> None:
    """Simulate, replay, verify bit for bit, resume from the replica, and report."""
    from rich.console import Console
    from rich.panel import Panel

    from gradtap.demo import run_demo

    console = Console()
    kept = out is not None or keep
    where = out if out is not None else Path(tempfile.mkdtemp(prefix="gradtap-demo-"))
    try:
        ok = run_demo(where, iterations, seed, console, plot=kept)
    finally:
        if not kept:
            shutil.rmtree(where, ignore_errors=True)
    replay = where / "replay"
    files = (f"report: {replay / 'replay.json'}\nplot:   {replay / 'iterations.png'}\n"
             f"events: {replay / 'events.jsonl'}" if kept else
             f"removed {where}; run with --keep to keep the captures, the snapshots and a plot")
    console.print(Panel.fit(
        ("[bold green]The replica equals the trainer after every iteration, and a trainer resumed from it "
         "continues exactly as if it had never stopped.[/]" if ok else
         "[bold red]Something did not match; see above.[/]") + "\n" + files, title="result"))
    if not ok:
        sys.exit(1)
