"""The mirror group's link: the appliances of one DP group, talking over ``torch.distributed``'s gloo.

The nodes of a group rendezvous once (``MirrorGroupSpec.rendezvous``: ``tcp://HOST:PORT``,
rank 0 hosting the store, or ``file:///PATH`` on a shared file system) and then exchange
byte strings pairwise: gloo's ``send``/``recv`` over TCP, the engine PyTorch itself uses,
so gradtap writes no transport. Every message is a length (``int64[1]``) followed by its
bytes, each pair of nodes in lockstep, so an exchange is one round in which every node
sends one message to every peer (maybe empty) and receives one from each.

**The digest key.** Right after the rendezvous, rank 0 draws a random secret and sends it to
every peer; each node expands it into the key of its block digests (``merger/digest.py``),
so a digest is keyed afresh for every group run, and the key crosses only this link.

**Never a hang.** Every wait has the group's ``timeout``. A peer whose process died closes
its TCP connections and gloo fails the wait at once; one that hangs fails it at the
timeout. Either way the exchange raises :class:`PeerGone` naming the peers (ranks) whose
receive or send failed, with gloo's reason. A link that raised is finished: gloo's pairs
are broken, so every later exchange raises the same error without waiting.

**Who is gone.** A node whose round failed lets go of its gloo pairs, and so its live peers
see their connections to it close too: from where they stand it looks just as dead as the
node that died. So before it lets go, a node leaves a *notice* in the rendezvous store
naming the peers it lost, and a node whose round failed reads the notices of the peers it
lost (waiting up to ``NOTICE_GRACE_S`` for them, and no longer for a store whose host does
not answer): a peer with a notice is alive, and the peers its notice names are gone in its
place (followed on, so a chain of notices ends at the nodes that wrote none). A peer whose
notices lead to no silent node (it and this node, or it and another live node, lost each
other: a cut link, not a death) stays named. The notices are keyed by the run's secret, so
a store file reused from an earlier run cannot speak for this one.

torch.distributed is imported here and in the modules that use this one, never by the
command line's ``--help``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gradtap.core.errors import GradtapError
from gradtap.merger.digest import SECRET_BYTES, DigestKey, digest_key, new_secret
from gradtap.workload.spec import MirrorGroupSpec

SIZE_TAG, DATA_TAG = 1, 2
NOTICE_GRACE_S = 1.0      # how long a failed round waits for its lost peers' notices
NOTICE_POLL_S = 0.02
NOTICE_SLACK_S = 0.5      # past the grace, a store that has not answered is given up on


class GroupBroken(GradtapError):
    """The mirror group cannot go on: ``peers`` maps each peer's rank to what went wrong with
    it, ``during`` names the round."""

    verb = "cannot go on with"

    def __init__(self, peers: dict[int, str], during: str):
        self.peers, self.during = dict(peers), during
        names = ", ".join(f"rank {p} ({why})" for p, why in sorted(peers.items()))
        super().__init__(f"mirror group {self.verb} {names} during {during}")


class PeerGone(GroupBroken):
    """Peers of the mirror group did not answer within the timeout, or their connection closed."""

    verb = "lost"


class GroupLink:
    """Pairwise byte messages between the nodes of one mirror group (see the module docstring)."""

    def __init__(self, cfg: MirrorGroupSpec):
        self.cfg = cfg
        self.rank, self.world = cfg.rank, cfg.world_size
        self.timeout = datetime.timedelta(seconds=cfg.timeout_s)
        self.sent_bytes = 0           # payload bytes sent to peers, lengths included
        self.received_bytes = 0
        self.sent_by_kind: dict[str, int] = {}     # sent_bytes by what the rounds carried
        self._gone: PeerGone | None = None
        self._pg = self._store = None
        self._notice_prefix: str | None = None      # set once the run's secret is agreed
        if self.world > 1:
            self._pg = self._connect()
        secret = self._agree_secret()
        self._notice_prefix = f"gradtap/{hashlib.sha256(secret).hexdigest()[:16]}/left/"
        self.digest_key: DigestKey = digest_key(secret)

    def _agree_secret(self) -> bytes:
        """Rank 0's fresh secret, sent to every peer (see the module docstring)."""
        if self.rank == 0:
            secret = new_secret()
            self.exchange({p: secret for p in self.peers}, "the digest key (rendezvous)")
            return secret
        got = self.exchange({}, "the digest key (rendezvous)", peers=[0])[0]
        if len(got) != SECRET_BYTES:
            self._fail({0: f"sent a digest key of {len(got)} bytes, not {SECRET_BYTES}"},
                       f"the digest key (rendezvous, rank {self.rank})")
        return got

    def _connect(self):
        cfg = self.cfg
        url = urlparse(cfg.rendezvous)
        host = url.hostname if url.scheme == "tcp" and url.hostname in ("127.0.0.1", "localhost") else ""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        if cfg.interface:
            device = dist.ProcessGroupGloo.create_device(interface=cfg.interface)
        elif host:
            device = dist.ProcessGroupGloo.create_device(hostname=host)
        else:
            device = dist.ProcessGroupGloo.create_default_device()
        options._devices = [device]
        try:
            if url.scheme == "tcp":
                store = dist.TCPStore(url.hostname, url.port, cfg.world_size, cfg.rank == 0, timeout=self.timeout,
                                      wait_for_workers=False)
            else:
                store = dist.FileStore(str(Path(url.path)), cfg.world_size)
                store.set_timeout(self.timeout)
            self._store = store
            return dist.ProcessGroupGloo(store, cfg.rank, cfg.world_size, options)
        except RuntimeError as exc:
            raise PeerGone({p: _first_line(exc) for p in range(cfg.world_size) if p != cfg.rank},
                           f"rendezvous at {cfg.rendezvous} (rank {cfg.rank})") from exc

    @property
    def peers(self) -> list[int]:
        return [p for p in range(self.world) if p != self.rank]

    def exchange(self, messages: dict[int, bytes], during: str, peers: list[int] | None = None, *,
                 kind: str = "protocol") -> dict[int, bytes]:
        """Send ``messages[p]`` (absent: empty) to every peer p of ``peers`` (default: all) and
        return what each sent this node in the same round; both ends of a pair must name each
        other. ``during`` names the round in a :class:`PeerGone`; ``kind`` is what the round
        carries, for :attr:`sent_by_kind` (the merger's fetched blocks are ``"blocks"``)."""
        if self._gone is not None:
            raise self._gone
        if self._pg is None:
            return {}
        peers = self.peers if peers is None else peers
        sizes = {p: torch.tensor([len(messages.get(p, b""))], dtype=torch.int64) for p in peers}
        theirs = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
        self._round(sizes, theirs, SIZE_TAG, during)
        out = {p: torch.frombuffer(bytearray(messages[p]), dtype=torch.uint8) for p in peers if messages.get(p)}
        into = {p: torch.empty(int(theirs[p].item()), dtype=torch.uint8) for p in peers
                if int(theirs[p].item()) > 0}
        self._round(out, into, DATA_TAG, during)
        sent = sum(8 + len(messages.get(p, b"")) for p in peers)
        self.sent_bytes += sent
        self.sent_by_kind[kind] = self.sent_by_kind.get(kind, 0) + sent
        self.received_bytes += sum(8 + t.numel() for t in into.values())
        return {p: into[p].numpy().tobytes() if p in into else b"" for p in peers}

    def all_gather(self, message: bytes, during: str) -> list[bytes]:
        """Every node's ``message``, by rank (this node's own included)."""
        got = self.exchange({p: message for p in self.peers}, during)
        return [message if p == self.rank else got[p] for p in range(self.world)]

    def _round(self, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor], tag: int, during: str) -> None:
        """Post every send and receive, then wait for each; the peers whose work failed are gone."""
        failed: dict[int, str] = {}
        works = []
        for post, tensors in ((self._pg.recv, recv), (self._pg.send, send)):
            for p, t in tensors.items():
                if p in failed:
                    continue
                try:
                    works.append((p, post([t], p, tag)))
                except RuntimeError as exc:       # a broken pair refuses new work at once
                    failed[p] = _first_line(exc)
        for p, work in works:
            if p in failed:
                continue
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                failed[p] = _first_line(exc)
        if failed:
            self._fail(failed, f"{during} (rank {self.rank})")

    def _fail(self, failed: dict[int, str], during: str) -> NoReturn:
        """The link is broken: leave the notice, let go of the pairs, and raise
        :class:`PeerGone` naming the peers truly gone (see the module docstring)."""
        _within_grace(lambda: self._leave_notice(failed), None)
        self._release(abort=True)
        self._gone = PeerGone(_within_grace(lambda: self._truly_gone(failed), failed), during)
        raise self._gone

    def _leave_notice(self, failed: dict[int, str]) -> None:
        if self._store is None or self._notice_prefix is None:
            return
        try:
            self._store.set(self._notice_prefix + str(self.rank), json.dumps({str(p): w for p, w in failed.items()}))
        except RuntimeError:
            pass          # the store went with its host: the peers will name this node gone

    def _truly_gone(self, failed: dict[int, str]) -> dict[int, str]:
        """``failed`` with each peer that left a notice replaced by the silent peers its notices
        lead to; a peer whose notices lead to none (only to live nodes: a cut, not a death)
        stays named."""
        if self._store is None or self._notice_prefix is None:
            return failed
        deadline = time.monotonic() + NOTICE_GRACE_S
        notices: dict[int, dict[int, str] | None] = {}
        gone: dict[int, str] = {}
        for peer, why in failed.items():
            silent: dict[int, str] = {}
            seen, todo = {self.rank}, [(peer, why)]
            while todo:
                p, reason = todo.pop()
                if p in seen:
                    continue
                seen.add(p)
                if p not in notices:
                    notices[p] = self._notice(p, deadline)
                if notices[p] is None:
                    silent[p] = reason
                else:
                    todo.extend((q, f"{w} (seen by rank {p}, which left)") for q, w in notices[p].items())
            gone.update(silent or {peer: why})
        return gone

    def _notice(self, peer: int, deadline: float) -> dict[int, str] | None:
        """Peer ``peer``'s notice, waited for until ``deadline``; None if it left none."""
        key = self._notice_prefix + str(peer)
        try:
            while not self._store.check([key]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(NOTICE_POLL_S)
            return {int(p): str(w) for p, w in json.loads(self._store.get(key)).items()}
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return None   # no store any more, or a notice that is not ours to read

    def close(self) -> None:
        """Let go of the gloo pairs (after a failure, or at the end)."""
        self._release(abort=self._gone is not None)

    def _release(self, abort: bool) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                if abort:
                    pg.abort()
                else:
                    pg.shutdown()
            except RuntimeError:
                pass      # the group is gone already; nothing is left to release


def _within_grace(work, fallback):
    """``work()``, or ``fallback`` when it has not returned within the notices' grace. The
    store's host may be the node that hung, and a read from a stopped TCP store host waits
    past any timeout the store is given; the thread left waiting is a daemon."""
    result = [fallback]

    def run() -> None:
        result[0] = work()

    thread = threading.Thread(target=run, name="gradtap-group-notice", daemon=True)
    thread.start()
    thread.join(NOTICE_GRACE_S + NOTICE_SLACK_S)
    return result[0]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
