"""The Rich tables and lines the commands print about a simulation, a replay, a verification
and a running appliance. Each fits a terminal of 80 columns: long cells fold onto more
lines, nothing is cut off.

Only Rich is imported here; the results are read by attribute, so the stages they come from
are not imported (``gradtap --help`` stays fast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

if TYPE_CHECKING:
    from gradtap.status import ApplianceStatus, Rates
    from gradtap.replay import ReplayResult
    from gradtap.replica_sink import ReplicaSink
    from gradtap.simulator.run import Summary
    from gradtap.verify import Verification


def table(title: str, *columns: str, numeric: tuple[str, ...] = (), caption: str | None = None) -> Table:
    """A table whose cells fold rather than being cut, ruled under its header only (columns
    are told apart by alignment, which leaves their content the width); ``numeric`` columns
    are right-aligned."""
    t = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in columns:
        t.add_column(name, justify="right" if name in numeric else "left", overflow="fold")
    return t


def _faults(counts: dict[str, int]) -> str:
    return "\n".join(f"{k} {v:,}" for k, v in counts.items() if v) or "none"


def summary_table(summary: Summary) -> Table:
    """What ``gradtap simulate`` wrote: frames per mirror stream and the faults injected."""
    t = table(f"simulated {len(summary.iterations)} iteration(s) into {summary.out}",
              "capture", "frames", "RoCE\nframes", "MB", "mirror faults", numeric=("frames", "RoCE\nframes", "MB"),
              caption=f"training-link faults: {_faults(summary.link_faults).replace(chr(10), ', ')}; "
                      f"{summary.seconds_training:.1f} s training, {summary.seconds_encoding:.1f} s encoding")
    for s in summary.streams:
        t.add_row(str(s.path.relative_to(summary.out)), f"{s.frames:,}", f"{s.roce_frames:,}",
                  f"{s.bytes / 1e6:,.1f}", _faults(s.faults))
    return t


def iteration_table(result: ReplayResult, sink: ReplicaSink) -> Table:
    """One row per merged iteration: coverage per stream, whether it merged, copies, times."""
    streams = list(result.frames)
    ms = ("parse\nms", "merge\nms", "update\nms", "lag\nms")
    t = table("per-iteration report", "iter", "coverage %", "merged", "copies", *ms,
              numeric=("iter", "coverage %", *ms),
              caption=f"coverage: share of the gradient's blocks delivered by {' / '.join(streams)}; "
                      "copies: blocks delivered by several streams, compared bit for bit")
    timing = {x.iteration: x for x in result.timings}
    for line in sink.lines:
        x = timing.get(line["iteration"])
        cov = " / ".join(f"{line['coverage'][s] * 100:.0f}" if s in line["coverage"] else "-" for s in streams)
        merged = "[green]yes[/]" if line["recovered"] else "[red]NO[/], missing " + ", ".join(
            f"bucket {b}: {n} blocks" for b, n in line["missing_blocks"].items())
        copies = f"[red]{len(line['mismatches'])} differ[/]" if line["mismatches"] else "agree"
        ms = [f"{s * 1e3:.0f}" for s in (x.parse_s, x.merge_s, x.update_s, x.lag_s)] if x else ["-"] * 4
        t.add_row(str(line["iteration"]), cov, merged, copies, *ms)
    return t


def events_table(result: ReplayResult) -> Table:
    """Frames per decode event (``wire/events.py``) and stream."""
    streams = list(result.counters)
    t = table("frames by decode event", "event", *streams, numeric=tuple(streams))
    for name in sorted({k for c in result.counters.values() for k in c}):
        t.add_row(name, *[f"{result.counters[s].get(name, 0):,}" for s in streams])
    return t


def rate_line(result: ReplayResult) -> str:
    """How much mirrored traffic the replay processed a second, in all and per core: what
    ``max_ingest_gbps`` of a CPU node (``gradtap netconfig plan``) can be measured by."""
    gbps = result.mirrored_gbps
    return (f"mirrored {sum(result.bytes.values()) / 1e9:.2f} GB in {result.wall_s:.2f} s: {gbps:.2f} Gb/s, "
            f"{gbps / result.cores:.2f} Gb/s per core ({result.cores} cores)")


def verification_lines(v: Verification) -> list[str]:
    """What ``gradtap verify`` found, the first differences named."""
    lines = [f"digests of {len(v.digests_checked)} iteration(s) and {len(v.snapshots_checked)} snapshot(s) "
             "compared with the ground truth"]
    if v.before_start:
        lines.append(f"captured before the trainer's checkpoint the replica began from (not applied): "
                     f"{v.before_start}")
    if v.stale:
        lines.append(f"iterations not applied (replica stale): {v.stale}")
    lines += [f"[red]DIFFERENT[/] {d}" for d in v.differences[:5]]
    if len(v.differences) > 5:
        lines.append(f"[red]... and {len(v.differences) - 5} more difference(s)[/]")
    lines.append("[bold green]replica == trainer, bit for bit[/]" if v.ok else "[bold red]replica != trainer[/]")
    return lines


def status_table(s: ApplianceStatus, rates: Rates | None = None) -> Table:
    """The live view of ``gradtap run``: capture and decode counters per stream, and, with
    ``rates`` (``gradtap.status.RateWindow``; dashes without), each stream's frames, bits and
    capture CPU a second, and the CPU the appliance uses in all: the cores per Mpps a CPU
    node is sized by."""
    replica = f"replica at iteration {s.replica_iteration}{' [red](stale)[/]' if s.stale else ''}" if s.numbered \
        else "[yellow]replica waiting for the trainer's checkpoint with time_ns[/]"
    numeric = ("frames", "kpps", "Gb/s", "CPU %", "kernel\ndrops", "ring\ndrops", "written", "duplicates")
    t = table(f"gradtap: {replica}; {s.recovered} merged, {s.unrecoverable} unrecoverable, {s.skipped} skipped; "
              f"lag {s.lag_s * 1e3:.1f} ms", "stream", *numeric, numeric=numeric, caption=_cpu_caption(rates))
    t.collapse_padding = True       # nine columns in 80
    for name, c in s.capture.items():
        e = s.events.get(name, {})
        now = ("-",) * 3 if rates is None else (
            f"{rates.pps.get(name, 0) / 1e3:,.0f}", f"{rates.bps.get(name, 0) / 1e9:.1f}",
            _percent(rates.capture_cores.get(name)))
        t.add_row(name, f"{c.get('frames', 0):,}", *now, f"{c.get('kernel_drops', 0):,}",
                  f"{c.get('ring_drops', 0):,}", f"{e.get('data.written', 0):,}", f"{e.get('data.duplicate', 0):,}")
    return t


def _percent(cores: float | None) -> str:
    return "-" if cores is None else f"{cores * 100:.0f}"


def _cpu_caption(rates: Rates | None) -> str | None:
    """The appliance's CPU over the last refresh: its own process, and in all per Mpps."""
    if rates is None:
        return None
    cost = rates.core_s_per_mframe
    per = "" if cost is None else f" ({cost:.2f} per Mpps)"
    return (f"CPU %: of one core, each stream's capture worker; the appliance: {rates.appliance_cores:.2f} cores "
            f"parsing, merging and updating, {rates.cores:.2f} in all{per}")
