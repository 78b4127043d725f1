"""Live capture over veth: highest loss-free rate and receiver CPU, per source, ICRC off and on.

The lab: two network namespaces joined by a veth pair (MTU 9000). A sender process in one
(pinned to CPU 0) replays real NCCL RoCEv2 frames of the 4 KiB class (RDMA WRITEs at MTU
4096, 3.2-4.2 KB, from ``iter_40000_p2p_iter10_3.pcapng``) through a paced TX ring
(:class:`gradtap.capture.sender.FrameSender`); in the other, a capture worker (pinned to CPU 1)
runs the source into a frame ring, and this process (also on CPU 1) consumes the ring as
the parser would -- counting frames, or, with ICRC on, running ``gradtap.parser.decode.decode_batch``
with ``verify_icrc=True`` on one thread.

For every source and rate, ``--frames`` frames are sent; a trial is loss-free when every
one of them was read from the ring. Where losses happen is shown: the source's kernel drops
(PACKET_STATISTICS / XDP_STATISTICS), ring drops, and the veth and backlog drops no socket
sees (``/proc/net/softnet_stat``, link statistics). The rates climb a ladder up to "max"
(unpaced: the sender's ceiling, which on veth includes the receive-side kernel work,
since the kernel delivers a veth frame on the sending CPU).

CPU: the capture worker's own CPU time (``/proc/PID/schedstat``), the consumer's, and the
machine's busy time (``/proc/stat``; softirq work is charged to whichever task it
interrupts, this kernel has no IRQ time accounting). Figures are core-seconds per million
frames; the target, <= 0.35 core at 0.3 Mpps, is <= 1.17 core-s per Mframes.

Baseline, in the same run: a Python ``recv_into`` loop on an AF_PACKET socket (one system
call per frame), the way the issue's 0.2 Mpps / 95 % core figure was measured.

af_xdp's UMEM chunk (``--xdp-chunk``, default auto): a chunk holds ``chunk - 256`` bytes of
frame (XDP_PACKET_HEADROOM) and is at most a page, so on a 4 KiB-page host a frame over 3840
bytes spans two chunks (two descriptors) whatever the chunk size; ``--xdp-chunk 2048`` (three
descriptors per 4.2 KB frame) against the default (two) measures what a descriptor costs.

Run as root: ``python -m benchmarks.capture [--frames N] [--rates 0.1,0.2,...] [--hugepages N]
[--xdp-chunk auto|2048|4096]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numba
from pyroute2 import NetNS, netns

from gradtap.capture.af_packet import PACKET_STATISTICS, SOL_PACKET
from gradtap.capture.af_xdp import PAGE_SIZE, AfXdpSource, chunk_frame_bytes
from gradtap.capture.frames import FrameBatch
from gradtap.capture.pcap import read_pcap
from gradtap.capture.ring import FrameRing
from gradtap.capture.sender import FrameSender
from gradtap.capture.shared_memory import hugepage_pool
from gradtap.capture.source import in_netns
from gradtap.capture.worker import CaptureWorker, SourceSpec
from gradtap.parser.decode import decode_batch

CAPTURE = Path(__file__).resolve().parents[2] / "shared" / "captures" / "iter_40000_p2p_iter10_3.pcapng"
TX_CPU, RX_CPU = 0, 1
MTU = 9000
SOURCES = ("af_packet", "af_xdp", "recv_loop")
TARGET_CORE_S_PER_MFRAME = 0.35 / 0.3
IDLE_END_S = 1.0              # a trial ends this long after the last frame came in
SO_RCVBUFFORCE = 33


# -- the lab -----------------------------------------------------------------------------

class Lab:
    """Two namespaces joined by ``pairs`` veth pairs (``tx0``-``rx0``, ``tx1``-``rx1``, ...) of
    MTU 9000, IPv6 off (no stray neighbour discovery on the ports); removed on exit, with
    those of a killed run."""

    def __init__(self, pairs: int = 1):
        self.tx, self.rx = f"gtbench{os.getpid()}-tx", f"gtbench{os.getpid()}-rx"
        self.pairs = pairs

    def __enter__(self):
        for name in netns.listnetns():        # left by a benchmark that was killed
            match = re.match(r"gtbench(\d+)-", name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                netns.remove(name)
        for name in (self.tx, self.rx):
            netns.create(name)
            with in_netns(name):
                for conf in ("all", "default"):
                    with open(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "w") as f:
                        f.write("1")
        for k in range(self.pairs):
            with NetNS(self.tx) as ns:
                ns.link("add", ifname=f"tx{k}", kind="veth", peer={"ifname": f"rx{k}", "net_ns_fd": self.rx})
                ns.link("set", index=ns.link_lookup(ifname=f"tx{k}")[0], mtu=MTU, state="up")
            with NetNS(self.rx) as ns:
                ns.link("set", index=ns.link_lookup(ifname=f"rx{k}")[0], mtu=MTU, state="up")
        return self

    def __exit__(self, *exc):
        for name in (self.tx, self.rx):
            if name in netns.listnetns():
                netns.remove(name)

    def link_drops(self) -> int:
        """Drops the veth pairs counted on either end (txK tx_dropped, rxK rx_dropped)."""
        total = 0
        for k in range(self.pairs):
            for ns_name, ifname, key in ((self.tx, f"tx{k}", "tx_dropped"), (self.rx, f"rx{k}", "rx_dropped")):
                with NetNS(ns_name) as ns:
                    link = ns.get_links(ns.link_lookup(ifname=ifname)[0])[0]
                    total += link.get_attr("IFLA_STATS64")[key]
        return total


def softnet_drops() -> int:
    """Frames dropped because a CPU's input backlog was full (all CPUs)."""
    with open("/proc/net/softnet_stat") as f:
        return sum(int(line.split()[1], 16) for line in f)


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def task_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


# -- the sender process ------------------------------------------------------------------

def _sender_main(ns: str, conn) -> None:
    os.sched_setaffinity(0, {TX_CPU})
    source = read_pcap(CAPTURE)
    big = [bytes(source.frame(i)) for i in range(len(source)) if source.caplens[i] >= 3000]
    tile = FrameBatch.from_frames(big * (4096 // len(big) + 1))
    with FrameSender("tx0", netns=ns, slots=256) as sender:
        conn.send(("ready", tile.nbytes / len(tile)))
        while True:
            command = conn.recv()
            if command is None:
                return
            frames, rate = command
            before, cpu = sender.sent, time.process_time()
            seconds = sender.send(tile, rate=rate, burst=32, repeat=-(-frames // len(tile)))
            conn.send((sender.sent - before, seconds, time.process_time() - cpu))


# -- the baseline receiver ---------------------------------------------------------------

def _recv_loop_main(ns: str, count, drops, stop, ready) -> None:
    """One recv_into per frame, counting (no ring): the simplest live capture there is. Its
    socket buffer is as large as af_packet's default ring (32 MiB), so both can absorb the
    same stall."""
    os.sched_setaffinity(0, {RX_CPU})
    with in_netns(ns):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
    sock.bind(("rx0", 0x0003))
    sock.settimeout(0.05)
    buf = bytearray(16384)
    ready.set()
    n = 0
    while not stop.is_set():
        try:
            sock.recv_into(buf)
            n += 1
            count.value = n
        except TimeoutError:
            continue
    drops.value = struct.unpack("2I", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))[1]


# -- one trial ---------------------------------------------------------------------------

@dataclass
class Trial:
    source: str
    icrc: bool
    rate: float | None        # requested frames/s (None: unpaced)
    sent: int
    read: int
    send_s: float
    worker_cpu_s: float
    consumer_cpu_s: float
    machine_cpu_s: float
    sender_cpu_s: float
    kernel_drops: int
    ring_drops: int
    backlog_drops: int        # /proc/net/softnet_stat: a CPU's input queue was full
    link_drops: int           # veth statistics (they include failed XDP redirects)
    fragments: int = 0        # af_xdp: RX descriptors taken (one per UMEM chunk a frame spans)

    @property
    def lossless(self) -> bool:
        return self.read == self.sent

    @property
    def mpps(self) -> float:
        return self.sent / self.send_s / 1e6

    def per_mframe(self, cpu_s: float) -> float:
        return cpu_s / (self.sent / 1e6)


class Bench:
    def __init__(self, lab: Lab, frames: int, hugepages: str, xdp_chunk: int | str = "auto"):
        self.lab, self.frames, self.hugepages, self.xdp_chunk = lab, frames, hugepages, xdp_chunk
        ctx = multiprocessing.get_context("spawn")
        self.ctx = ctx
        self.conn, child = ctx.Pipe()
        self.sender = ctx.Process(target=_sender_main, args=(lab.tx, child), daemon=True)
        self.sender.start()
        _, self.frame_bytes = self.conn.recv()
        os.sched_setaffinity(0, {RX_CPU})
        numba.set_num_threads(1)

    def close(self) -> None:
        self.conn.send(None)
        self.sender.join(10)

    def trial(self, source: str, rate: float | None, icrc: bool) -> Trial:
        if source == "recv_loop":
            return self._recv_loop(rate)
        ring = FrameRing.create(32768, 4352, hugepages=self.hugepages, name=f"bench-{source}")
        options = {"netns": self.lab.rx}
        if source == "af_xdp":
            options["chunk_size"] = self.xdp_chunk
        worker = CaptureWorker(SourceSpec(source, ("rx0",), options), ring, cpu=RX_CPU)
        worker.start()
        try:
            before = self._counters(worker.pid)
            self.conn.send((self.frames, rate))
            read, last = 0, time.monotonic()
            while True:
                batch = ring.read(4096, timeout=0.05)
                if len(batch):
                    if icrc:
                        decode_batch(batch, verify_icrc=True)
                    read += len(batch)
                    last = time.monotonic()
                elif self.conn.poll() and time.monotonic() - last > IDLE_END_S:
                    break
            sent, send_s, sender_cpu = self.conn.recv()
            after = self._counters(worker.pid)
            ring.release()
        finally:
            final = worker.stop()
            ring.close()
        cpu, drops = self._deltas(after, before)[:3], self._deltas(after, before)[3:]
        return Trial(source, icrc, rate, sent, read, send_s, *cpu, sender_cpu, final["kernel_drops"],
                     final["ring_drops"], *drops, final.get("fragments", 0))

    def _counters(self, pid: int) -> tuple[float, float, float, int, int]:
        return task_cpu_s(pid), time.process_time(), machine_busy_s(), softnet_drops(), self.lab.link_drops()

    @staticmethod
    def _deltas(after, before) -> list:
        return [a - b for a, b in zip(after, before)]

    def _recv_loop(self, rate: float | None) -> Trial:
        count, socket_drops = self.ctx.Value("q", 0, lock=False), self.ctx.Value("q", 0, lock=False)
        stop, ready = self.ctx.Event(), self.ctx.Event()
        proc = self.ctx.Process(target=_recv_loop_main, args=(self.lab.rx, count, socket_drops, stop, ready),
                                daemon=True)
        proc.start()
        ready.wait(30)
        try:
            before = self._counters(proc.pid)
            self.conn.send((self.frames, rate))
            sent, send_s, sender_cpu = self.conn.recv()
            last, seen = time.monotonic(), count.value
            while time.monotonic() - last < IDLE_END_S / 2:
                time.sleep(0.05)
                if count.value != seen:
                    last, seen = time.monotonic(), count.value
            after = self._counters(proc.pid)
        finally:
            stop.set()
            proc.join(10)
        cpu, drops = self._deltas(after, before)[:3], self._deltas(after, before)[3:]
        return Trial("recv_loop", False, rate, sent, count.value, send_s, *cpu, sender_cpu, socket_drops.value, 0,
                     *drops)


# -- report ------------------------------------------------------------------------------

def describe(t: Trial) -> str:
    rate = "max" if t.rate is None else f"{t.rate / 1e6:.2f}"
    loss = "no loss" if t.lossless else (f"LOST {t.sent - t.read} (socket {t.kernel_drops}, ring {t.ring_drops}, "
                                         f"backlog {t.backlog_drops}, veth {t.link_drops})")
    return (f"  {t.source:9s} icrc {'on ' if t.icrc else 'off'} rate {rate:>4s} Mpps -> sent {t.mpps:5.3f} Mpps; "
            f"worker {t.per_mframe(t.worker_cpu_s):5.2f}  consumer {t.per_mframe(t.consumer_cpu_s):5.2f}  "
            f"machine {t.per_mframe(t.machine_cpu_s):5.2f} core-s/Mframe; {loss}"
            + (f"; {t.fragments / t.read:.2f} descriptors/frame" if t.fragments and t.read else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=150_000, help="frames per trial")
    ap.add_argument("--rates", default="0.1,0.15,0.2,0.25,0.3,0.35",
                    help="paced rates to try, Mpps (an unpaced trial always follows)")
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--xdp-chunk", default="auto",
                    help="af_xdp UMEM chunk size: auto (the smallest that holds a whole frame of MTU 4096, "
                         "at most the page size) or 2048/4096; a chunk holds chunk - 256 bytes of frame")
    ap.add_argument("--hugepages", type=int, default=0,
                    help="reserve this many huge pages for the frame rings during the run (restored after)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmarks.capture needs root (network namespaces, raw sockets, AF_XDP)")
    rates = [float(r) * 1e6 for r in args.rates.split(",")] + [None]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; sender on CPU {TX_CPU}, "
          f"capture worker and consumer on CPU {RX_CPU}; {args.frames} frames per trial")
    reserve = Reservation(args.hugepages)
    try:
        with Lab() as lab:
            xdp_chunk = args.xdp_chunk if args.xdp_chunk == "auto" else int(args.xdp_chunk)
            bench = Bench(lab, args.frames, "auto" if args.hugepages else "off", xdp_chunk)
            try:
                chunk = AfXdpSource("rx0", chunk_size=xdp_chunk)
                print(f"frames: {bench.frame_bytes:.0f} bytes on average (RoCEv2 RDMA WRITE, MTU 4096); "
                      f"frame rings on {'huge' if args.hugepages else 'normal'} pages; af_xdp chunks of "
                      f"{chunk.chunk_size} bytes hold {chunk_frame_bytes(chunk.chunk_size)}-byte frames "
                      f"(page size {PAGE_SIZE}: a chunk holds at most {chunk_frame_bytes(PAGE_SIZE)})")
                results = run(bench, args.sources.split(","), rates)
            finally:
                bench.close()
    finally:
        reserve.restore()
    summarize(results)


def run(bench: Bench, sources: list[str], rates: list[float | None]) -> list[Trial]:
    results = []
    for source in sources:
        bench.trial(source, rates[0], False)       # warm-up, not reported: first faults, caches
        for icrc in ((False,) if source == "recv_loop" else (False, True)):
            for rate in rates:
                t = bench.trial(source, rate, icrc)
                results.append(t)
                print(describe(t), flush=True)
    return results


def summarize(results: list[Trial]) -> None:
    """Per source and ICRC setting: the unpaced trial is its ceiling (the sender's veth rate
    with that receiver attached); the loss-free rate is the highest reached before the first
    trial that lost frames; CPU figures are from that trial."""
    print("\nsummary (4 KiB-class frames; core-s/Mframe = CPU seconds per million frames)")
    for source in dict.fromkeys(t.source for t in results):
        for icrc in (False, True):
            mine = [t for t in results if t.source == source and t.icrc == icrc]
            if not mine:
                continue
            ceiling = next(t for t in mine if t.rate is None)
            good = []
            for t in sorted(mine, key=lambda t: t.mpps):
                if not t.lossless:
                    break
                good.append(t)
            line = f"  {source:9s} icrc {'on ' if icrc else 'off'}: ceiling {ceiling.mpps:.3f} Mpps; "
            if not good:
                print(line + "lost frames at every rate tried")
                continue
            best = good[-1]
            cpu = best.per_mframe(best.worker_cpu_s)
            print(line + "; ".join([
                f"loss-free up to {best.mpps:.3f} Mpps" + (" (no loss up to the ceiling: met)"
                                                            if all(t.lossless for t in mine) else
                                                            " (no loss up to the ceiling: NOT met)"),
                f"receiver {cpu:.2f} core-s/Mframe = {cpu * 0.3:.2f} core at 0.3 Mpps "
                f"({'met' if cpu <= TARGET_CORE_S_PER_MFRAME else 'NOT met'}: <= 0.35)",
                f"consumer {best.per_mframe(best.consumer_cpu_s):.2f} core-s/Mframe"]))


class Reservation:
    """Grow the huge page pool by ``pages`` for the run; put the old size back after."""

    PATH = "/proc/sys/vm/nr_hugepages"

    def __init__(self, pages: int):
        with open(self.PATH) as f:
            self.before = int(f.read())
        if pages:
            with open(self.PATH, "w") as f:
                f.write(str(self.before + pages))
            print(f"huge pages: reserved {hugepage_pool()['total'] - self.before} of {pages} asked "
                  f"({hugepage_pool()['size'] >> 20} MiB each)")

    def restore(self) -> None:
        with open(self.PATH, "w") as f:
            f.write(str(self.before))


if __name__ == "__main__":
    main()
