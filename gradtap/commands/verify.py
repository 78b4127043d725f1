"""``gradtap verify DIR --truth TRUTH``: exit 0 only when a replay's replica is the trainer,
bit for bit (``gradtap/verify.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from gradtap.cli import app
from gradtap.tables import verification_lines

console = Console()


@app.command("verify")
def verify_command(
    replay_dir: Path = typer.Argument(..., exists=True, file_okay=False, metavar="DIR",
                                      help="the --out directory of `gradtap replay` (or of `gradtap run`)"),
    truth: Path = typer.Option(..., "--truth", exists=True, file_okay=False, metavar="TRUTH",
                               help="the truth/ directory `gradtap simulate` wrote"),
    job_path: Path = typer.Option(None, "--job", exists=True, dir_okay=False, metavar="JOB",
                                  help="job spec YAML (default: the job.yaml beside TRUTH, as simulate writes it)"),
) -> None:
    """Exit 0 only when the replica equals the ground truth bit for bit."""
    from gradtap.verify import verify
    from gradtap.workload.layout import job_params
    from gradtap.workload.spec import load_job

    job = load_job(job_path or truth.parent / "job.yaml")
    v = verify(replay_dir, truth, job_params(job))
    for line in verification_lines(v):
        console.print(line)
    sys.exit(0 if v.ok else 1)
