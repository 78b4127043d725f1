"""``gradtap replay JOB PCAP... --out DIR``: the appliance over capture files (``gradtap/replay.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from gradtap.cli import app
from gradtap.commands.group_options import group_options, mirror_group, refuse_for_group
from gradtap.core.errors import CaptureError


@app.command("replay")
@click.argument("job_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="JOB",
                help="job spec YAML")
@click.argument("pcaps", nargs=-1, required=True, metavar="PCAP...",
                help="captures: STREAM=PATH, or a file named after its stream")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="output directory: snapshots/, iterations.jsonl, events.jsonl, replay.json")
@click.option("--start", type=click.Path(path_type=Path), metavar="CKPT",
              help="trainer checkpoint the capture starts from (default: the job's initial_state); one of "
                   "--out's own snapshots continues its replica")
@click.option("--store", metavar="URL",
              help="durable store the snapshots are also uploaded to, in the background: file:///DIR or "
                   "s3://BUCKET/PREFIX (overrides appliance.store.url; docs/store.md, Storage tiers)")
@click.option("--start-from-store", is_flag=True,
              help="start from the newest READY snapshot in the store that verifies and the gradient log after "
                   "it (a restarted appliance whose local snapshots are lost); nothing usable: wait for the "
                   "trainer's checkpoint (fallback)")
@click.option("--digests/--no-digests", default=True,
              help="record a digest of the replica after every iteration (for verify; a --group node records none)")
@click.option("--resync", multiple=True, type=click.Path(exists=True, path_type=Path), metavar="CKPT",
              help="trainer checkpoint to resynchronise a stale replica from when the streams reach its "
                   "iteration (repeatable)")
@click.option("--force", is_flag=True,
              help="clear the snapshots in --out when they are another replica's (another job or start state)")
@click.option("--gradients", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="write each recovered iteration's reduced gradient here: iter_NNNNNN.npy, flat in wire order "
                   "and dtype (bf16/fp16 as uint16), with layout.json (the simulator's truth format)")
@group_options("replaying")
def replay_command(job_path: Path, pcaps: tuple[str, ...], out: Path, start: Path | None, store: str | None,
                   start_from_store: bool, digests: bool, resync: tuple[Path, ...], force: bool,
                   gradients: Path | None, group_at: str | None, rendezvous: str | None,
                   group_timeout: float | None) -> None:
    """Capture → parse → merge → update over files: the appliance, offline."""
    from rich.console import Console

    from gradtap.checkpoints import load_checkpoint, start_checkpoint
    from gradtap.progress import bytes_progress, rebuild_progress, replay_progress
    from gradtap.replay import match_streams, run_replay
    from gradtap.start import replica_start
    from gradtap.tables import events_table, iteration_table, rate_line
    from gradtap.job_file import open_job
    from gradtap.store_tier import store_start, with_store

    console = Console()
    job = with_store(open_job(job_path), store)
    if start and start_from_store:
        raise click.UsageError("give --start or --start-from-store, not both")
    streams = match_streams(job, list(pcaps))
    group = mirror_group(job, group_at, rendezvous, group_timeout)
    if group is not None:
        refuse_for_group({"--store": bool(store), "--start-from-store": start_from_store, "--resync": bool(resync),
                          "--gradients": gradients is not None, "--force": force})
        _group_replay(console, job, job_path, streams, out, start, group)
        return
    if len(streams) < 3:
        console.print(f"[yellow]warning:[/] {len(streams)} mirror stream(s): FlowCheck's analysis needs 3 to "
                      "survive single mirror-link losses; expect unrecoverable iterations "
                      "(see `gradtap netconfig plan` for the probability)")
    # Each checked now from a map of its file (no tensor read), so that a bad one is refused
    # before the replay touches --out; then loaded one at a time as the replica takes them, each
    # handed over: it gives its tensors up as its offer copies them, so that no two are held
    # whole beside the offers.
    for path in resync:
        load_checkpoint(path, what="--resync", mapped=True)
    checkpoints = (load_checkpoint(path, what="--resync") for path in resync)
    if start_from_store:
        with rebuild_progress(console, "replaying the store's gradient log") as (loading, progress):
            begin = store_start(job, progress, loading)
    else:    # nothing here keeps the checkpoint: its memory is freed once the replica holds it
        source = f"--start {start}" if start else f"initial_state of {job_path}"
        with bytes_progress(console, f"loading {source}") as progress:
            begin = replica_start(job, start_checkpoint(job, start, progress), source)
    with replay_progress(console, streams) as progress:
        result, sink = run_replay(job, streams, out, begin, digests=digests, progress=progress, resync=checkpoints,
                                  resync_handed_over=True, force=force, gradients=gradients, continues=start)
    console.print(iteration_table(result, sink))
    console.print(events_table(result))
    console.print(rate_line(result))
    state = "[red]stale[/]" if sink.replica.stale else "current" if sink.applied else \
        "[yellow]unchanged[/] (nothing applied: still the start state)"
    console.print(f"replica {state} at iteration {sink.replica.iteration}; snapshots in {out / 'snapshots'}; "
                  f"events in {out / 'events.jsonl'}")
    if gradients is not None:
        console.print(f"reduced gradients of the recovered iterations in {gradients}")
    unlocked = [name for name, locked in result.locked.items() if not locked]
    for name in unlocked:
        console.print(f"[yellow]warning:[/] stream {name} never locked on to the job's traffic; why: "
                      f"lockon.failed in {out / 'events.jsonl'}")
    if unlocked and len(unlocked) == len(result.locked):
        raise CaptureError(f"no stream locked on to job {job.name!r}: nothing was applied (the lockon.failed "
                           f"events in {out / 'events.jsonl'} say what each stream saw and expected)")


def _group_replay(console, job, job_path: Path, streams, out: Path, start: Path | None, group) -> None:
    from gradtap.checkpoints import start_checkpoint
    from gradtap.group import run_group_replay
    from gradtap.progress import replay_progress
    from gradtap.start import replica_start
    from gradtap.tables import iteration_table

    begin = replica_start(job, start_checkpoint(job, start),
                          f"--start {start}" if start else f"initial_state of {job_path}")
    with replay_progress(console, streams) as progress:
        result, sink = run_group_replay(job, streams, out, begin, group, progress=progress)
    console.print(iteration_table(result, sink))
    r = sink.replica
    state = "[red]stale[/]" if r.stale else "current" if sink.applied else "[yellow]unchanged[/]"
    exchanged = json.loads((out / "replay.json").read_text())["group"]
    console.print(f"node {group.rank} of {group.world_size}: shard of buckets {r.stepped_buckets()} {state} at "
                  f"iteration {r.iteration}; {exchanged['sent_bytes']:,} bytes sent to peers for "
                  f"{exchanged['mirrored_bytes']:,} mirrored; events in {out / 'events.jsonl'}")
