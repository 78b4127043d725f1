"""``gradtap run JOB --stream NAME=IFACE ...``: the appliance on live mirror ports (``gradtap/appliance.py``)."""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import click

from gradtap.cli import app
from gradtap.commands.group_options import group_options, mirror_group, refuse_for_group
from gradtap.core.errors import ConfigError

# The names of ``gradtap.capture.registry.SOURCES``, for the help text, which must not import
# the sources (Numba); tests/gradtap/test_cli.py checks that the two agree.
SOURCE_NAMES = ("pcap", "af_packet", "af_xdp")


def parse_source_options(texts: tuple[str, ...]) -> dict[str, int | str]:
    """``--source-option KEY=VALUE``s: a value that reads as an integer is one."""
    out: dict[str, int | str] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or not key.isidentifier() or not value:
            raise ConfigError(f"--source-option {text!r}: expected KEY=VALUE, e.g. rx_size=131072")
        if key in ("interface", "netns", "path"):
            raise ConfigError(f"--source-option {text!r}: {key} comes from --stream or --netns")
        try:
            out[key] = int(value, 0)
        except ValueError:
            out[key] = value
    return out


def parse_stream(text: str, source: str, netns: str | None, options: dict[str, int | str] | None = None):
    """``NAME=IFACE`` (on the ``source`` given) or ``NAME=SOURCE:TARGET`` such as
    ``NAME=pcap:PATH``: the stream's name and its ``capture.worker.SourceSpec``, with the
    ``options`` of ``--source-option`` (which the spec checks: a wrong one stops the command
    before any capture starts)."""
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
    where = {} if source == "pcap" else {"netns": netns}
    try:
        return name, SourceSpec(source, (target,), {**where, **(options or {})})
    except ConfigError as exc:
        raise ConfigError(f"--source-option, stream {name!r}: {exc}") from None


def _cpus(text: str, what: str) -> list[int]:
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of core numbers") from None
    allowed = os.sched_getaffinity(0)
    foreign = sorted(set(cores) - allowed)
    if foreign:
        raise ConfigError(f"{what}: core(s) {foreign} are not among the cores this process may run on "
                          f"({','.join(map(str, sorted(allowed)))})")
    return cores


@app.command("run")
@click.argument("job_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="JOB",
                help="job spec YAML: the model, the optimizer, the ring, the mirror streams")
@click.option("--stream", multiple=True, required=True, metavar="NAME=IFACE",
              help="one per mirror stream: NAME, a stream of the job, arrives on IFACE; NAME=pcap:PATH reads a "
                   "capture file instead")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="snapshots/, iterations.jsonl, events.jsonl go here")
@click.option("--source", default="af_packet", metavar="SOURCE", help=f"capture source: {', '.join(SOURCE_NAMES)}")
@click.option("--netns", metavar="NS", help="network namespace the interfaces are in")
@click.option("--source-option", "source_options", multiple=True, metavar="KEY=VALUE",
              help="a parameter of every stream's capture source, e.g. rx_size=131072 and frames=262144 (af_xdp) "
                   "or block_count=256 (af_packet): the kernel ring's depth sets how long a capture worker may "
                   "stall without loss (docs/capture.md, 'How long a worker may stall')")
@click.option("--start", type=click.Path(path_type=Path), metavar="CKPT",
              help="trainer checkpoint to start from: with time_ns, its iteration is the first captured one to "
                   "begin after it; without, the trainer's state when the capture began (default: the job's "
                   "initial_state.checkpoint; with none, the replica waits, stale, for the trainer's checkpoint "
                   "with time_ns through POST /resync); one of --out's own snapshots continues its replica "
                   "after a restart")
@click.option("--store", metavar="URL",
              help="durable store the snapshots are also uploaded to, in the background: file:///DIR or "
                   "s3://BUCKET/PREFIX (overrides appliance.store.url; docs/store.md, Storage tiers)")
@click.option("--start-from-store", is_flag=True,
              help="start from the newest READY snapshot in the store that verifies, and the gradient log after "
                   "it (a restarted appliance whose local snapshots are lost; nothing usable: wait for the "
                   "trainer's checkpoint, with a fallback); like --start with that state, which carries no time_ns: "
                   "it is declared to be the trainer's state when the capture begins. A job that went on while "
                   "the appliance was down has moved past it: start without a state instead and let the trainer "
                   "offer its checkpoint")
@click.option("--metrics-port", type=int, default=9464, metavar="PORT", help="Prometheus metrics port (0: off)")
@click.option("--metrics-address", default="127.0.0.1", metavar="ADDR",
              help="address the metrics listen on (0.0.0.0: every interface)")
@click.option("--control-port", type=int, default=9465, metavar="PORT",
              help="the appliance's control endpoint (POST /resync, GET /status; 0: off)")
@click.option("--control-address", default="127.0.0.1", metavar="ADDR",
              help="address the control endpoint listens on; it accepts checkpoints, so keep it local unless the "
                   "network is trusted")
@click.option("--control-token-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="the control endpoint's secret: every request carries 'Authorization: Bearer <content>'; "
                   "created (mode 0600) when missing; default: the job's appliance.control_token_file, else "
                   "OUT/control.token")
@click.option("--resync-dir", "resync_dirs", multiple=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="DIR",
              help="a directory POST /resync may take checkpoints from (repeatable; default: the job's "
                   "appliance.resync_dirs; with none, every offer is refused)")
# An empty CPU list means "not pinned": there is no default worth showing.
@click.option("--capture-cpus", default="", show_default=False, metavar="CPUS",
              help="cores for the capture workers, one per stream")
@click.option("--parse-cpus", default="", show_default=False, metavar="CPUS",
              help="cores for parsing and merging (and updating, unless --update-cpus or cores left free say "
                   "otherwise)")
@click.option("--update-cpus", default="", show_default=False, metavar="CPUS",
              help="cores for the update thread (the Adam step), beside the parsers; default: with --parse-cpus, "
                   "the cores neither it nor --capture-cpus takes, else anywhere. Where the parsers take every "
                   "core, the update runs between their rounds")
@click.option("--ring-slots", type=click.IntRange(min=2), default=1 << 16, metavar="N",
              help="frames each stream's shared-memory ring holds")
@click.option("--slot-size", type=click.IntRange(min=64), default=9216, metavar="BYTES",
              help="bytes per ring slot: the largest frame kept whole (longer ones are truncated and counted)")
@click.option("--hugepages", default="auto", metavar="MODE",
              help="huge pages for the rings: auto (when the host has them), require, off")
@click.option("--no-status", is_flag=True, help="no live status view (it is shown when stderr is a terminal)")
@click.option("--force", is_flag=True,
              help="clear the snapshots in --out when they are another replica's (another job or start state)")
@click.option("--no-rehearsal", is_flag=True,
              help="listen at once, without first running the pipeline on a simulated miniature of the job "
                   "(which compiles every kernel, some 20 s after an install or upgrade, and checks it exact)")
@group_options("capturing")
def run_command(job_path: Path, stream: tuple[str, ...], out: Path, source: str, netns: str | None,
                source_options: tuple[str, ...],
                start: Path | None, store: str | None, start_from_store: bool, metrics_port: int,
                metrics_address: str, control_port: int,
                control_address: str, control_token_file: Path | None, resync_dirs: tuple[Path, ...],
                capture_cpus: str, parse_cpus: str, update_cpus: str, ring_slots: int, slot_size: int, hugepages: str,
                no_status: bool, force: bool, no_rehearsal: bool, group_at: str | None, rendezvous: str | None,
                group_timeout: float | None) -> None:
    """Capture mirror ports and keep a replica current until SIGINT/SIGTERM.

    With --group, this is one of the CPU nodes a DP group's streams arrive at: it merges with
    its peers over gloo and steps its shard of the replica (docs/group.md); it needs a start
    state, and a peer gone stops it with exit status 4 (the replica is stale)."""
    if start and start_from_store:
        raise click.UsageError("give --start or --start-from-store, not both")
    # The streams first: a mistyped interface or option is named in a second, before the
    # stages are imported, the job's model described, the start state loaded and the
    # pipeline rehearsed (some 15 s on a 2-core host).
    given = parse_source_options(source_options)
    specs = dict(parse_stream(s, source, netns, given) for s in stream)
    for spec in specs.values():
        spec.locate()
    cores = _cpus(capture_cpus, "--capture-cpus")
    parse_cores, update_cores = _cpus(parse_cpus, "--parse-cpus"), _cpus(update_cpus, "--update-cpus")

    from rich.console import Console
    from rich.live import Live

    from gradtap import metrics
    from gradtap.appliance import Appliance, RunOptions, control_token_file as token_file_of, status_loop, wait_for_stop
    from gradtap.checkpoints import offer_size_limit, start_checkpoint
    from gradtap.control_server import ControlServer, ControlSettings
    from gradtap.job_file import open_job
    from gradtap.start import replica_start
    from gradtap.progress import bytes_progress, rebuild_progress
    from gradtap.store_tier import store_start, with_store
    from gradtap.status import RateWindow
    from gradtap.tables import status_table

    console = Console(stderr=True)
    job = with_store(open_job(job_path), store)
    Appliance.check_streams(job, specs)
    group = mirror_group(job, group_at, rendezvous, group_timeout)
    if group is not None:
        refuse_for_group({"--store": bool(store), "--start-from-store": start_from_store,
                          "--resync-dir": bool(resync_dirs), "--force": force})
    options = RunOptions(ring_slots=ring_slots, slot_size=slot_size, hugepages=hugepages,
                         capture_cpus=dict(zip(specs, cores)), parse_cpus=parse_cores, update_cpus=update_cores,
                         force=force, start=start, control_token_file=control_token_file, rehearse=not no_rehearsal)
    # A seed is no start state for a live job: it may be running already (gradtap/start.py).
    if start_from_store:
        with rebuild_progress(console, "replaying the store's gradient log") as (loading, progress):
            begin = store_start(job, progress, loading)
    else:
        start_source = f"--start {start}" if start else f"initial_state.checkpoint {job.initial_state.checkpoint}"
        checkpoint = None
        if start or job.initial_state.checkpoint:
            with bytes_progress(console, f"loading {start_source}") as progress:
                checkpoint = start_checkpoint(job, start, progress)
        # Only the start holds the checkpoint: its memory is freed once the replica is built.
        begin = replica_start(job, checkpoint, start_source)
    meeting = "" if group is None else f"; meeting the group's other nodes at {group.rendezvous}"
    with console.status(f"building the replica from {begin.source}{meeting}"):
        appliance = Appliance(job, specs, out, begin, options, group)
    wait_for_stop(appliance, (signal.SIGINT, signal.SIGTERM))
    if options.rehearse:
        with console.status("rehearsing the pipeline on a simulated miniature of the job before listening "
                            "(some 20 s after an install or upgrade: it compiles every kernel)"):
            done = appliance.rehearse()
        console.print(f"rehearsal: {done.iterations} iterations of a miniature of the job exact in "
                      f"{done.seconds:.1f} s")
    if metrics_port:
        metrics.serve(appliance.status, metrics_port, metrics_address)
    control = None
    if control_port:
        settings = ControlSettings(token_file=token_file_of(job, out, options),
                                   max_checkpoint_bytes=offer_size_limit(job),
                                   resync_dirs=tuple(resync_dirs) or job.appliance.resync_dirs,
                                   address=control_address, port=control_port)
        # Each offered file is loaded into a checkpoint of its own, which nothing else keeps.
        control = ControlServer(functools.partial(appliance.offer, handed_over=True), appliance.status, settings,
                                attest=appliance.attest)
    live = Live(console=console, auto_refresh=False) if console.is_terminal and not no_status else None
    if live is not None:
        live.start()
        rates = RateWindow()
        status_loop(appliance, lambda s: live.update(status_table(s, rates(s)), refresh=True))
    try:
        result = appliance.run()
    finally:
        if live is not None:
            live.stop()
        if control is not None:
            control.close()
    if not appliance.pipeline.numbered:
        state = ("replica never started: no checkpoint with time_ns was offered that the capture could place "
                 "(events.jsonl says why)")
    else:
        state = f"replica at iteration {appliance.replica.iteration}{' (stale)' if appliance.replica.stale else ''}"
    if appliance.group is not None:
        g = appliance.group.report()
        state += (f"; node {g['rank']} of {g['world_size']}, shard of buckets {g['buckets']}, "
                  f"{g['sent_bytes']:,} bytes sent to peers, {g['received_bytes']:,} received")
    # Plain text: a reason may quote brackets (gloo's "[.../pair.cc:537]") that are no markup.
    console.print(f"gradtap run: {result.reason}; {result.iterations} iteration(s) merged, "
                  f"{result.unrecoverable} unrecoverable; {state}", markup=False)
    sys.exit(result.exit_code)
