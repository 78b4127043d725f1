"""Warm processes for the tests that start gradtap or torch processes: the kill trials, the
mirror groups' nodes, the gradtap commands that import torch, and gloo ranks.

Such a test forks each process from a ``multiprocessing`` fork server that has imported torch,
gradtap and the tests' own modules once, instead of starting an interpreter for it: the
imports took 3-4 s of every life on a 2-core Xeon, and 7-8 s of CPU on the 2-core AMD EPYC
(torch alone 3.5 s), and a forked process starts its own work at once. A spawned node of
``tests/merger/test_group.py`` did little else: that file took 109 s with spawned nodes and
28 s with forked ones. What is forked is still a process of its own, with its own memory,
threads and file descriptors, so a kill leaves on disk what it would leave of a fresh
interpreter. The fork server has run no kernel and joined no process group, so each child
starts its own Numba and OpenMP threads and its own gloo links.

Python has one fork server per process, started at its first use with the modules named
then (``set_forkserver_preload``), so every test takes its context from :func:`fork_server`.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from pathlib import Path

# What the children import: the fork server imports it once, before any child.
PRELOAD = ["torch", "torch._dynamo", "torch._decomp", "torch._meta_registrations", "torch.distributed", "s3fs",
           "gradtap.cli", "gradtap.commands.replay", "gradtap.replay", "gradtap.store_tier", "gradtap.store.snapshot",
           "gradtap.store.snapshot_writer", "gradtap.store.object_store", "gradtap.store.uploader",
           "gradtap.updater.replica", "gradtap.merger.group", "gradtap.group", "tests.forked",
           "tests.merger.test_group", "tests.merger.test_group_link", "tests.gradtap.test_group_replay",
           "tests.updater.test_replica", "tests.store.test_snapshot_writer", "tests.gradtap.test_store_crash"]
PIPE = subprocess.PIPE
CLI = "from gradtap.cli import main; main()"     # what the console script runs


def fork_server() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_ranks(fn, args: tuple, nprocs: int):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join=False)`` with the ranks
    forked from the fork server: a test's gloo job, each rank ``fn(rank, *args)``. Its
    ``ProcessContext`` is returned; ``join`` it."""
    import torch.multiprocessing

    fork_server()           # the server starts with its preloads, if this is its first use
    return torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")


def _run(code: str, args: list[str], cwd: str, env: dict[str, str], pipe, out: str | None,
         err: str | None) -> None:
    """The child: ``python -c CODE ARGS...`` in this forked process, in environment ``env``."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if pipe is not None:
        os.dup2(pipe.fileno(), 1)
        pipe.close()
    for fd, path in ((1, out), (2, err)):
        if path is not None:
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    sys.argv = ["-c", *args]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


class Child:
    """``python -c CODE ARGS...`` as a process of the fork server, with the part of
    ``subprocess.Popen`` the kill trials use; as a context manager, it is killed on leaving
    if it still runs.

    ``stdout``: :data:`PIPE` (read it from :attr:`stdout`, as text), a file to append to, or
    None (the fork server's); ``stderr``: a file to append to, or None. Its environment is
    this process's (as a subprocess's would be, not the fork server's) with ``env`` added, and
    ``cwd`` is where it runs (the repository's root by default). What Numba reads at import
    (``NUMBA_*``) is the fork server's: a test that varies it needs an interpreter of its own.

    It is a daemon: at exit ``multiprocessing`` would wait for any other child, and a trial's
    child runs until it is killed. So it cannot start processes of its own.
    """

    def __init__(self, code: str, *args: str, stdout=PIPE, stderr: Path | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        ctx = fork_server()
        read = write = None
        if stdout is PIPE:
            read, write = ctx.Pipe(duplex=False)
        environment = {**os.environ, **(env or {})}
        self._proc = ctx.Process(target=_run, args=(code, list(args), str(cwd or Path(__file__).parents[1]),
                                                    environment, write, None if stdout is PIPE or stdout is None
                                                    else str(stdout), None if stderr is None else str(stderr)),
                                 daemon=True)
        self._proc.start()
        self.stdout = None
        if read is not None:
            write.close()
            self.stdout = os.fdopen(os.dup(read.fileno()), "r")
            read.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
        return self._proc.exitcode

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
        self._proc.join(60)
        if self.stdout is not None:
            self.stdout.close()
        self._proc.close()


def run_clis(commands: Iterable[Sequence[str]], cwd: Path | None = None, env: dict[str, str] | None = None,
             timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Several ``gradtap ARGS...`` at once (a mirror group's nodes), each in a :class:`Child`, as
    ``subprocess.run(..., capture_output=True, text=True)`` would run the console script: the
    exit code, stdout and stderr of each; all within ``timeout`` seconds, else every one still
    running is killed and ``subprocess.TimeoutExpired`` raised.

    For the commands that import torch (``simulate``, ``replay``, ``export``), whose start-up
    in a fresh interpreter took 7-8 s of CPU on the 2-core AMD EPYC and did the test no good.
    ``gradtap run`` starts capture processes of its own, so it needs an interpreter."""
    commands = [tuple(args) for args in commands]
    with tempfile.TemporaryDirectory(prefix="gradtap-cli-") as tmp, ExitStack() as running:
        files = [(Path(tmp, f"{i}.out"), Path(tmp, f"{i}.err")) for i in range(len(commands))]
        children = [running.enter_context(Child(CLI, *args, stdout=out, stderr=err, env=env, cwd=cwd))
                    for args, (out, err) in zip(commands, files)]
        deadline = time.monotonic() + timeout
        codes = [child.wait(max(0.0, deadline - time.monotonic())) for child in children]
        return [subprocess.CompletedProcess(["gradtap", *args], code, *(f.read_text() if f.exists() else ""
                                                                         for f in (out, err)))
                for args, code, (out, err) in zip(commands, codes, files)]


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``gradtap ARGS...`` alone, as :func:`run_clis` runs each."""
    return run_clis([args], cwd=cwd, env=env, timeout=timeout)[0]
