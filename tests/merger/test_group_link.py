"""The group's link: byte messages between node processes, and a silent or dead peer named
within the timeout, never waited on for ever."""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest

from tests.forked import fork_server

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


def hear_peers(rendezvous: str, silent: int) -> dict:
    """Run :func:`peer` in 3 processes, rank ``silent`` hanging after round 1; every message
    they put, by ``(kind, rank)``: 3 of round 1, and from each survivor "gone" and "again"."""
    ctx = fork_server()
    out = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(r, 3, rendezvous, silent, out), daemon=True) for r in range(3)]
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
    return seen


def test_messages_arrive_and_a_hung_peer_is_named_at_the_timeout(tmp_path):
    seen = hear_peers(f"file://{tmp_path / 'rdv'}", 2)
    for r in range(3):
        assert seen[("round 1", r)] == {p: f"{p}->{r}".encode() * (r + 1) for p in range(3) if p != r}
    for r in (0, 1):
        peers, text, waited = seen[("gone", r)]
        assert peers == [2] and "rank 2" in text and "round 2" in text
        assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S * 4, waited
        assert seen[("again", r)]          # a broken link refuses at once, with the same reason


def leaver(rank, rendezvous, out):
    """Rank 2 dies after round 1; rank 0 then finds it gone in a round of their own and lets go
    of its pairs; rank 1, which only ever meets rank 0 afterwards, sees rank 0's connection
    closed, yet must name rank 2, the node truly gone."""
    from gradtap.merger.group_link import GroupLink, PeerGone
    from gradtap.workload.spec import MirrorGroupSpec

    link = GroupLink(MirrorGroupSpec(rank=rank, world_size=3, rendezvous=rendezvous, timeout_s=TIMEOUT_S))
    link.all_gather(b"x", "round 1")
    if rank == 2:
        os._exit(3)
    if rank == 1:
        time.sleep(1.0)             # rank 0 has let go of its pairs by now
    try:
        link.exchange({}, "round 2", peers=[2] if rank == 0 else [0])
    except PeerGone as exc:
        out.put((rank, {p: why for p, why in exc.peers.items()}))


def test_a_peer_that_left_alive_is_not_named_gone(tmp_path):
    ctx = fork_server()
    out = ctx.Queue()
    procs = [ctx.Process(target=leaver, args=(r, f"file://{tmp_path / 'rdv'}", out), daemon=True) for r in range(3)]
    try:
        for p in procs:
            p.start()
        seen = dict(out.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.kill()
            p.join(5)
    assert sorted(seen[0]) == [2]
    assert sorted(seen[1]) == [2] and "seen by rank 0, which left" in seen[1][2], seen[1]


@pytest.mark.parametrize("notices, failed, gone", [
    ({}, [1, 2], [1, 2]),                         # nobody left a notice: all are gone
    ({1: [2]}, [1, 2], [2]),                       # 1 left because 2 died
    ({1: [0, 2]}, [1], [2]),                       # 1 named this node too: only 2 is gone
    ({1: [3], 3: [2]}, [1], [2]),                  # a chain of notices ends at the silent node
    ({1: [0]}, [1], [1]),                          # 1 and this node lost each other: 1 stays named
    ({1: [2], 2: [1]}, [1], [1]),                  # 1 and 2 lost each other: 1 stays named
    ({1: [0]}, [1, 2], [1, 2]),                    # a cut to 1 and a death of 2: both named
], ids=["none", "left-for-another", "named-me-too", "chain", "mutual", "mutual-others", "cut-and-death"])
def test_notices_name_the_peers_truly_gone(notices, failed, gone):
    import json

    import torch.distributed as dist

    from gradtap.merger import group_link
    from gradtap.merger.group_link import GroupLink

    link = object.__new__(GroupLink)      # the attribution alone, over a real in-process store
    link.rank, link._store, link._notice_prefix = 0, dist.HashStore(), "run/left/"
    for p, lost in notices.items():
        link._store.set(f"run/left/{p}", json.dumps({str(q): f"{p} lost {q}" for q in lost}))
    grace, group_link.NOTICE_GRACE_S = group_link.NOTICE_GRACE_S, 0.05
    try:
        assert sorted(link._truly_gone({p: "closed" for p in failed})) == gone
    finally:
        group_link.NOTICE_GRACE_S = grace


def test_a_hung_store_host_is_named_at_the_timeout():
    """Rank 0 hosts the TCP rendezvous store and hangs: the survivors still name it within the
    timeout, their reads of the store for notices bounded too."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = hear_peers(f"tcp://127.0.0.1:{port}", 0)
    for r in (1, 2):
        peers, text, waited = seen[("gone", r)]
        assert peers == [0] and "rank 0" in text, text
        assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S * 4, waited
