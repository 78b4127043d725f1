"""``gradtap simulate CONFIG --out DIR``: mirrored RoCEv2 captures of real training, plus ground truth."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer
from rich.console import Console

from gradtap.cli import app
from gradtap.core.errors import ConfigError
from gradtap.progress import simulation_progress
from gradtap.tables import summary_table

console = Console()


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
def simulate(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="CONFIG", help="job spec YAML"),
    out: Path = typer.Option(..., "--out", "-o", metavar="DIR",
                             help="output directory (streams/, truth/, job.yaml); must be empty or new "
                                  "unless --force"),
    force: bool = typer.Option(False, "--force", help="clear a non-empty --out first"),
    iterations: int = typer.Option(3, "--iterations", "-n", min=1, metavar="N", help="captured training iterations"),
    seed: int = typer.Option(0, "--seed", metavar="SEED", help="seed of data shards, addresses and faults"),
    faults: str = typer.Option("", "--faults", metavar="FAULTS",
                               help="comma-separated NAME=PROBABILITY, e.g. mirror_loss=1e-3, link_loss=1e-4, "
                                    "corrupt=1e-4, reorder=1e-3, duplicate=1e-3, truncate=1e-4; a mirror fault "
                                    "of one stream: r0-egress.mirror_loss=0.01"),
    fmt: str = typer.Option("pcap", "--format", metavar="FORMAT", help="pcap (nanosecond) or pcapng"),
    line_rate_gbps: float = typer.Option(100.0, "--line-rate-gbps", min=1.0, metavar="GBPS",
                                         help="link speed for timestamps"),
) -> None:
    """Train a real model as N data-parallel ranks and write one capture per mirror stream."""
    clear = _must_clear(out, force)
    from gradtap.simulator.faults import parse_faults
    from gradtap.simulator.run import Simulation
    from gradtap.simulator.traffic import Timing
    from gradtap.workload.spec import load_job

    job = load_job(config)
    sim = Simulation(job, out, iterations=iterations, seed=seed,
                     faults=parse_faults(faults, tuple(m.name for m in job.mirrors)),
                     timing=Timing(line_rate_gbps=line_rate_gbps), fmt=fmt)
    if clear:                        # only once the arguments are known to be good
        _clear(out)
    with simulation_progress(console, iterations) as progress:
        summary = sim.run(progress)
    console.print(summary_table(summary))
