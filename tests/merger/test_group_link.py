"""The group's link: byte messages between node processes, and a silent or dead peer named
within the timeout, never waited on for ever."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import pytest

TIMEOUT_S = 3.0


def peer(rank, world, rendezvous, silent, out):
    from gradtap.merger.group_link import GroupLink, PeerGone
    from gradtap.workload.spec import MirrorGroupSpec

    link = GroupLink(MirrorGroupSpec(rank=rank, world_size=world, rendezvous=rendezvous, timeout_s=TIMEOUT_S))
    got = link.exchange({p: f"{rank}->{p}".encode() * (p + 1) for p in link.peers}, "round 1")
    out.put(("round 1", rank, got))
    if rank == silent:
        out.close()
        out.join_thread()                          # what it put is through before it stops
        os.kill(os.getpid(), signal.SIGSTOP)      # hangs: alive, connections open, never answers
    began = time.monotonic()
    try:
        link.all_gather(b"x", "round 2")
    except PeerGone as exc:
        out.put(("gone", rank, (sorted(exc.peers), str(exc), time.monotonic() - began)))
        try:
            link.all_gather(b"x", "round 3")
        except PeerGone as again:
            out.put(("again", rank, str(again) == str(exc)))


def test_messages_arrive_and_a_hung_peer_is_named_at_the_timeout(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(r, 3, f"file://{tmp_path / 'rdv'}", 2, out), daemon=True)
             for r in range(3)]
    try:
        for p in procs:
            p.start()
        seen = {}
        while len(seen) < 3 + 2 + 2:
            try:
                kind, rank, value = out.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"nodes hung: heard only {sorted(seen)}")
            seen[(kind, rank)] = value
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    for r in range(3):
        assert seen[("round 1", r)] == {p: f"{p}->{r}".encode() * (r + 1) for p in range(3) if p != r}
    for r in (0, 1):
        peers, text, waited = seen[("gone", r)]
        assert peers == [2] and "rank 2" in text and "round 2" in text
        assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S * 4, waited
        assert seen[("again", r)]          # a broken link refuses at once, with the same reason
