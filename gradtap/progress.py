"""Progress bars on a console while a stage works, each handing the stage the callback it takes.

They vanish when done (``transient``) and are not drawn on a console that is not a terminal.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
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


def records_progress(console: Console, what: str) -> AbstractContextManager[Callable[[int, int], None]]:
    """For a replay of the gradient log (``rebuild(progress=...)``): records applied of the total,
    as a context giving the ``progress(done, total)`` callback."""
    return _one_bar(console, what, MofNCompleteColumn())


def bytes_progress(console: Console, what: str) -> AbstractContextManager[Callable[[int, int], None]]:
    """For a checkpoint's load (``load_checkpoint(progress=...)``): bytes read of the total, as
    a context giving the ``progress(done, total)`` callback."""
    return _one_bar(console, what, DownloadColumn())


@contextmanager
def _one_bar(console: Console, what: str, count: ProgressColumn) -> Iterator[Callable[[int, int], None]]:
    """One bar named ``what`` whose total the callback tells with each update, counted by ``count``."""
    columns = (TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
