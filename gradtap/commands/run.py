"""``gradtap run JOB --stream NAME=IFACE ...``: the appliance on live mirror ports (``gradtap/appliance.py``)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live

from gradtap.cli import app
from gradtap.core.errors import ConfigError
from gradtap.tables import status_table

console = Console(stderr=True)

# The names of ``gradtap.capture.registry.SOURCES``, for the help text, which must not import
# the sources (Numba); tests/gradtap/test_cli.py checks that the two agree.
SOURCE_NAMES = ("pcap", "af_packet", "af_xdp")


def parse_stream(text: str, source: str, netns: str | None):
    """``NAME=IFACE`` (on the ``source`` given) or ``NAME=SOURCE:TARGET`` such as
    ``NAME=pcap:PATH``: the stream's name and its ``capture.worker.SourceSpec``."""
    from gradtap.capture.registry import SOURCES
    from gradtap.capture.worker import SourceSpec

    name, sep, target = text.partition("=")
    if not sep or not name or not target:
        raise ConfigError(f"--stream {text!r}: expected NAME=IFACE (or NAME=pcap:PATH)")
    kind, colon, rest = target.partition(":")
    if colon and kind in SOURCES:
        source, target = kind, rest
    if source not in SOURCES:
        raise ConfigError(f"--source {source!r}: choose one of {', '.join(SOURCES)}")
    if source == "pcap":
        return name, SourceSpec("pcap", (target,), {})
    return name, SourceSpec(source, (target,), {"netns": netns})


def _cpus(text: str, what: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of core numbers") from None


@app.command("run")
def run_command(
    job_path: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="JOB",
                                    help="job spec YAML: the model, the optimizer, the ring, the mirror streams"),
    stream: list[str] = typer.Option(..., "--stream", metavar="NAME=IFACE",
                                     help="one per mirror stream: NAME, a stream of the job, arrives on "
                                          "IFACE; NAME=pcap:PATH reads a capture file instead"),
    out: Path = typer.Option(..., "--out", "-o", metavar="DIR",
                             help="snapshots/, iterations.jsonl, events.jsonl go here"),
    source: str = typer.Option("af_packet", "--source", metavar="SOURCE",
                               help=f"capture source: {', '.join(SOURCE_NAMES)}"),
    netns: str = typer.Option(None, "--netns", metavar="NS", help="network namespace the interfaces are in"),
    start: Path = typer.Option(None, "--start", metavar="CKPT",
                               help="trainer checkpoint to start from (default: the job's initial_state)"),
    metrics_port: int = typer.Option(9464, "--metrics-port", metavar="PORT", help="Prometheus metrics port (0: off)"),
    metrics_address: str = typer.Option("127.0.0.1", "--metrics-address", metavar="ADDR",
                                        help="address the metrics listen on (0.0.0.0: every interface)"),
    control_port: int = typer.Option(9465, "--control-port", metavar="PORT",
                                     help="the appliance's control endpoint (POST /resync, GET /status; 0: off)"),
    control_address: str = typer.Option("127.0.0.1", "--control-address", metavar="ADDR",
                                        help="address the control endpoint listens on; it accepts checkpoints, "
                                             "so keep it local unless the network is trusted"),
    capture_cpus: str = typer.Option("", "--capture-cpus", metavar="CPUS",
                                     help="cores for the capture workers, one per stream"),
    parse_cpus: str = typer.Option("", "--parse-cpus", metavar="CPUS", help="cores for parsing, merging and updating"),
    ring_slots: int = typer.Option(1 << 16, "--ring-slots", min=2, metavar="N",
                                   help="frames each stream's shared-memory ring holds"),
    slot_size: int = typer.Option(9216, "--slot-size", min=64, metavar="BYTES",
                                  help="bytes per ring slot: the largest frame kept whole (longer ones are "
                                       "truncated and counted)"),
    hugepages: str = typer.Option("auto", "--hugepages", metavar="MODE",
                                   help="huge pages for the rings: auto (when the host has them), require, off"),
    no_status: bool = typer.Option(False, "--no-status",
                                   help="no live status view (it is shown when stderr is a terminal)"),
) -> None:
    """Capture mirror ports and keep a replica current until SIGINT/SIGTERM."""
    from gradtap import metrics
    from gradtap.appliance import Appliance, RunOptions, status_loop, wait_for_stop
    from gradtap.checkpoints import start_checkpoint
    from gradtap.control import ControlServer
    from gradtap.workload.spec import load_job

    job = load_job(job_path)
    specs = dict(parse_stream(s, source, netns) for s in stream)
    cores = _cpus(capture_cpus, "--capture-cpus")
    options = RunOptions(ring_slots=ring_slots, slot_size=slot_size, hugepages=hugepages,
                         capture_cpus=dict(zip(specs, cores)), parse_cpus=_cpus(parse_cpus, "--parse-cpus"))
    appliance = Appliance(job, specs, out, start_checkpoint(job, start), options)
    wait_for_stop(appliance, (signal.SIGINT, signal.SIGTERM))
    if metrics_port:
        metrics.serve(appliance.status, metrics_port, metrics_address)
    control = ControlServer(appliance.offer, appliance.status, control_port, control_address) \
        if control_port else None
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not no_status else None
    if live is not None:
        live.start()
        status_loop(appliance, lambda s: live.update(status_table(s), refresh=True))
    try:
        result = appliance.run()
    finally:
        if live is not None:
            live.stop()
        if control is not None:
            control.close()
    console.print(f"gradtap run: {result.reason}; {result.iterations} iteration(s) merged, "
                  f"{result.unrecoverable} unrecoverable; replica at iteration {appliance.replica.iteration}"
                  f"{' (stale)' if appliance.replica.stale else ''}")
    sys.exit(result.exit_code)
