"""Progress bars on a console while a stage works, each handing the stage the callback it takes.

They vanish when done (``transient``) and are not drawn on a console that is not a terminal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn)


@contextmanager
def simulation_progress(console: Console, iterations: int) -> Iterator[Callable[[str, int, int], None]]:
    """For ``Simulation.run(progress)``: what it is doing, and iterations done of ``iterations``."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("simulating", total=iterations)
        yield lambda what, done, total: bar.update(task, description=what, completed=done)


@contextmanager
def replay_progress(console: Console, pcaps: dict[str, Path]) -> Iterator[Callable[[str, int, int], None]]:
    """For ``replay(progress=...)``: bytes read of each stream's capture file."""
    columns = (TextColumn("{task.description:>14}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks = {n: bar.add_task(n, total=p.stat().st_size) for n, p in pcaps.items()}
        yield lambda stream, done, total: bar.update(tasks[stream], completed=done)


@contextmanager
def bytes_progress(console: Console, what: str) -> Iterator[Callable[[int, int], None]]:
    """For a checkpoint's load (``load_checkpoint(progress=...)``): bytes read of the total, as
    a context giving the ``progress(done, total)`` callback."""
    with _bars(console, [(what, False)]) as (update,):
        yield update


@contextmanager
def rebuild_progress(console: Console, what: str) -> Iterator[tuple[Callable[[int, int], None],
                                                                   Callable[[int, int], None]]]:
    """For a rebuild from the store (``rebuild(progress=..., loading=...)``): the snapshot's
    bytes read, then the gradient log's records applied (``what``), each bar shown from its
    first update; a context giving the ``(loading, progress)`` callbacks."""
    with _bars(console, [("reading the store's snapshot", False), (what, True)]) as (loading, records):
        yield loading, records


class _Count(ProgressColumn):
    """A task's count: records done of the total (``records`` field), or bytes read of them."""

    def __init__(self):
        super().__init__()
        self._records, self._bytes = MofNCompleteColumn(), DownloadColumn()

    def render(self, task):
        return (self._records if task.fields["records"] else self._bytes).render(task)


@contextmanager
def _bars(console: Console, bars: list[tuple[str, bool]]) -> Iterator[list[Callable[[int, int], None]]]:
    """A bar for each ``(what, records)`` of ``bars`` in one display (of several, each shown from
    its first update); the ``progress(done, total)`` callback of each."""
    columns = (TextColumn("{task.description}"), BarColumn(), _Count(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks = [bar.add_task(what, total=None, visible=len(bars) == 1, records=records) for what, records in bars]
        yield [lambda done, total, task=task: bar.update(task, completed=done, total=total, visible=True)
               for task in tasks]
