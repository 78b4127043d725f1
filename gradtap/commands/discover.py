"""``gradtap discover CAPTURE... [--job PARTIAL] [--out FILE]``: the ring section of a job
spec, and the NCCL settings that shape the wire, learnt from captures; an operator starts from
this, not from a blank file. The learning is :func:`gradtap.parser.discover.discover`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from gradtap.cli import app


def _partial(path: Path) -> dict:
    from gradtap.core.errors import ConfigError
    from gradtap.workload.spec import read_job_document

    doc = read_job_document(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a job spec is a YAML mapping, got {type(doc).__name__}")
    return doc


def render(found) -> str:
    """The discovery as YAML, the learnt QPNs and what was not decided as comments above it."""
    import yaml

    lines = ["# written by gradtap discover from the traffic"]
    for i, learnt in enumerate(found.learnt):
        if learnt:
            lines.append(f"# QPNs learnt from capture {i} (learnt again at every start; for reference):")
            lines += [f"#   {label}: {qpn:#x}" for label, qpn in sorted(learnt.items())]
    if found.undecided:
        lines.append("# not decided from the wire:")
        lines += [f"#   - {u}" for u in found.undecided]
    return "\n".join(lines) + "\n" + yaml.safe_dump(found.doc, sort_keys=False)


@app.command("discover")
@click.argument("captures", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="CAPTURE...",
                help="pcap or pcapng captures of one job (mirrored ports)")
@click.option("--job", "partial", type=click.Path(path_type=Path), metavar="PARTIAL",
              help="a partial job spec with at least name and model: decide the ring's rotation, channels, "
                   "QPs and era by locking on, and write the whole job")
@click.option("--out", type=click.Path(path_type=Path), metavar="FILE", help="write the YAML here (default: stdout)")
def discover_command(captures: tuple[Path, ...], partial: Path | None, out: Path | None) -> None:
    """The ring of a job spec (ranks, MACs, channels, protocol, MTU, era) learnt from captures."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    from gradtap.parser.discover import discover

    doc = _partial(partial) if partial is not None else None
    console = Console(stderr=True)
    if console.is_terminal:
        with Progress(TextColumn("{task.description}"), BarColumn(), console=console, transient=True) as bar:
            task = bar.add_task("reading", total=None)
            found = discover(captures, doc, lambda what, done, total: bar.update(task, description=what,
                                                                                completed=done, total=total))
    else:
        found = discover(captures, doc)
    text = render(found)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, encoding="utf-8")
    for u in found.undecided:
        console.print(f"not decided: {u}", highlight=False)
