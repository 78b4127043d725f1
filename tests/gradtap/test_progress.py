"""The progress displays, drawn by rich on a terminal console."""

from __future__ import annotations

import io
import re

from rich.console import Console

from gradtap.progress import bytes_progress, rebuild_progress


def drawn(run) -> str:
    """What ``run(console)`` leaves on a terminal, control sequences left out."""
    out = io.StringIO()
    run(Console(file=out, force_terminal=True, width=120))
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())


def test_a_rebuild_shows_the_snapshots_bytes_then_the_records():
    def rebuild(console):
        with rebuild_progress(console, "replaying the store's gradient log") as (loading, records):
            loading(500_000_000, 1_494_000_000)
            loading(1_494_000_000, 1_494_000_000)
            records(3, 5)

    lines = [line.strip("\r") for line in drawn(rebuild).splitlines() if line.strip("\r")]
    assert re.fullmatch(r"reading the store's snapshot\s+[━╺]+ 1\.5/1\.5 GB \d:\d\d:\d\d", lines[-2]), lines
    assert re.fullmatch(r"replaying the store's gradient log\s+[━╺]+ 3/5\s+\d:\d\d:\d\d", lines[-1]), lines


def test_a_bar_is_not_shown_before_its_first_update():
    def snapshot_only(console):
        with rebuild_progress(console, "replaying the store's gradient log") as (loading, _):
            loading(10_000_000, 20_000_000)

    shown = drawn(snapshot_only)
    assert "reading the store's snapshot" in shown and "10.0/20.0 MB" in shown and "replaying" not in shown

    def nothing(console):
        with rebuild_progress(console, "replaying the store's gradient log"):
            pass

    assert not drawn(nothing).strip()


def test_a_load_shows_its_bytes_at_once():
    def load(console):
        with bytes_progress(console, "loading --start c.pt") as progress:
            progress(250_000_000, 1_000_000_000)

    assert re.search(r"loading --start c\.pt\s+[━╺]+ 0\.2/1\.0 GB", drawn(load)), drawn(load)
