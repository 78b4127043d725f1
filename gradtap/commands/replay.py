"""``gradtap replay`` and ``gradtap verify``: the appliance over capture files, and its proof."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gradtap.cli import app
from gradtap.control import ControlPlane
from gradtap.core.errors import ConfigError
from gradtap.replay import ReplayResult, match_streams, replay
from gradtap.replica_sink import ReplicaSink
from gradtap.verify import Verification, verify
from gradtap.updater.replica import Replica
from gradtap.updater.snapshot import Snapshots
from gradtap.workload.layout import job_params, job_plan
from gradtap.workload.spec import JobSpec, load_job

console = Console()


def run_replay(job: JobSpec, pcaps: dict[str, Path], out: Path, start: dict, *, digests: bool = True,
               batch_frames: int = 65536, show_progress: bool = True,
               resync: list[dict] | None = None) -> tuple[ReplayResult, ReplicaSink]:
    """Replay ``pcaps`` into a replica initialised from ``start`` (a trainer checkpoint dict
    whose ``iteration`` is the capture's first iteration); results go to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("iterations.jsonl", "events.jsonl"):
        (out / stale).unlink(missing_ok=True)
    plan = job_plan(job)
    replica = Replica(job, start)
    control = ControlPlane(out / "events.jsonl", job.appliance.control_endpoint)
    snapshots = Snapshots(out / "snapshots", job.name, every=job.appliance.snapshot_every,
                          keep=job.appliance.snapshot_keep)
    sink = ReplicaSink(replica, control, replica.iteration, snapshots=snapshots,
                       report_path=out / "iterations.jsonl", digests=digests, resync=resync)
    columns = (TextColumn("{task.description:>14}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    finished = False
    try:
        with Progress(*columns, console=console, transient=True, disable=not show_progress) as bar:
            tasks = {n: bar.add_task(n, total=p.stat().st_size) for n, p in pcaps.items()}
            result = replay(job, plan, pcaps, sink, batch_frames=batch_frames,
                            progress=lambda n, done, total: bar.update(tasks[n], completed=done))
        finished = replica.open_iteration is None and bool(sink.applied)
    finally:
        snapshots.close(replica if finished else None)   # a clean end writes a final snapshot
    (out / "replay.json").write_text(json.dumps({
        "job": job.name, "streams": {n: str(p) for n, p in pcaps.items()}, "wall_s": result.wall_s,
        "frames": result.frames, "bytes": result.bytes, "events": result.counters,
        "iterations": sink.lines, "stale": replica.stale,
        "timings": [t.__dict__ for t in result.timings]}, indent=1))
    return result, sink


def iteration_table(result: ReplayResult, sink: ReplicaSink) -> Table:
    streams = list(result.frames)
    table = Table(title="per-iteration report")
    for col in ("iter", "coverage % (" + " / ".join(streams) + ")", "merged", "copies", "parse|merge|update ms",
                "lag ms"):
        table.add_column(col, justify="right")
    timing = {t.iteration: t for t in result.timings}
    for line in sink.lines:
        t = timing.get(line["iteration"] - sink.first)
        cov = " / ".join(f"{line['coverage'][s] * 100:.0f}" if s in line["coverage"] else "-" for s in streams)
        ok = "[green]yes[/]" if line["recovered"] else "[red]NO[/] missing " + ", ".join(
            f"bucket {b}: {n} blocks" for b, n in line["missing_blocks"].items())
        dup = f"[red]{len(line['mismatches'])} differ[/]" if line["mismatches"] else "agree"
        times = "|".join(f"{x * 1e3:.0f}" for x in (t.parse_s, t.merge_s, t.update_s)) if t else "-"
        table.add_row(str(line["iteration"]), cov, ok, dup, times, f"{t.lag_s * 1e3:.0f}" if t else "-")
    table.caption = ("coverage: share of the gradient's blocks each stream delivered; "
                     "copies: blocks delivered by several streams, compared bit for bit")
    return table


def events_table(result: ReplayResult) -> Table:
    table = Table(title="frames by decode event")
    table.add_column("event")
    for s in result.counters:
        table.add_column(s, justify="right")
    names = sorted({k for c in result.counters.values() for k in c})
    for name in names:
        table.add_row(name, *[f"{result.counters[s].get(name, 0):,}" for s in result.counters])
    return table


def verification_lines(v: Verification) -> list[str]:
    lines = [f"digests of {len(v.digests_checked)} iteration(s) and {len(v.snapshots_checked)} snapshot(s) compared "
             f"with the ground truth"]
    if v.stale:
        lines.append(f"iterations not applied (replica stale): {v.stale}")
    lines += [f"[red]DIFFERENT[/] {d}" for d in v.differences[:5]]
    lines.append("[bold green]replica == trainer, bit for bit[/]" if v.ok else "[bold red]replica != trainer[/]")
    return lines


@app.command("replay")
def replay_command(
    job_path: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="JOB", help="job spec YAML"),
    pcaps: list[str] = typer.Argument(..., metavar="PCAP...", help="captures: STREAM=PATH, or a file named after its stream"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory: snapshots/, iterations.jsonl, events.jsonl"),
    start: Path = typer.Option(None, "--start", help="trainer checkpoint the capture starts from (default: the "
                                                     "job's initial_state)"),
    digests: bool = typer.Option(True, help="record a digest of the replica after every iteration (for verify)"),
    resync: list[Path] = typer.Option([], "--resync", help="trainer checkpoint(s) to resynchronise a stale replica "
                                                           "from, when the streams reach its iteration"),
) -> None:
    """Capture → parse → merge → update over files: the appliance, offline."""
    job = load_job(job_path)
    streams = match_streams(job, pcaps)
    if len(streams) < 3:
        console.print(f"[yellow]warning:[/] {len(streams)} mirror stream(s): FlowCheck's analysis needs 3 to "
                      "survive single mirror-link losses; expect unrecoverable iterations "
                      "(see `gradtap netconfig plan` for the probability)")
    checkpoint = _checkpoint(job, start)
    result, sink = run_replay(job, streams, out, checkpoint, digests=digests,
                              resync=[_checkpoint(job, path) for path in resync])
    console.print(iteration_table(result, sink))
    console.print(events_table(result))
    console.print(f"replica {'[red]stale[/]' if sink.replica.stale else 'current'} at iteration "
                  f"{sink.replica.iteration}; snapshots in {out / 'snapshots'}; events in {out / 'events.jsonl'}")


def _checkpoint(job: JobSpec, start: Path | None) -> dict:
    path = start or job.initial_state.checkpoint
    if path is None:
        from gradtap.updater.replica import seed_checkpoint
        return seed_checkpoint(job, job.initial_state.seed or 0)
    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"--start {path}: cannot load a trainer checkpoint ({exc})") from None


@app.command("verify")
def verify_command(
    replay_dir: Path = typer.Argument(..., exists=True, file_okay=False, metavar="DIR", help="a replay's --out"),
    truth: Path = typer.Option(..., "--truth", exists=True, file_okay=False, help="the simulator's truth/"),
    job_path: Path = typer.Option(None, "--job", help="job spec (default: DIR's replay.json names none; "
                                                      "the truth's ../job.yaml)"),
) -> None:
    """Exit 0 only when the replica equals the ground truth bit for bit."""
    job = load_job(job_path or truth.parent / "job.yaml")
    v = verify(replay_dir, truth, job_params(job))
    for line in verification_lines(v):
        console.print(line)
    sys.exit(0 if v.ok else 1)
