"""The gradient log's write rate per iteration for the shipped configs, and whether one core
and the store keep up (``store/gradient_log.py``).

For each job spec in ``configs/`` (or ``--config``), in one run:

- **the gradient**: a real one, the model's (``model.factory``) on its synthetic data, one
  backward pass per rank of the job's ring (``training.batch_size`` each), averaged as DDP's
  pre-divided allreduce gives it, in the job's wire dtype; and a **dense** one of the same
  size (every element a normal draw at the real gradient's scale), the worst case for the
  codec: a real job on real data touches far more embedding rows than a synthetic batch;
- **raw** and **compressed** bytes per iteration (the record; its entry is a few hundred
  bytes more);
- **encode**: shuffle + deflate (``encode``) throughput on one core, MB/s of raw gradient,
  best of ``--repeats``; **copy**: the update path's cost, a copy of the gradient into a log
  buffer;
- **store**: ``LogStore.write`` of the record (object fsynced and renamed, then the entry) to
  a ``file://`` store on ``--dir``'s filesystem, MB/s of compressed bytes, best of
  ``--repeats``; beside it the disk's sequential write rate (``benchmarks.snapshot.disk_write``);
- **needed**: the compressed MB/s the store must take at ``--iteration-s`` per iteration, and
  whether one core encodes and the store writes a record within one iteration.

MB = 1e6 bytes. Run: ``python -m benchmarks.gradient_log [--config configs/small.yaml ...]
[--iteration-s 0.25] [--repeats 3] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.snapshot import disk_write
from gradtap.store.gradient_log import LogEntry, LogStore, encode
from gradtap.store.object_store import SnapshotStore
from gradtap.updater.replica import WIRE_NUMPY
from gradtap.updater.replica_origin import job_sha256
from gradtap.workload.data import batch_loss
from gradtap.workload.models import build
from gradtap.workload.spec import JobSpec, load_job

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def real_gradient(job: JobSpec) -> np.ndarray:
    """The job's averaged gradient over its ranks' synthetic batches, as wire bytes (uint8)."""
    model = build(job.model.factory, job.model.kwargs, seed=0)
    data = model.synthetic_data(batch_size=job.training.batch_size, seed=0,
                                seq_len=job.training.data_kwargs.get("seq_len"))
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for rank in range(job.world_size):
        for p in params:
            p.grad = None
        batch_loss(model, data.batch(rank, 0)).backward()
        for t, p in zip(total, params):
            t.add_(p.grad, alpha=1.0 / job.world_size)
    flat = torch.cat([t.reshape(-1) for t in total])
    wire = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[job.ddp.grad_dtype]
    return flat.to(wire).view(torch.uint8).numpy().copy()


def dense_like(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Every element a normal draw at the scale of ``raw``'s nonzero elements."""
    values = raw.view(dtype) if dtype != np.uint16 else None
    scale = float(np.std(values[values != 0])) if values is not None and values.any() else 1e-3
    draw = np.random.default_rng(0).standard_normal(raw.size // dtype.itemsize).astype(np.float32) * scale
    if dtype == np.float32:
        return draw.view(np.uint8)
    return torch.from_numpy(draw).to(torch.bfloat16).view(torch.uint8).numpy().copy()


def best(repeats: int, fn) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return min(times), out


def measure(job: JobSpec, raw: np.ndarray, store: SnapshotStore, repeats: int) -> dict:
    itemsize = WIRE_NUMPY[job.ddp.grad_dtype].itemsize
    scratch, buffer = np.empty_like(raw), np.empty_like(raw)
    copy_s, _ = best(repeats, lambda: np.copyto(buffer, raw))
    encode_s, blob = best(repeats, lambda: encode(raw, itemsize, scratch))
    entry = LogEntry(job=job.name, iteration=1, step=1, wire_dtype=job.ddp.grad_dtype, raw_bytes=raw.size,
                     raw_sha256=hashlib.sha256(raw).hexdigest(), sha256=hashlib.sha256(blob).hexdigest(),
                     size=len(blob), prev=None, base=None, job_sha256=job_sha256(job))
    logstore = LogStore(store)
    counter = iter(range(1, 1 << 30))

    def write():
        logstore.write(LogEntry(**{**entry.__dict__, "iteration": next(counter)}), blob)

    store_s, _ = best(repeats, write)
    return {"raw": raw.size, "compressed": len(blob), "copy_s": copy_s, "encode_s": encode_s, "store_s": store_s}


def report(name: str, kind: str, m: dict, iteration_s: float) -> str:
    needed = m["compressed"] / iteration_s / MB
    keeps = m["encode_s"] + m["store_s"] <= iteration_s
    return (f"| {name} | {kind} | {m['raw'] / MB:.1f} | {m['compressed'] / MB:.1f} ({m['compressed'] / m['raw']:.0%}) "
            f"| {m['raw'] / m['encode_s'] / MB:.0f} | {m['raw'] / m['copy_s'] / MB:.0f} "
            f"| {m['compressed'] / m['store_s'] / MB:.0f} | {needed:.1f} ({m['raw'] / iteration_s / MB:.1f} raw) "
            f"| {'yes' if keeps else 'no'} ({m['encode_s'] + m['store_s']:.2f} s) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, action="append", help="job spec YAML (default: every one in configs/)")
    ap.add_argument("--iteration-s", type=float, default=0.25, help="the training job's time per iteration")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where the file:// store goes (default: a temporary directory)")
    args = ap.parse_args()
    configs = args.config or sorted((ROOT / "configs").glob("*.yaml"))
    work = Path(tempfile.mkdtemp(prefix="gradlog-bench-", dir=args.dir))
    try:
        nbytes = 256 << 20
        disk_s = min(disk_write(work / "disk", nbytes) for _ in range(args.repeats))
        print(f"disk: sequential write + fsync {nbytes / disk_s / MB:.0f} MB/s on {work}; iteration time "
              f"{args.iteration_s} s; best of {args.repeats}")
        print("| config | gradient | raw MB/iter | compressed MB/iter | encode MB/s (1 core) | copy MB/s | "
              "store write MB/s | needed MB/s at the iteration time | one core + store keep up |")
        print("|---|---|---|---|---|---|---|---|---|")
        for path in configs:
            job = load_job(path)
            store = SnapshotStore(f"file://{work / job.name}", job.name)
            raw = real_gradient(job)
            dtype = WIRE_NUMPY[job.ddp.grad_dtype] if job.ddp.grad_dtype == "fp32" else np.dtype(np.uint16)
            for kind, grad in (("real", raw), ("dense", dense_like(raw, dtype))):
                print(report(path.stem, kind, measure(job, grad, store, args.repeats), args.iteration_s), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
