"""Snapshot and upload throughput against ``torch.save`` and the disk's sequential write rate.

The state is an Adam replica's: ``--params`` float32 parameters with ``exp_avg`` and
``exp_avg_sq`` (12 bytes per parameter, in 8 tensors), as ``Replica.state_dict`` gives it.
Measured in the same run, on the filesystem of ``--dir`` (default: a temporary directory),
best of ``--repeats`` with the contenders interleaved so that background load hits them alike:

- ``disk``: one file of the same size written sequentially in 4 MiB blocks, then fsynced:
  what the disk takes;
- ``torch.save``: the model and optimizer state dicts ``torch.save``d into one file, fsynced
  (what a trainer's plain checkpoint costs);
- ``snapshot``: ``Snapshots.write`` (two ``torch.save`` files hashed as written, fsynced,
  manifest, renames, ``LATEST``): the update path's cost when a snapshot is due;
- ``upload file://``: ``SnapshotStore.put_snapshot`` of that snapshot to a ``file://`` store
  on the same filesystem (the files hashed again, copied under temporary names, fsynced,
  renamed, the manifest last): what the background uploader does per snapshot;
- ``upload s3`` (``--s3``): the same to moto's S3 server on 127.0.0.1 (in-memory; it measures
  the client and HTTP path, not a disk).

GB/s = 1e9 bytes of state per second. Run:
``python -m benchmarks.snapshot [--params N] [--repeats R] [--dir DIR] [--s3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gradtap.updater.snapshot import Snapshots
from gradtap.updater.store import SnapshotStore

BLOCK = 4 << 20


def adam_state(n: int) -> dict:
    """A replica-shaped state of ``n`` float32 parameters in 8 tensors, each with its moments."""
    sizes = [n // 8] * 7 + [n - 7 * (n // 8)]
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(s, generator=gen) for i, s in enumerate(sizes)}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(s, generator=gen),
                 "exp_avg_sq": torch.rand(s, generator=gen)} for i, s in enumerate(sizes)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "params": list(range(len(sizes)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "iteration": 1}


def disk_write(path: Path, nbytes: int) -> float:
    block = os.urandom(BLOCK)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // BLOCK):
            f.write(block)
        f.write(block[:nbytes % BLOCK])
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - start
    path.unlink()
    return took


def torch_save(path: Path, state: dict) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": state["model"], "optimizer": state["optimizer"]}, f)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - start
    path.unlink()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=32_000_000, help="float32 parameters (default 32 M)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--s3", action="store_true", help="also upload to moto's S3 server on 127.0.0.1")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gradtap-bench-", dir=args.dir))
    state = adam_state(args.params)
    nbytes = 12 * args.params
    server = None
    try:
        snaps = Snapshots(work / "local", "bench", keep=1)
        stores = {"upload file://": SnapshotStore(f"file://{work / 'store'}", "bench", keep_last=1)}
        if args.s3:
            from tests.updater.s3_server import CREDENTIALS, MotoServer
            os.environ.update(CREDENTIALS)
            server = MotoServer().start()
            server.make_bucket("bench")
            stores["upload s3 (moto)"] = SnapshotStore("s3://bench/p", "bench", keep_last=1,
                                                       storage_options=server.options())
        best: dict[str, float] = {}

        def keep(name: str, took: float) -> None:
            best[name] = min(best.get(name, float("inf")), took)

        for r in range(args.repeats):
            keep("disk (sequential write + fsync)", disk_write(work / "seq.bin", nbytes))
            keep("torch.save (one file + fsync)", torch_save(work / "ckpt.pt", state))
            state["iteration"] = r + 1
            state["model"]["layer0.weight"][0] += 1.0           # new bytes: no object is already stored
            state["optimizer"]["state"][0]["exp_avg"][0] += 1.0
            start = time.perf_counter()
            snap = snaps.write(state, step=r + 1)
            keep("snapshot (Snapshots.write)", time.perf_counter() - start)
            for name, store in stores.items():
                start = time.perf_counter()
                store.put_snapshot(snap)
                keep(name, time.perf_counter() - start)
                store.retain()
        snaps.close()
        print(f"{args.params / 1e6:.0f} M parameters with Adam moments: {nbytes / 1e9:.2f} GB of state; "
              f"writing to {work} (best of {args.repeats})\n")
        disk = nbytes / best["disk (sequential write + fsync)"]
        saved = nbytes / best["torch.save (one file + fsync)"]
        print(f"{'contender':34s} {'s':>7s} {'GB/s':>7s} {'x disk':>7s} {'x torch.save':>13s}")
        for name, took in best.items():
            rate = nbytes / took
            print(f"{name:34s} {took:7.2f} {rate / 1e9:7.2f} {rate / disk:7.2f} {rate / saved:13.2f}")
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
