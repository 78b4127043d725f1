"""``gradtap simulate CONFIG --out DIR``: mirrored RoCEv2 captures of real training, plus ground truth."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gradtap.cli import app
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation, Summary
from gradtap.simulator.traffic import Timing
from gradtap.workload.spec import load_job

console = Console()


def run_simulation(config: Path, out: Path, iterations: int, seed: int, faults: str, fmt: str,
                   line_rate_gbps: float) -> Summary:
    job = load_job(config)
    spec = parse_faults(faults, tuple(m.name for m in job.mirrors))
    sim = Simulation(job, out, iterations=iterations, seed=seed, faults=spec,
                     timing=Timing(line_rate_gbps=line_rate_gbps), fmt=fmt)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("simulating", total=iterations)
        summary = sim.run(lambda what, done, total: bar.update(task, description=what, completed=done))
    return summary


def summary_table(summary: Summary) -> Table:
    table = Table(title=f"simulated {len(summary.iterations)} iteration(s) into {summary.out}")
    for col in ("stream", "file", "frames", "RoCE frames", "MB", "mirror faults injected"):
        table.add_column(col, justify="right" if col in ("frames", "RoCE frames", "MB") else "left")
    for s in summary.streams:
        faults = ", ".join(f"{k} {v}" for k, v in s.faults.items() if v) or "none"
        table.add_row(s.name, str(s.path.relative_to(summary.out)), f"{s.frames:,}", f"{s.roce_frames:,}",
                      f"{s.bytes / 1e6:,.1f}", faults)
    link = ", ".join(f"{k} {v}" for k, v in summary.link_faults.items() if v) or "none"
    table.caption = (f"training-link faults: {link}; time in training {summary.seconds_training:.1f} s, "
                     f"in encoding {summary.seconds_encoding:.1f} s")
    return table


@app.command()
def simulate(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="job spec YAML"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory (streams/, truth/, job.yaml)"),
    iterations: int = typer.Option(3, "--iterations", "-n", min=1, help="captured training iterations"),
    seed: int = typer.Option(0, "--seed", help="seed of data shards, addresses and faults"),
    faults: str = typer.Option("", "--faults", help="e.g. 'mirror_loss=1e-3,link_loss=1e-4,corrupt=1e-4,"
                               "reorder=1e-3,duplicate=1e-3,truncate=1e-4,r0-egress.mirror_loss=0.01'"),
    fmt: str = typer.Option("pcap", "--format", help="pcap (nanosecond) or pcapng"),
    line_rate_gbps: float = typer.Option(100.0, "--line-rate-gbps", min=1.0, help="link speed for timestamps"),
) -> None:
    """Train a real model as N data-parallel ranks and write one capture per mirror stream."""
    summary = run_simulation(config, out, iterations, seed, faults, fmt, line_rate_gbps)
    console.print(summary_table(summary))
