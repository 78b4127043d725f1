"""``gradtap simulate CONFIG --out DIR``: mirrored RoCEv2 captures of real training, plus ground truth."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from gradtap.cli import app
from gradtap.core.errors import ConfigError


def _must_clear(out: Path, force: bool) -> bool:
    """Whether ``out`` holds files to clear first. A non-empty ``out`` is refused unless
    ``force``: a simulation written over an older one would leave that run's iterations and
    streams beside its own, and the truth would no longer describe the captures."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file, not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    if not force:
        raise ConfigError(f"--out {out} is not empty; pass --force to clear it first")
    target = out.resolve()
    if Path.cwd().resolve().is_relative_to(target) or Path.home().resolve().is_relative_to(target):
        raise ConfigError(f"--out {out}: --force does not clear a directory that holds the current directory "
                          "or the home directory")
    return True


def _clear(out: Path) -> None:
    for child in out.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


@app.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="CONFIG",
                help="job spec YAML")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="output directory (streams/, truth/, job.yaml); must be empty or new unless --force")
@click.option("--force", is_flag=True, help="clear a non-empty --out first")
@click.option("--iterations", "-n", type=click.IntRange(min=1), default=3, metavar="N",
              help="captured training iterations")
@click.option("--seed", type=int, default=0, metavar="SEED", help="seed of data shards, addresses and faults")
@click.option("--faults", default="", show_default=False, metavar="FAULTS",   # empty: no faults
              help="comma-separated NAME=PROBABILITY, e.g. mirror_loss=1e-3, link_loss=1e-4, corrupt=1e-4, "
                   "reorder=1e-3, duplicate=1e-3, truncate=1e-4; a mirror fault of one stream: "
                   "r0-egress.mirror_loss=0.01")
@click.option("--format", "fmt", default="pcap", metavar="FORMAT", help="pcap (nanosecond) or pcapng")
@click.option("--line-rate-gbps", type=click.FloatRange(min=1.0), default=100.0, metavar="GBPS",
              help="link speed for timestamps")
def simulate(config: Path, out: Path, force: bool, iterations: int, seed: int, faults: str, fmt: str,
             line_rate_gbps: float) -> None:
    """Train a real model as N data-parallel ranks and write one capture per mirror stream."""
    clear = _must_clear(out, force)
    from rich.console import Console

    from gradtap.progress import simulation_progress
    from gradtap.simulator.faults import parse_faults
    from gradtap.simulator.run import Simulation
    from gradtap.simulator.traffic import Timing
    from gradtap.tables import summary_table
    from gradtap.job_file import open_job

    job = open_job(config)
    sim = Simulation(job, out, iterations=iterations, seed=seed,
                     faults=parse_faults(faults, tuple(m.name for m in job.mirrors)),
                     timing=Timing(line_rate_gbps=line_rate_gbps), fmt=fmt)
    if clear:                        # only once the arguments are known to be good
        _clear(out)
    console = Console()
    with simulation_progress(console, iterations) as progress:
        summary = sim.run(progress)
    console.print(summary_table(summary))
