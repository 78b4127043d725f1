"""A mirror group's traffic between nodes against the mirrored bytes, and its replica lag.

A job (``--config``) is simulated with mirror loss ``--mirror-loss`` on every stream; its
streams are dealt round-robin to ``--nodes`` node processes on this machine, which replay
them as one mirror group (``gradtap/group.py``, gloo over 127.0.0.1), and the same captures
are replayed by the single-process appliance. Reported:

- ``exchanged``: bytes each node sent to its peers (coverage bitmaps, block digests, the
  blocks the owners lacked, the finish rounds, the gradient norms, the snapshot entries; the
  8-byte length of every message included), per iteration, and as a share of the mirrored
  bytes that node read;
- ``lag``: the median replica lag per iteration (``IterationTiming.lag_s``: from the last
  round carrying an iteration's frames to its step applied), single appliance against each
  node of the group. The nodes share this machine's cores, so the group's figure includes
  their contention.

Run: ``python -m benchmarks.group [--config configs/small.yaml] [--iterations 3] [--nodes 3]
[--mirror-loss 1e-6]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gradtap.replay import run_replay
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.workload.spec import load_job, parse_job

ROOT = Path(__file__).resolve().parents[1]


def node(rank: int, world: int, rendezvous: str, job_doc: dict, pcaps: dict, out: Path, start: Path) -> None:
    from gradtap.group import run_group_replay
    from gradtap.workload.spec import MirrorGroupSpec

    run_group_replay(parse_job(job_doc), pcaps, out, torch.load(start, weights_only=True),
                     MirrorGroupSpec(rank=rank, world_size=world, rendezvous=rendezvous, timeout_s=300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "small.yaml")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--mirror-loss", type=float, default=1e-6)
    args = ap.parse_args()
    job = load_job(args.config)
    names = [m.name for m in job.mirrors]
    with tempfile.TemporaryDirectory(prefix="gradtap-group-") as tmp:
        root = Path(tmp)
        faults = parse_faults(f"mirror_loss={args.mirror_loss}" if args.mirror_loss else "", tuple(names))
        Simulation(job, root / "sim", iterations=args.iterations, seed=1, faults=faults).run()
        pcaps = {n: root / "sim" / "streams" / f"{n}.pcap" for n in names}
        start = root / "sim" / "truth" / "start.pt"
        result, _ = run_replay(job, pcaps, root / "single", torch.load(start, weights_only=True), digests=False)
        single_lag = statistics.median(t.lag_s for t in result.timings)
        ctx = mp.get_context("spawn")
        doc = job.model_dump(mode="json", exclude_none=True)
        procs = [ctx.Process(target=node, args=(r, args.nodes, f"file://{root / 'rendezvous'}", doc,
                                                {n: p for i, (n, p) in enumerate(pcaps.items()) if i % args.nodes == r},
                                                root / f"node{r}", start)) for r in range(args.nodes)]
        began = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
            if p.is_alive():
                p.kill()
                raise SystemExit("a node did not finish in 30 minutes")
        wall = time.perf_counter() - began
        nodes = []
        for r in range(args.nodes):
            report = json.loads((root / f"node{r}" / "replay.json").read_text())
            g = report["group"]
            n_it = len(report["iterations"])
            nodes.append({"rank": r, "streams": list(report["streams"]), "iterations": n_it,
                          "recovered": sum(line["recovered"] for line in report["iterations"]),
                          "stale": report["stale"],
                          "sent_bytes_per_iteration": g["sent_bytes"] / max(n_it, 1),
                          "mirrored_bytes_per_iteration": g["mirrored_bytes"] / max(n_it, 1),
                          "exchanged_share": g["sent_bytes"] / max(g["mirrored_bytes"], 1),
                          "lag_median_s": statistics.median(t["lag_s"] for t in report["timings"])})
        print(json.dumps({"config": str(args.config), "iterations": args.iterations, "nodes": args.nodes,
                          "mirror_loss": args.mirror_loss, "single_lag_median_s": single_lag,
                          "single_wall_s": result.wall_s, "group_wall_s": wall, "group": nodes}, indent=1))


if __name__ == "__main__":
    main()
