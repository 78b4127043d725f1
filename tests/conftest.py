"""How the suite shares the machine.

``bin/test`` runs it on a pytest-xdist worker per core (at most 4) with ``--dist loadfile``:
each test file runs whole on one worker, so that a module's fixtures (a simulated job, a
capture, a replay) are made once, as in a run in one process. On one process, most of the
suite leaves the second core of a 2-core machine idle (it compiles kernels and runs Python):
on a 2-core AMD EPYC host, ``vmstat`` read 40-48% idle through a run in one process that took
33 min (1991 s), and 6.6% through one on two workers: 22-24 min (1320-1459 s over three runs
from fresh clones, the same 2513 tests passed). With the processes below forked, the same
host ran it from a fresh clone in 17.8 min (1066 s; the tests summed to 1974 s, from 2856).
``bin/test -n 0`` runs it in one process (for ``--pdb``).

Processes cost more than most tests: on that host a Python process that imports torch spends
6-8 s of CPU before it does anything. The tests that start gradtap commands, mirror-group nodes
or gloo ranks fork them from a fork server per worker that has imported those once
(``tests/forked.py``). What must be an interpreter of its own still is one: ``gradtap run``
(it starts capture processes), the trainer of ``tests/trainer``, the wheel's demo, and runs
that change what Numba or torch read at import (``NUMBA_BOUNDSCHECK``, ``NUMBA_DISABLE_JIT``,
a played host).

The privileged tests change the host itself (network namespaces, veth, tc, AF_XDP,
``vm.nr_hugepages``), and two at once would see each other's changes: a file that holds one
runs under an exclusive lock on :data:`HOST_LOCK`, from its first fixture to its last, so no
two such files run at once, from two workers or from two test runs on the same host. The wait
for it is not a test's time: pytest-timeout's 600 s start after it.
"""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

HOST_LOCK = Path(tempfile.gettempdir()) / "gradtap-tests-privileged.lock"
_PRIVILEGED_FILES = pytest.StashKey[set]()
_HELD = pytest.StashKey[IO[str]]()     # the open lock file, while a privileged file runs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_PRIVILEGED_FILES] = {item.path for item in items if item.get_closest_marker("privileged")}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Hold :data:`HOST_LOCK` from the set-up of a privileged file's first test to the
    tear-down of its last, where the file's module fixtures (its network lab) go too. Taken
    here, outside pytest-timeout's wrapper (this one runs first), so that a worker waiting for
    another worker's privileged file does not spend its first test's timeout waiting."""
    if item.path in item.config.stash.get(_PRIVILEGED_FILES, set()) and _HELD not in item.config.stash:
        lock = open(HOST_LOCK, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        item.config.stash[_HELD] = lock
    try:
        return (yield)
    finally:
        if _HELD in item.config.stash and (nextitem is None or nextitem.path != item.path):
            lock = item.config.stash[_HELD]
            del item.config.stash[_HELD]
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
