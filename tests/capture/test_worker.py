"""CaptureWorker: a spawned process per source feeds the ring this process reads -- from a
file, and live from af_packet and af_xdp inside a namespace; it reports its open error,
stops on the flag and on SIGTERM with the XDP program detached and its counters final, and
a killed worker is reported, never waited on forever. The CPU time it publishes agrees with
the kernel's account of its process."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import pytest

from gradtap.capture.pcap import read_pcap
from gradtap.capture.ring import FrameRing
from gradtap.capture.worker import CaptureWorker, SourceSpec, StopFlag
from gradtap.core.errors import CaptureError, ConfigError
from tests.capture.netlab import frame, veth_lab
from tests.golden import CAPTURES as GOLDEN_CAPTURES

pytestmark = pytest.mark.timeout(120)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for namespaces and raw sockets")

CAPTURE = GOLDEN_CAPTURES / "iter_40000_p2p_iter10_3.pcapng"


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid``, its threads included: fields 14 and 15
    of ``/proc/PID/stat``, in clock ticks (proc(5))."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()      # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drain(ring: FrameRing, count: int, seconds: float = 20) -> list[bytes]:
    out, deadline = [], time.monotonic() + seconds
    while len(out) < count and time.monotonic() < deadline and not ring.finished:
        batch = ring.read(256, timeout=0.2)
        out += [bytes(batch.frame(i)) for i in range(len(batch))]
    ring.release()
    return out


def test_a_file_worker_feeds_the_ring_and_finishes():
    original = read_pcap(CAPTURE)
    with FrameRing.create(64, 4352, hugepages="off") as ring:
        worker = CaptureWorker(SourceSpec("pcap", (str(CAPTURE),)), ring, cpu=0)
        assert worker.start()["pid"] == worker.pid != os.getpid()
        with open(f"/proc/{worker.pid}/status") as f:
            assert "Cpus_allowed_list:\t0\n" in f.read()
        got = drain(ring, len(original))
        assert got == [bytes(original.frame(i)) for i in range(len(original))]
        final = worker.stop()
        assert ring.finished and worker.exitcode == 0
        assert (final["received"], final["frames"], final["ring_drops"]) == (len(original),) * 2 + (0,)
        assert worker.stats()["received"] == len(original)       # published to the ring too
        assert 0 < worker.stats()["cpu_us"] <= final["cpu_us"]    # its CPU time, published last before the final


def test_an_unknown_source_fails_in_the_parent():
    with pytest.raises(ConfigError, match="unknown"):
        SourceSpec("netmap", ("eth0",))


def test_a_wrong_option_fails_in_the_parent():
    """An option the source lacks, a word where it takes a number, or a value it refuses: a
    ConfigError naming it, before any worker starts."""
    with pytest.raises(ConfigError, match=r"capture source af_packet: no option rx_size; it takes netns, "
                                          r"block_size, block_count, block_timeout_ms"):
        SourceSpec("af_packet", ("eth0",), {"rx_size": 4096})
    with pytest.raises(ConfigError, match=r"capture source pcap: max_frames='8k' is not a number \(default 8192\)"):
        SourceSpec("pcap", ("x.pcap",), {"max_frames": "8k"})
    with pytest.raises(ConfigError, match=r"capture source af_xdp: rx_size = 100; must be a power of two >= 64"):
        SourceSpec.parse("af_xdp:eth2", rx_size=100)
    with pytest.raises(ConfigError, match=r"capture source af_packet: block_count = 1; must be >= 2"):
        SourceSpec("af_packet", ("eth0",), {"netns": None, "block_count": 1})
    assert SourceSpec("af_xdp", ("eth2",), {"chunk_size": 4096, "mode": "copy"}).options["chunk_size"] == 4096


def test_command_line_targets():
    assert SourceSpec.parse("eth2") == SourceSpec("af_xdp", ("eth2",), {"netns": None})
    assert SourceSpec.parse("af_xdp:c0@cpu0", queue=1) == \
        SourceSpec("af_xdp", ("c0",), {"netns": "cpu0", "queue": 1})
    assert SourceSpec.parse("pcap:/tmp/x.pcap") == SourceSpec("pcap", ("/tmp/x.pcap",), {})
    assert SourceSpec.parse("c0@ns", default="af_packet").source == "af_packet"
    for bad, why in (("pcap:", "needs a file"), ("af_xdp:", "not an interface"),
                     ("af_xdp:averyveryverylongname", "not an interface"), ("dpdk:eth0", "unknown")):
        with pytest.raises(ConfigError, match=why):
            SourceSpec.parse(bad)


def test_an_open_error_comes_back_from_the_worker():
    with FrameRing.create(16, 256, hugepages="off") as ring:
        worker = CaptureWorker(SourceSpec("pcap", ("/nonexistent.pcap",)), ring)
        with pytest.raises(CaptureError, match="/nonexistent.pcap: no such file"):
            worker.start()
        assert not worker.alive


def _live(lab, source: str, ring: FrameRing) -> CaptureWorker:
    worker = CaptureWorker(SourceSpec(source, ("rx0",), {"netns": lab.rx}), ring, name=f"test-{source}")
    worker.start()
    return worker


def _send(lab, frames) -> None:
    tx = lab.sender()
    for f in frames:
        tx.send(f)
    tx.close()


@pytest.mark.privileged
@needs_root
@pytest.mark.parametrize("source", ["af_packet", "af_xdp"])
def test_a_live_worker_in_a_namespace_captures_and_stops_cleanly(source):
    sent = [frame(i, 60 + 31 * i) for i in range(200)]
    with veth_lab(f"w{source[3]}") as lab, FrameRing.create(512, 8192, hugepages="off") as ring:
        worker = _live(lab, source, ring)
        _send(lab, sent)
        assert drain(ring, len(sent)) == sent
        deadline = time.monotonic() + 5
        while worker.stats()["received"] < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.stats()["received"] == len(sent)           # live, from the ring header
        kernel = process_cpu_s(worker.pid)
        time.sleep(0.3)                                           # its next publication (every 0.2 s)
        published = worker.stats()["cpu_us"] / 1e6
        assert kernel - 0.02 <= published <= kernel + 0.35, (published, kernel)
        final = worker.stop()
        assert (final["received"], final["kernel_drops"], final["ring_drops"]) == (200, 0, 0)
        assert worker.exitcode == 0 and ring.finished
        assert lab.xdp_state().get("IFLA_XDP_PROG_ID") is None


@pytest.mark.privileged
@needs_root
def test_sigterm_stops_a_worker_cleanly_and_a_killed_one_is_reported():
    with veth_lab("ws") as lab:
        with FrameRing.create(64, 2048, hugepages="off") as ring:
            worker = _live(lab, "af_xdp", ring)
            assert lab.xdp_state().get("IFLA_XDP_PROG_ID") is not None
            os.kill(worker.pid, signal.SIGTERM)
            final = worker.stop()
            assert worker.exitcode == 0 and "received" in final
            assert lab.xdp_state().get("IFLA_XDP_PROG_ID") is None
        with FrameRing.create(64, 2048, hugepages="off") as ring:
            worker = _live(lab, "af_packet", ring)
            os.kill(worker.pid, signal.SIGKILL)
            t = time.monotonic()
            with pytest.raises(CaptureError, match="exited with code -9 without reporting"):
                worker.stop(timeout=5)
            assert time.monotonic() - t < 10


def _poll_until_set(flag, polling) -> None:
    polling.value = 1
    while not flag.is_set():
        pass


def test_a_worker_killed_at_any_moment_leaves_its_stop_flag_settable():
    """A worker polls its stop flag between receives; killed at any moment, even while it reads
    the flag, it leaves the parent's ``set()`` immediate (a ``multiprocessing.Event``, read under
    a lock, left it blocked for good in most of these kills: the appliance then hung)."""
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random(12)
    for _ in range(5):
        flag, polling = StopFlag(ctx), ctx.RawValue("b", 0)
        proc = ctx.Process(target=_poll_until_set, args=(flag, polling), daemon=True)
        proc.start()
        deadline = time.monotonic() + 60
        while not polling.value and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert polling.value, "the worker never started polling"
        time.sleep(rng.uniform(0.001, 0.02))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        setter = threading.Thread(target=flag.set, daemon=True)
        setter.start()
        setter.join(5)
        assert not setter.is_alive(), "set() blocked on a lock the killed worker held"
        assert flag.is_set()
