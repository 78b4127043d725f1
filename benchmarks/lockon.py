"""Lock-on: how much capture and how much parsing a stream needs before it is locked, per protocol.

For each NCCL protocol, ``configs/small.yaml`` with that protocol is simulated for
``--iterations`` iterations (QPNs as a NIC numbers them, none given to the parser), and every
mirror stream is fed to a fresh ``StreamParser`` in batches of ``--batch`` frames from the middle
of the first captured iteration on, as an appliance started on a running job sees it.
Measured in the same run:

- **capture to lock**: the capture's iteration (0: the partial first one) the stream locked at, and the frames before that boundary (counted, not used); the lock is at the
  first iteration boundary after every flow was learnt and aligned;
- **learning rate**: frames per second while not locked (flow learning and alignment, stage
  1 included), as a ratio to the locked rate (stage 1 + 2) measured on the same stream, and
  the locked rate's payload bytes as a ratio to this machine's memcpy (``benchmarks._bandwidth``).

A job told ``nccl.era: auto`` and ``nccl.protocol: auto`` (simulated with the tuner model's
choice per bucket) first has its era and protocols read from the wire (``parser/resolve.py``):
for each stream, from the same mid-iteration start, the capture's iteration the stream
decided in, the frames it watched, and the resolver's rate as a ratio to the locked rate.

Targets: every stream locks within its first 2 iterations of capture; learning runs at >= 0.25x
the locked rate (so a late start catches up); an ``auto`` job is resolved within its first 3
iterations of capture (a partial one, a whole one, and the pause that closes it). Run:
``python -m benchmarks.lockon [--iterations N] [--batch FRAMES]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._bandwidth import memcpy_bandwidth
from gradtap.capture.pcap import PcapReader, read_pcap
from gradtap.parser.decode import decode_batch
from gradtap.parser.resolve import Resolver
from gradtap.parser.stream import StreamParser
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import load_job

ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = ("Simple", "LL", "LL128")


def _from_frame(reader, skip: int):
    """The reader's batches from its frame ``skip`` on (an appliance started mid-iteration)."""
    for b in reader:
        if skip >= len(b.offsets):
            skip -= len(b.offsets)
            continue
        if skip:
            b, skip = b.tail(skip), 0
        yield b


def measure(job, path: Path, stream: str, batch: int, skip: int) -> dict:
    """One stream, from its frame ``skip`` on (an appliance started mid-iteration): where it
    locked, and the parse rate before and after (the batch that locks, which also assembles
    the frames held since the boundary, counts for neither)."""
    parser = StreamParser(job, job_plan(job), stream)
    first_index = None
    frames, ts = 0, []
    learning = [0, 0.0]              # frames, seconds
    locked = [0, 0.0, 0]             # frames, seconds, bytes
    with PcapReader(path, max_frames=batch) as reader:
        for b in _from_frame(reader, skip):
            was = parser.locked
            started = time.perf_counter()
            done = parser.feed(b)
            spent = time.perf_counter() - started
            ts.append(b.ts_ns.copy())
            frames += len(b.offsets)
            if done and first_index is None:
                first_index = done[0].index
            if was:
                locked[0] += len(b.offsets)
                locked[1] += spent
                locked[2] += int(b.caplens.sum())
            elif not parser.locked:
                learning[0] += len(b.offsets)
                learning[1] += spent
    done = parser.flush()
    if done and first_index is None:
        first_index = done[0].index
    before = int((np.concatenate(ts) < parser.lock_ts).sum()) if parser.locked else frames
    return {"locked": parser.locked, "ordinal": first_index, "before": before, "frames": frames,
            "learning_fps": learning[0] / learning[1] if learning[1] else float("nan"),
            "locked_fps": locked[0] / locked[1] if locked[1] else float("nan"),
            "locked_Bps": locked[2] / locked[1] if locked[1] else float("nan")}


def resolve_measure(job, path: Path, stream: str, batch: int, skip: int) -> dict:
    """One stream of an ``auto`` job from its frame ``skip`` on: the iteration of capture it
    decided in (counting pauses seen, the partial first one included), the frames it watched,
    and the resolver's rate."""
    resolver = Resolver(job, [stream], job.appliance.iteration_gap_ns)
    frames, spent, found = 0, 0.0, None
    with PcapReader(path, max_frames=batch) as reader:
        for b in _from_frame(reader, skip):
            started = time.perf_counter()
            recs, _ = decode_batch(b, job.appliance.verify_icrc)
            resolver.observe(stream, recs, b.data)
            found = resolver.decide()
            spent += time.perf_counter() - started
            frames += len(b.offsets)
            if found is not None:
                break
    e = resolver.evidence[stream]
    return {"found": found, "iteration": len(e.iterations()) - 1, "frames": frames,
            "fps": frames / spent if spent else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    base = load_job(ROOT / "configs" / "small.yaml")
    memcpy = memcpy_bandwidth(1)
    print(f"configs/small.yaml, {args.iterations} iterations simulated per protocol, batches of {args.batch} "
          f"frames, memcpy 1 thread {memcpy:.2f} GB/s")
    print(f"{'protocol':9} {'stream':10} {'locked at':>9} {'frames before lock':>19} {'learn kfps':>10} "
          f"{'locked kfps':>11} {'learn/locked':>12} {'locked/memcpy':>13}")
    worst_it, worst_ratio = 0, float("inf")
    with tempfile.TemporaryDirectory() as tmp:
        for protocol in PROTOCOLS:
            job = base.model_copy(update={"nccl": base.nccl.model_copy(update={"protocol": protocol})})
            out = Path(tmp) / protocol
            Simulation(job, out, iterations=args.iterations, seed=3,
                       faults=parse_faults("", tuple(m.name for m in job.mirrors))).run()
            first = job.mirrors[0].name
            measure(job, out / "streams" / f"{first}.pcap", first, args.batch, 0)        # compiled and warm
            for m in job.mirrors:
                path = out / "streams" / f"{m.name}.pcap"
                # Started in the middle of the first captured iteration.
                r = measure(job, path, m.name, args.batch, len(read_pcap(path).offsets) // (2 * args.iterations))
                ratio = r["learning_fps"] / r["locked_fps"]
                worst_ratio = min(worst_ratio, ratio)
                at = "never" if not r["locked"] else f"iter {r['ordinal']}"
                worst_it = max(worst_it, r["ordinal"] + 1 if r["locked"] else 10 ** 9)
                print(f"{protocol:9} {m.name:10} {at:>9} {r['before']:>19,} {r['learning_fps'] / 1e3:>10.1f} "
                      f"{r['locked_fps'] / 1e3:>11.1f} {ratio:>12.2f} {r['locked_Bps'] / 1e9 / memcpy:>13.3f}")
        worst_resolved = 0
        base_auto = base.model_copy(update={"nccl": base.nccl.model_copy(update={"protocol": "auto"})})
        out = Path(tmp) / "auto"
        Simulation(base_auto, out, iterations=args.iterations, seed=3,
                   faults=parse_faults("", tuple(m.name for m in base_auto.mirrors))).run()
        told = base_auto.model_copy(update={"nccl": base_auto.nccl.model_copy(update={"era": "auto"})})
        print(f"\n{'auto':9} {'stream':10} {'decided at':>10} {'frames watched':>15} {'resolve kfps':>12} "
              f"{'resolve/locked':>14}  resolution")
        for m in told.mirrors:
            path = out / "streams" / f"{m.name}.pcap"
            skip = len(read_pcap(path).offsets) // (2 * args.iterations)
            r = resolve_measure(told, path, m.name, args.batch, skip)
            locked = measure(r["found"].job, path, m.name, args.batch, skip) if r["found"] else None
            ratio = r["fps"] / locked["locked_fps"] if locked else float("nan")
            worst_resolved = max(worst_resolved, r["iteration"] + 1 if r["found"] else 10 ** 9)
            print(f"{'':9} {m.name:10} {'iter ' + str(r['iteration']) if r['found'] else 'never':>10} "
                  f"{r['frames']:>15,} {r['fps'] / 1e3:>12.1f} {ratio:>14.2f}  "
                  f"{r['found'].describe() if r['found'] else 'not resolved'}")
    print(f"\nlocked within {worst_it} iteration(s) of capture (target <= 2): "
          f"{'met' if worst_it <= 2 else 'MISSED'}")
    print(f"learning rate / locked rate, worst stream {worst_ratio:.2f} (target >= 0.25): "
          f"{'met' if worst_ratio >= 0.25 else 'MISSED'}")
    print(f"auto job resolved within {worst_resolved} iteration(s) of capture (target <= 3): "
          f"{'met' if worst_resolved <= 3 else 'MISSED'}")


if __name__ == "__main__":
    main()
