"""A mirror group's traffic between nodes against the mirrored bytes, its memory and its replica lag.

Each placement (``--placements``) names a job and how its streams are dealt to the group's
node processes on this machine; the job is simulated with mirror loss ``--mirror-loss`` on
every stream, its streams replayed by the nodes as one mirror group (``gradtap/group.py``,
gloo over a shared rendezvous file), and the same captures by the single-process appliance.
The default placements, both 3 nodes of ``configs/small.yaml``'s job (4 ranks):

- ``round-robin``: ``configs/small.yaml``'s three egress streams, one per node. An egress
  stream of a 4-rank ring carries 3 of the 4 allgather chunks, so an owner lacks a quarter
  of every bucket it owns, whichever it owns;
- ``covering``: ``configs/group-both.yaml``, both directions of one rank's port per node
  (egress and ingress): every node's streams cover every bucket, its own shard included.

Each node's spec lists every node's streams (``MirrorGroupSpec.streams``), so ownership
follows coverage where gradtap's group runner takes it (``workload/shards.py``). Reported,
per node:

- ``exchanged_share``: bytes it sent to its peers over the mirrored bytes it read, and
  apart: ``blocks_share`` (the blocks owners lacked or disputed) and ``protocol_share``
  (coverage bitmaps, block digests, the finish rounds, the gradient norms, the snapshot
  entries, the digest key; the 8-byte length of every message included): the protocol's
  fixed cost;
- ``shard_state_bytes``: the parameters and both moments its shard holds (the whole
  replica's in ``whole_state_bytes``), and ``peak_rss_bytes``: the node process's peak
  resident memory (the interpreter, torch and the Numba kernels included);
- ``lag_median_s``: the median replica lag per iteration (``IterationTiming.lag_s``), against
  the single appliance's. The nodes share this machine's cores.

Run: ``python -m benchmarks.group [--placements round-robin covering] [--iterations 3]
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
NODES = 3
PLACEMENTS = {           # name: (job, the streams of each node)
    "round-robin": ("small.yaml", [["r0-egress"], ["r1-egress"], ["r2-egress"]]),
    "covering": ("group-both.yaml", [["r0-both"], ["r1-both"], ["r2-both"]]),
}


def node(rank: int, placement: list[list[str]], rendezvous: str, job_doc: dict, pcaps: dict, out: Path,
         start: Path) -> None:
    from gradtap.group import run_group_replay
    from gradtap.workload.spec import MirrorGroupSpec

    group = MirrorGroupSpec(rank=rank, world_size=len(placement), rendezvous=rendezvous, timeout_s=300,
                            streams=placement)
    _, sink = run_group_replay(parse_job(job_doc), pcaps, out, torch.load(start, weights_only=True, mmap=True),
                               group)
    state = sink.replica.state
    (out / "bench.json").write_text(json.dumps({
        "sent_by_kind": sink.link.sent_by_kind,
        "shard_state_bytes": state.param.nbytes + state.exp_avg.nbytes + state.exp_avg_sq.nbytes,
        "peak_rss_bytes": peak_rss()}))


def peak_rss() -> int:
    """This process's peak resident memory (``VmHWM``: unlike ``ru_maxrss``, not carried over
    from the parent across the spawn's exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(name: str, config: Path, placement: list[list[str]], iterations: int, loss: float, root: Path) -> dict:
    job = load_job(config)
    names = [m.name for m in job.mirrors]
    faults = parse_faults(f"mirror_loss={loss}" if loss else "", tuple(names))
    Simulation(job, root / "sim", iterations=iterations, seed=1, faults=faults).run()
    pcaps = {n: root / "sim" / "streams" / f"{n}.pcap" for n in names}
    start = root / "sim" / "truth" / "start.pt"
    result, single = run_replay(job, pcaps, root / "single", torch.load(start, weights_only=True), digests=False)
    whole = single.replica.state
    ctx = mp.get_context("spawn")
    doc = job.model_dump(mode="json", exclude_none=True)
    procs = [ctx.Process(target=node, args=(r, placement, f"file://{root / 'rendezvous'}", doc,
                                            {n: pcaps[n] for n in placement[r]}, root / f"node{r}", start))
             for r in range(len(placement))]
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
    for r in range(len(placement)):
        report = json.loads((root / f"node{r}" / "replay.json").read_text())
        bench = json.loads((root / f"node{r}" / "bench.json").read_text())
        g, kinds = report["group"], bench["sent_by_kind"]
        mirrored = max(g.get("mirrored_bytes", sum(report["bytes"].values())), 1)
        n_it = max(len(report["iterations"]), 1)
        nodes.append({"rank": r, "streams": list(report["streams"]), "buckets": g["buckets"],
                      "recovered": sum(line["recovered"] for line in report["iterations"]), "stale": report["stale"],
                      "sent_bytes_per_iteration": g["sent_bytes"] / n_it,
                      "mirrored_bytes_per_iteration": mirrored / n_it,
                      "exchanged_share": g["sent_bytes"] / mirrored,
                      "blocks_share": kinds.get("blocks", 0) / mirrored,
                      "protocol_share": kinds.get("protocol", 0) / mirrored,
                      "shard_state_bytes": bench["shard_state_bytes"], "peak_rss_bytes": bench["peak_rss_bytes"],
                      "lag_median_s": statistics.median(t["lag_s"] for t in report["timings"])})
    return {"placement": name, "config": str(config), "nodes": len(placement),
            "whole_state_bytes": whole.param.nbytes + whole.exp_avg.nbytes + whole.exp_avg_sq.nbytes,
            "single_lag_median_s": statistics.median(t.lag_s for t in result.timings),
            "single_wall_s": result.wall_s, "group_wall_s": wall, "group": nodes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--placements", nargs="+", choices=sorted(PLACEMENTS), default=list(PLACEMENTS))
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--mirror-loss", type=float, default=1e-6)
    args = ap.parse_args()
    out = {"iterations": args.iterations, "mirror_loss": args.mirror_loss, "placements": []}
    for name in args.placements:
        config, placement = PLACEMENTS[name]
        with tempfile.TemporaryDirectory(prefix=f"gradtap-group-{name}-") as tmp:
            out["placements"].append(run(name, ROOT / "configs" / config, placement, args.iterations,
                                         args.mirror_loss, Path(tmp)))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
