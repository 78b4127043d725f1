"""``gradtap export SNAPSHOT --job JOB --format dcp|state-dict|safetensors --out DIR``: a
replica's checkpoint in the format a trainer loads, including PyTorch Distributed Checkpoint
for a restart at another world size or sharding (``gradtap/export.py``)."""

from __future__ import annotations

from pathlib import Path

import click

from gradtap.cli import app

FORMATS = ("dcp", "state-dict", "safetensors")     # gradtap.export.FORMATS, without importing torch here


@app.command("export")
@click.argument("source", type=click.Path(exists=True, path_type=Path), metavar="SNAPSHOT",
                help="a snapshot (iteration-NNNNNN/), a snapshots directory (its LATEST), or a trainer checkpoint")
@click.option("--job", "job_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              metavar="JOB", help="the job spec YAML the replica follows")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="dcp", show_default=True,
              help="dcp: torch.distributed.checkpoint (any world size, any sharding); state-dict: one torch.save "
                   "file; safetensors: model and optimizer tensors")
@click.option("--out", required=True, type=click.Path(path_type=Path), metavar="DIR", help="new directory to write")
@click.option("--force", is_flag=True, help="replace DIR if it exists")
def export_command(source: Path, job_path: Path, fmt: str, out: Path, force: bool) -> None:
    """Write a replica's checkpoint in a format trainers load."""
    from rich.console import Console

    from gradtap.export import export_checkpoint
    from gradtap.job_file import open_job

    info = export_checkpoint(source, open_job(job_path), fmt, out, force=force)
    Console().print(f"exported iteration {info['iteration']} of job {info['job']} as {fmt} to {out}",
                    highlight=False)
