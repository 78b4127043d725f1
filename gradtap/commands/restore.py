"""``gradtap restore --at ITERATION --store URL|DIR --job JOB --out DIR``: the state of any
iteration since a READY snapshot, rebuilt bit for bit from the store's snapshot and gradient
log (``store/gradient_log.py``), written as a snapshots directory a trainer resumes from."""

from __future__ import annotations

from pathlib import Path

import click

from gradtap.cli import app


@app.command("restore")
@click.option("--at", "at", required=True, type=click.IntRange(min=0), metavar="ITERATION",
              help="the iteration the state is for: the one a trainer continues at, as snapshots are named")
@click.option("--store", "url", required=True, metavar="URL|DIR",
              help="the job's store: file:///DIR, s3://BUCKET/PREFIX (endpoint: appliance.store.endpoint_url or "
                   "AWS_ENDPOINT_URL), or a directory")
@click.option("--job", "job_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              metavar="JOB", help="the job spec YAML the appliance ran")
@click.option("--out", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="new snapshots directory to write (LATEST and iteration-NNNNNN/, as the appliance writes them)")
@click.option("--force", is_flag=True, help="replace DIR if it exists")
def restore_command(at: int, url: str, job_path: Path, out: Path, force: bool) -> None:
    """Rebuild the state of any iteration since a snapshot from the store's gradient log."""
    from rich.console import Console

    from gradtap.job_file import open_job
    from gradtap.out_dir import published, refuse_existing
    from gradtap.progress import rebuild_progress
    from gradtap.store.gradient_log import rebuild
    from gradtap.store.object_store import SnapshotStore
    from gradtap.store.snapshot import Snapshots
    from gradtap.store_tier import with_store

    refuse_existing(out, force=force)
    if "://" not in url:
        url = Path(url).resolve().as_uri()
    job = with_store(open_job(job_path), url)
    store = SnapshotStore.of_spec(job.appliance.store, job.name)
    console = Console(stderr=True)
    with rebuild_progress(console, f"replaying the gradient log to iteration {at}") as (loading, progress):
        rebuilt = rebuild(job, store, at, progress, loading)
    with published(out, force=force) as tmp:
        snapshots = Snapshots(tmp, job.name, keep=1)
        try:
            written = snapshots.write(rebuilt.checkpoint, step=rebuilt.step)
        finally:
            snapshots.close()
    Console().print(f"iteration {at} of job {job.name}: the snapshot of iteration {rebuilt.snapshot} and "
                    f"{len(rebuilt.replayed)} gradient log record(s); written to {out / written.name} "
                    f"(gradtap.trainer.restore(model, optimizer, {str(out)!r}))", highlight=False)
