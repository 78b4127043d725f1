"""``gradtap inspect FILE [--job JOB] [--json]``: what a capture holds, the first thing an
operator runs on one. The summary itself is :func:`gradtap.parser.inspect.inspect_capture`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gradtap.cli import app

if TYPE_CHECKING:
    from rich.table import Table


def _opcode(code: int) -> str:
    from gradtap.wire.headers.opcodes import OPCODES

    op = OPCODES.get(code)
    if op is None:
        return f"{code:#04x} unknown"
    name = op.name.removeprefix("RC_").removeprefix("RDMA_")
    return f"{code:#04x} {name.replace('_WITH_IMMEDIATE', '_IMM').replace('_WITH_INVALIDATE', '_INV')}"


TABLE_ROWS = 100       # flows shown in a table; --json lists every one tracked


def flows_table(summary: dict) -> Table:
    """One row per RoCEv2 flow (the first TABLE_ROWS): its addresses and QP, frames, PSNs,
    protocol and opcodes."""
    from gradtap.tables import table

    icrc, flows, untracked = summary["icrc"], summary["flows"], summary["not_tracked"]
    notes = []
    if len(flows) > TABLE_ROWS:
        notes.append(f"the first {TABLE_ROWS} of {len(flows):,} flows; --json for all")
    if untracked["flows"]:
        notes.append(f"{'at least ' if not untracked['flows_exact'] else ''}{untracked['flows']:,} more flows not "
                     f"tracked ({untracked['frames']:,} frames; limit {untracked['limit']:,}, --max-flows)")
    t = table(f"{summary['file']} ({summary['format']}): {summary['frames']:,} frames, "
              f"{summary['roce_frames']:,} RoCEv2; ICRC ok {icrc['ok']:,}, bad {icrc['bad']:,}",
              "#", "flow", "frames\npayload B", "PSN first\nlast\ngaps", "NCCL", "opcodes: frames",
              numeric=("#", "frames\npayload B", "PSN first\nlast\ngaps"), caption="; ".join(notes) or None)
    t.leading = 1                    # rows of several lines each
    for i, f in enumerate(flows[:TABLE_ROWS]):
        opcodes = "\n".join(f"{_opcode(int(op))}: {n:,}" for op, n in f["opcodes"].items())
        t.add_row(str(i), f"{f['src']} →\n{f['dst']}\nQP {f['dest_qp']:#08x}\nUDP {f['udp_sport']}",
                  f"{f['frames']:,}\n{f['payload_bytes']:,}", f"{f['psn_first']}\n{f['psn_last']}\n{f['psn_gaps']}",
                  f["nccl_protocol"], opcodes)
    return t


def job_table(summary: dict) -> Table:
    """The flows' messages by phase of the job's wire plan, and by bucket."""
    from gradtap.parser.inspect import PHASE_NAMES
    from gradtap.tables import table

    job = summary["job"]
    buckets = ", ".join(f"{b}: {n:,}" for b, n in job["buckets"].items()) or "none"
    t = table(f"messages of job {job['name']} by phase (stream {job['stream']})", "#", "plan flow", *PHASE_NAMES,
              "bucket: messages", numeric=("#", *PHASE_NAMES), caption=f"data messages per bucket: {buckets}")
    t.leading = 1
    for i, f in enumerate(summary["flows"][:TABLE_ROWS]):
        info = f.get("job")
        if info is None:
            continue
        if info["plan_flow"] is None:
            plan = "not the job's"
        else:
            plan = info["label"] + (f"\n{info['alignments']} alignments" if info["alignments"] > 1 else "")
        t.add_row(str(i), plan, *(f"{info['messages'][p]:,}" for p in PHASE_NAMES),
                  "\n".join(f"{b}: {n}" for b, n in info["buckets"].items()))
    t.add_row("", "total", *(f"{job['phases'][p]:,}" for p in PHASE_NAMES), "", style="bold")
    return t


def job_notes(summary: dict) -> list[str]:
    """What the job mapping could not do: a refused alignment, and why flows were not learnt."""
    job = summary["job"]
    notes = [f"refused: {job['refused']}"] if job.get("refused") else []
    if job.get("detail"):
        notes.append(job["detail"])
    return notes


def run_inspect(file: Path, job: Path | None, max_flows: int, stream: str | None) -> dict:
    """The summary, with a progress bar on stderr when it is a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from gradtap.parser.inspect import inspect_capture
    from gradtap.job_file import open_job

    progress_console = Console(stderr=True)
    spec = open_job(job) if job is not None else None
    if not progress_console.is_terminal:
        return inspect_capture(file, spec, max_flows=max_flows, stream=stream)
    columns = (TextColumn("inspecting"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=progress_console, transient=True) as bar:
        task = bar.add_task("inspect", total=None)
        return inspect_capture(file, spec, max_flows=max_flows, stream=stream,
                               progress=lambda done, total: bar.update(task, completed=done, total=total))


@app.command("inspect")
@click.argument("file", type=click.Path(path_type=Path), metavar="FILE", help="pcap or pcapng capture (Ethernet)")
@click.option("--job", type=click.Path(path_type=Path), metavar="JOB",
              help="job spec YAML: map messages to phases and buckets")
@click.option("--stream", metavar="NAME",
              help="with --job: the job's mirror stream the capture is (default: the one whose flows it shows)")
@click.option("--max-flows", type=click.IntRange(min=1), default=65536, metavar="N",
              help="flows listed one by one; further flows are counted (flows and frames), not listed")
@click.option("--json", "as_json", is_flag=True, help="print the summary as one JSON object")
def inspect_command(file: Path, job: Path | None, stream: str | None, max_flows: int, as_json: bool) -> None:
    """RoCEv2 flows of a capture: ICRC results, opcodes, PSN gaps and the NCCL protocol."""
    from rich.console import Console

    summary = run_inspect(file, job, max_flows, stream)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    console = Console()
    console.print(flows_table(summary))
    if "job" in summary:
        console.print(job_table(summary))
        for note in job_notes(summary):
            console.print(note, highlight=False)
