"""A gloo process group for a test's ranks, left by all of them together.

``dist.destroy_process_group()`` in one rank while another still works (rank 0 describing or
saving after the last collective, the others already done) can make a rank's gloo threads
abort the process ("terminate called without an active exception", SIGABRT), which a fast
host showed in every multi-process test that ended that way. So the ranks meet at a barrier
before they leave; on an exception they leave at once (a barrier could wait for a peer that
is gone).

A spawned rank that has done its work and left its group ends with :func:`end_spawned_rank`:
even then the interpreter's finalization aborted one FSDP2 rank in four on that host (the
same message, from the main thread with no Python frame left), after every result was
written. Skipping finalization keeps that teardown out of the result; any failure before it
still raises, and torch's spawn reports it.
"""

from __future__ import annotations

from collections.abc import Iterator
import os
import sys
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def gloo_group(**init) -> Iterator[None]:
    """``dist.init_process_group("gloo", **init)`` for the body, then barrier and destroy."""
    dist.init_process_group("gloo", **init)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def end_spawned_rank() -> None:
    """The last call of a spawned rank's function, after its outputs are written and closed:
    flush stdio, then exit 0 without the interpreter's finalization (see the module
    docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
