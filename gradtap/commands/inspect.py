"""``gradtap inspect FILE [--job JOB] [--json]``: what a capture holds, the first thing an
operator runs on one. The summary itself is :func:`gradtap.parser.inspect.inspect_capture`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from gradtap.cli import app
from gradtap.wire.headers.opcodes import OPCODES
from gradtap.parser.inspect import PHASE_NAMES, inspect_capture
from gradtap.workload.spec import load_job

console = Console()
progress_console = Console(stderr=True)


def _opcode(code: int) -> str:
    op = OPCODES.get(code)
    return f"{code:#04x} {op.name.removeprefix('RC_').removeprefix('RDMA_') if op else 'unknown'}"


def flows_table(summary: dict) -> Table:
    icrc = summary["icrc"]
    table = Table(title=f"{summary['file']} ({summary['format']}): {summary['frames']:,} frames, "
                        f"{summary['roce_frames']:,} RoCEv2; ICRC ok {icrc['ok']:,}, bad {icrc['bad']:,}")
    for col in ("#", "source", "destination", "dest QP", "UDP sport", "frames", "opcodes", "payload B",
                "PSN first..last", "PSN gaps", "NCCL protocol"):
        table.add_column(col, justify="right" if col in ("#", "frames", "payload B", "PSN gaps") else "left")
    for i, f in enumerate(summary["flows"]):
        opcodes = "\n".join(f"{_opcode(int(op))}: {n:,}" for op, n in f["opcodes"].items())
        table.add_row(str(i), f["src"], f["dst"], f"{f['dest_qp']:#08x}", str(f["udp_sport"]), f"{f['frames']:,}",
                      opcodes, f"{f['payload_bytes']:,}", f"{f['psn_first']}..{f['psn_last']}",
                      str(f["psn_gaps"]), f["nccl_protocol"])
    return table


def job_table(summary: dict) -> Table:
    job = summary["job"]
    buckets = ", ".join(f"{b}: {n:,}" for b, n in job["buckets"].items()) or "none"
    table = Table(title=f"messages of job {job['name']} by phase", caption=f"data messages per bucket: {buckets}")
    for col in ("#", "plan flow", *PHASE_NAMES, "buckets"):
        table.add_column(col, justify="left" if col in ("plan flow", "buckets") else "right")
    for i, f in enumerate(summary["flows"]):
        info = f.get("job")
        if info is None:
            continue
        if info["plan_flow"] is None:
            plan = "no match"
        else:
            plan = (f"{info['kind']} rank {info['src_rank']}->{info['dst_rank']} channel {info['channel']} "
                    f"qp {info['qp']}" + (f" ({info['alignments']} alignments)" if info["alignments"] > 1 else ""))
        table.add_row(str(i), plan, *(f"{info['messages'][p]:,}" for p in PHASE_NAMES),
                      ", ".join(f"{b}: {n}" for b, n in info["buckets"].items()))
    table.add_row("", "total", *(f"{job['phases'][p]:,}" for p in PHASE_NAMES), "", style="bold")
    return table


def run_inspect(file: Path, job: Path | None) -> dict:
    """The summary, with a progress bar on stderr when it is a terminal."""
    spec = load_job(job) if job is not None else None
    if not progress_console.is_terminal:
        return inspect_capture(file, spec)
    columns = (TextColumn("inspecting"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=progress_console, transient=True) as bar:
        task = bar.add_task("inspect", total=None)
        return inspect_capture(file, spec, progress=lambda done, total: bar.update(task, completed=done,
                                                                                   total=total))


@app.command("inspect")
def inspect_command(
    file: Path = typer.Argument(..., help="pcap or pcapng capture (Ethernet)"),
    job: Path = typer.Option(None, "--job", help="job spec YAML: map messages to phases and buckets"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as one JSON object"),
) -> None:
    """RoCEv2 flows of a capture: ICRC results, opcodes, PSN gaps and the NCCL protocol."""
    summary = run_inspect(file, job)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    console.print(flows_table(summary))
    if "job" in summary:
        console.print(job_table(summary))
