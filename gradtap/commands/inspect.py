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
from gradtap.tables import table

console = Console()
progress_console = Console(stderr=True)


def _opcode(code: int) -> str:
    from gradtap.wire.headers.opcodes import OPCODES

    op = OPCODES.get(code)
    if op is None:
        return f"{code:#04x} unknown"
    name = op.name.removeprefix("RC_").removeprefix("RDMA_")
    return f"{code:#04x} {name.replace('_WITH_IMMEDIATE', '_IMM').replace('_WITH_INVALIDATE', '_INV')}"


def flows_table(summary: dict) -> Table:
    """One row per RoCEv2 flow: its addresses and QP, frames, PSNs, protocol and opcodes."""
    icrc = summary["icrc"]
    t = table(f"{summary['file']} ({summary['format']}): {summary['frames']:,} frames, "
              f"{summary['roce_frames']:,} RoCEv2; ICRC ok {icrc['ok']:,}, bad {icrc['bad']:,}",
              "#", "flow", "frames\npayload B", "PSN first\nlast\ngaps", "NCCL", "opcodes: frames",
              numeric=("#", "frames\npayload B", "PSN first\nlast\ngaps"))
    t.leading = 1                    # rows of several lines each
    for i, f in enumerate(summary["flows"]):
        opcodes = "\n".join(f"{_opcode(int(op))}: {n:,}" for op, n in f["opcodes"].items())
        t.add_row(str(i), f"{f['src']} →\n{f['dst']}\nQP {f['dest_qp']:#08x}\nUDP {f['udp_sport']}",
                  f"{f['frames']:,}\n{f['payload_bytes']:,}", f"{f['psn_first']}\n{f['psn_last']}\n{f['psn_gaps']}",
                  f["nccl_protocol"], opcodes)
    return t


def job_table(summary: dict) -> Table:
    """The flows' messages by phase of the job's wire plan, and by bucket."""
    from gradtap.parser.inspect import PHASE_NAMES

    job = summary["job"]
    buckets = ", ".join(f"{b}: {n:,}" for b, n in job["buckets"].items()) or "none"
    t = table(f"messages of job {job['name']} by phase", "#", "plan flow", *PHASE_NAMES, "bucket: messages",
              numeric=("#", *PHASE_NAMES), caption=f"data messages per bucket: {buckets}")
    t.leading = 1
    for i, f in enumerate(summary["flows"]):
        info = f.get("job")
        if info is None:
            continue
        if info["plan_flow"] is None:
            plan = "no match"
        else:
            plan = (f"{info['kind']} rank {info['src_rank']}->{info['dst_rank']}\nchannel {info['channel']}, "
                    f"qp {info['qp']}" + (f"\n{info['alignments']} alignments" if info["alignments"] > 1 else ""))
        t.add_row(str(i), plan, *(f"{info['messages'][p]:,}" for p in PHASE_NAMES),
                  "\n".join(f"{b}: {n}" for b, n in info["buckets"].items()))
    t.add_row("", "total", *(f"{job['phases'][p]:,}" for p in PHASE_NAMES), "", style="bold")
    return t


def run_inspect(file: Path, job: Path | None) -> dict:
    """The summary, with a progress bar on stderr when it is a terminal."""
    from gradtap.parser.inspect import inspect_capture
    from gradtap.workload.spec import load_job

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
    file: Path = typer.Argument(..., metavar="FILE", help="pcap or pcapng capture (Ethernet)"),
    job: Path = typer.Option(None, "--job", metavar="JOB", help="job spec YAML: map messages to phases and buckets"),
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
