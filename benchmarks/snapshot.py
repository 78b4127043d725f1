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

GB/s = 1e9 bytes of state per second.

``--lag``: the update path with uploads running. A replica of ``--lag-params`` parameters
(gradtap's fused AdamW kernel, fp32 wire) steps ``--lag-steps`` times alone, then as many
times while the background uploader uploads the big state above to the ``file://`` store
without pause; each step's time is the replica's lag on this path, and the ratio of the medians
says what uploading costs it (on this machine's 2 cores the uploader competes for them).

Run: ``python -m benchmarks.snapshot [--params N] [--repeats R] [--dir DIR] [--s3] [--lag]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from gradtap.store.snapshot import Snapshots
from gradtap.store.object_store import SnapshotStore

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


def lag_job(n: int):
    from gradtap.workload.spec import parse_job

    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:01:{i + 1:02x}"} for i in range(3)]
    width = max(16, int((n / 4) ** 0.5))
    return parse_job({"name": "lag-bench", "model": {"factory": "gradtap.workload.models:mlp",
                                                    "kwargs": {"sizes": [width, width, width, width, width]}},
                      "optimizer": {"kind": "adamw", "implementation": "fused", "lr": 1e-3},
                      "ring": {"ranks": ranks}, "mirrors": [{"name": "m", "rank": 0, "direction": "egress"}]})


def step_times(replica, grad, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        replica.apply(replica.iteration, grad)
        out.append(time.perf_counter() - start)
    return out


def lag(work: Path, state: dict, state_bytes: int, params: int, steps: int) -> None:
    import numpy as np

    from gradtap.updater.replica import Replica
    from gradtap.store.uploader import Uploader

    job = lag_job(params)
    replica = Replica.from_job(job)
    grad = (np.random.default_rng(0).standard_normal(sum(b.numel for b in replica.layout.buckets)) * 1e-3).astype(np.float32)
    step_times(replica, grad, 2)                                  # compiled and warm
    alone = step_times(replica, grad, steps)
    snaps = Snapshots(work / "lag-local", "bench", keep=2)
    store = SnapshotStore(f"file://{work / 'lag-store'}", "bench", keep_last=1)
    uploader = Uploader(store)
    big = snaps.write(state, step=1)
    stop = threading.Event()

    def feed() -> None:                                           # keep the uploader busy throughout
        i = 0
        while not stop.is_set():
            i += 1
            staged = work / f"lag-stage-{i}"
            staged.mkdir()
            for name in ("model.pt", "optimizer.pt", "manifest.json"):
                os.link(big / name, staged / name)
            (staged / "manifest.json").unlink()
            manifest = json.loads((big / "manifest.json").read_text())
            manifest["iteration"] = i
            (staged / "manifest.json").write_text(json.dumps(manifest))
            uploader.submit(i, staged)
            uploader.wait_idle(600)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    while uploader.counts()["submitted"] == 0:
        time.sleep(0.01)
    busy = step_times(replica, grad, steps)
    stop.set()
    feeder.join()
    uploaded = uploader.counts()["uploaded"]
    uploader.close(60)
    snaps.close()
    a, b = float(np.median(alone)), float(np.median(busy))
    print(f"\nupdate path, {sum(b.numel for b in replica.layout.buckets) / 1e6:.1f} M parameters, fused AdamW, {steps} steps each:")
    print(f"  step alone                 median {a * 1e3:8.1f} ms   max {max(alone) * 1e3:8.1f} ms")
    print(f"  step while uploading       median {b * 1e3:8.1f} ms   max {max(busy) * 1e3:8.1f} ms   "
          f"({uploaded} uploads of the {state_bytes / 1e9:.2f} GB state meanwhile)")
    print(f"  ratio (busy / alone)       {b / a:8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=32_000_000, help="float32 parameters (default 32 M)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--s3", action="store_true", help="also upload to moto's S3 server on 127.0.0.1")
    parser.add_argument("--lag", action="store_true", help="the update path's step time with uploads running")
    parser.add_argument("--lag-params", type=int, default=8_000_000)
    parser.add_argument("--lag-steps", type=int, default=100)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gradtap-bench-", dir=args.dir))
    state = adam_state(args.params)
    nbytes = 12 * args.params
    server = None
    try:
        snaps = Snapshots(work / "local", "bench", keep=1)
        stores = {"upload file://": SnapshotStore(f"file://{work / 'store'}", "bench", keep_last=1)}
        if args.s3:
            from tests.store.s3_server import CREDENTIALS, MotoServer
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
        if args.lag:
            lag(work, state, nbytes, args.lag_params, args.lag_steps)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
