"""``gradtap run JOB --stream NAME=IFACE ...``: the appliance on live mirror ports."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gradtap.capture.registry import SOURCES
from gradtap.capture.worker import SourceSpec
from gradtap import metrics
from gradtap.appliance import Appliance, RunOptions, status_loop, wait_for_stop
from gradtap.cli import app
from gradtap.control import ControlServer, load_checkpoint
from gradtap.commands.replay import _checkpoint
from gradtap.core.errors import ConfigError
from gradtap.workload.spec import load_job

console = Console(stderr=True)


def parse_stream(text: str, source: str, netns: str | None) -> tuple[str, SourceSpec]:
    """``NAME=IFACE`` (the --source on that interface) or ``NAME=pcap:PATH``."""
    name, sep, target = text.partition("=")
    if not sep or not name or not target:
        raise ConfigError(f"--stream {text!r}: expected NAME=IFACE (or NAME=pcap:PATH)")
    kind, colon, rest = target.partition(":")
    if colon and kind in SOURCES:
        source, target = kind, rest
    if source == "pcap":
        return name, SourceSpec("pcap", (target,), {})
    return name, SourceSpec(source, (target,), {"netns": netns})


def _cpus(text: str, what: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of core numbers") from None


def status_table(s: dict) -> Table:
    table = Table(title=f"gradtap: replica at iteration {s['replica_iteration']}"
                        f"{' [red](stale)[/]' if s['stale'] else ''}; {s['recovered']} merged, "
                        f"{s['unrecoverable']} unrecoverable; lag {s['lag_s'] * 1e3:.1f} ms")
    for col in ("stream", "frames", "MB", "kernel drops", "ring drops", "written", "duplicates"):
        table.add_column(col, justify="right")
    for name, c in s["capture"].items():
        e = s["events"].get(name, {})
        table.add_row(name, f"{c.get('frames', 0):,}", f"{c.get('bytes', 0) / 1e6:,.1f}",
                      f"{c.get('kernel_drops', 0):,}", f"{c.get('ring_drops', 0):,}",
                      f"{e.get('data.written', 0):,}", f"{e.get('data.duplicate', 0):,}")
    return table


@app.command("run")
def run_command(
    job_path: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="JOB"),
    stream: list[str] = typer.Option(..., "--stream", help="NAME=IFACE per mirror stream (or NAME=pcap:PATH)"),
    out: Path = typer.Option(..., "--out", "-o", help="snapshots/, iterations.jsonl, events.jsonl go here"),
    source: str = typer.Option("af_packet", "--source", help=f"capture source: {', '.join(SOURCES)}"),
    netns: str = typer.Option(None, "--netns", help="network namespace the interfaces are in"),
    start: Path = typer.Option(None, "--start", help="trainer checkpoint to start from (default: the job's "
                                                     "initial_state)"),
    metrics_port: int = typer.Option(9464, "--metrics-port", help="Prometheus metrics port (0: off)"),
    metrics_address: str = typer.Option("127.0.0.1", "--metrics-address"),
    control_port: int = typer.Option(9465, "--control-port", help="the appliance's control endpoint "
                                                                  "(POST /resync, GET /status; 0: off)"),
    capture_cpus: str = typer.Option("", "--capture-cpus", help="cores for the capture workers, one per stream"),
    parse_cpus: str = typer.Option("", "--parse-cpus", help="cores for parsing, merging and updating"),
    ring_slots: int = typer.Option(1 << 16, "--ring-slots", min=2),
    slot_size: int = typer.Option(9216, "--slot-size", min=64),
    hugepages: str = typer.Option("auto", "--hugepages", help="auto | require | off"),
    status: bool = typer.Option(None, "--status/--no-status", help="live status view (default: on a terminal)"),
) -> None:
    """Capture mirror ports and keep a replica current until SIGINT/SIGTERM."""
    if source not in SOURCES:
        raise ConfigError(f"--source {source!r}: choose one of {', '.join(SOURCES)}")
    job = load_job(job_path)
    specs = dict(parse_stream(s, source, netns) for s in stream)
    cores = _cpus(capture_cpus, "--capture-cpus")
    options = RunOptions(ring_slots=ring_slots, slot_size=slot_size, hugepages=hugepages,
                         capture_cpus=dict(zip(specs, cores)), parse_cpus=_cpus(parse_cpus, "--parse-cpus"))
    appliance = Appliance(job, specs, out, _checkpoint(job, start), options)
    wait_for_stop(appliance, (signal.SIGINT, signal.SIGTERM))
    if metrics_port:
        metrics.serve(appliance.snapshot, metrics_port, metrics_address)
    control = ControlServer(appliance.offer, appliance.snapshot, control_port, metrics_address) \
        if control_port else None
    if status if status is not None else console.is_terminal:
        live = Live(console=console, auto_refresh=False)
        live.start()
        status_loop(appliance, lambda s: live.update(status_table(s), refresh=True))
    else:
        live = None
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


@app.command("resync")
def resync_command(
    checkpoint: Path = typer.Argument(..., exists=True, help="a trainer checkpoint file, or a snapshot directory"),
    appliance: str = typer.Option("http://127.0.0.1:9465", "--appliance", help="the running appliance's "
                                                                               "control endpoint"),
) -> None:
    """Hand a trainer checkpoint to a running appliance whose replica is stale."""
    import json
    import urllib.request
    load_checkpoint(checkpoint)             # refuse a bad file here rather than in the appliance
    request = urllib.request.Request(f"{appliance.rstrip('/')}/resync", method="POST",
                                     data=json.dumps({"checkpoint": str(checkpoint.resolve())}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            console.print(json.loads(response.read()))
    except OSError as exc:
        raise ConfigError(f"--appliance {appliance}: no gradtap appliance answered ({exc})") from None
