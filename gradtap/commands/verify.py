"""``gradtap verify DIR --truth TRUTH``: exit 0 only when a replay's replica is the trainer,
bit for bit (``gradtap/verify.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gradtap.cli import app


@app.command("verify")
@click.argument("replay_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="DIR",
                help="the --out directory of `gradtap replay` (or of `gradtap run`)")
@click.option("--truth", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              metavar="TRUTH", help="the truth/ directory `gradtap simulate` wrote")
@click.option("--job", "job_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="JOB",
              help="job spec YAML (default: the job.yaml beside TRUTH, as simulate writes it)")
def verify_command(replay_dir: Path, truth: Path, job_path: Path | None) -> None:
    """Exit 0 only when the replica equals the ground truth bit for bit."""
    from rich.console import Console

    from gradtap.tables import verification_lines
    from gradtap.verify import verify
    from gradtap.workload.layout import job_params
    from gradtap.job_file import open_job

    job = open_job(job_path or truth.parent / "job.yaml")
    v = verify(replay_dir, truth, job_params(job))
    console = Console()
    for line in verification_lines(v):
        console.print(line)
    sys.exit(0 if v.ok else 1)
