"""Block digests of a mirror group (``merger/digest.py``): GB/s against memcpy, in one run.

A bucket of ``--mib`` MiB of random bytes, cut into 4 KiB coverage blocks (Simple at MTU
4096: one block per packet), is digested whole by each contender; best of ``--repeats``:

- ``kernel``: ``block_digests`` (NH + SipHash-2-4-128, keyed), every block in one call,
  over Numba's threads (``--threads``: 1, and the machine's cores);
- ``blake2b``: ``hashlib.blake2b(digest_size=16)`` per block from a Python loop (what
  ``Coverage.of`` did before the kernel);
- ``blake2b-pool``: the same over a thread pool of as many threads as cores (hashlib
  releases the GIL for inputs of 2 KiB and more), one slice of the blocks per thread.

memcpy is ``benchmarks._bandwidth`` with the same number of threads, in the same run; the
ratio says how close the digest comes to only reading the bucket once.
Run: ``python -m benchmarks.digest [--mib 256] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from benchmarks._bandwidth import memcpy_bandwidth
from gradtap.merger.digest import block_digests, digest_key, new_secret

BLOCK = 4096


def best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mib << 20
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    k = nbytes // BLOCK
    start = np.arange(k, dtype=np.int64) * BLOCK
    size = np.full(k, BLOCK, np.int64)
    which = np.ones(k, bool)
    key = digest_key(new_secret())
    cores = os.cpu_count() or 1
    block_digests(data[:BLOCK * 4], start[:4], size[:4], which[:4], key)      # compile
    out = {"bucket_bytes": nbytes, "block_bytes": BLOCK, "cores": cores, "gbps": {}, "memcpy_gbps": {}}
    for threads in sorted({1, cores}):
        numba.set_num_threads(threads)
        t = best(args.repeats, lambda: block_digests(data, start, size, which, key))
        out["gbps"][f"kernel_{threads}t"] = nbytes / t / 1e9
        out["memcpy_gbps"][f"{threads}t"] = memcpy_bandwidth(threads)
    numba.set_num_threads(cores)
    few = min(k, 16384)           # the Python loop is slow: a slice of the bucket

    def blake(lo, hi):
        view = memoryview(data)
        return [hashlib.blake2b(view[j * BLOCK:(j + 1) * BLOCK], digest_size=16).digest() for j in range(lo, hi)]
    t = best(args.repeats, lambda: blake(0, few))
    out["gbps"]["blake2b_1t"] = few * BLOCK / t / 1e9
    bounds = np.linspace(0, few, cores + 1).astype(int)
    with ThreadPoolExecutor(cores) as pool:
        t = best(args.repeats, lambda: list(pool.map(blake, bounds[:-1], bounds[1:])))
    out["gbps"][f"blake2b_pool_{cores}t"] = few * BLOCK / t / 1e9
    out["ratio_to_memcpy"] = {name: rate / out["memcpy_gbps"][name.rsplit("_", 1)[1]]
                              for name, rate in out["gbps"].items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
