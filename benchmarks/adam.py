"""Adam step throughput: gradtap's kernels against torch.optim and this machine's memory limit.

One AdamW step (weight decay 0.01, fp32 gradient, 100 M float32 parameters unless memory is
short; the size is printed) reads parameter, gradient, ``exp_avg`` and ``exp_avg_sq`` and
writes three of them back: 28 bytes per parameter, far more than the caches hold, so memory
bandwidth is the limit. Every contender steps the same arrays, each starting on a cache line
(as torch places the moments it allocates itself). Measured in the same run, best of
``REPEATS`` with the contenders interleaved so that background load hits them alike; the
target ratios are also printed repeat by repeat (median and range):

- ``proxy``: the same 28 bytes per parameter with trivial math (read p, g, m, v; write p, m,
  v), a Numba ``prange`` loop: what this machine allows an Adam step, 1 and 2 threads;
- gradtap fused (the fast path, bit-exact with ``torch.optim.AdamW(fused=True)``) and
  gradtap single-tensor (bit-exact with ``foreach=False``/``foreach=True``), 1 and 2
  threads (``numba.set_num_threads``), each with the root ``selfcheck.root_source`` picks on
  this host (printed: the AVX-512, AVX2 or SSE MKL kernel reproduced, or ``torch.sqrt`` itself);
- ``torch.optim.AdamW`` single-tensor, foreach and fused, on torch's intra-op threads;
- memcpy's rate (``benchmarks._bandwidth``) turned into parameters per second at 28 bytes.

Before timing, both gradtap paths step ``--check-params`` parameters (three tensors, odd
sizes) three times beside torch's and must equal it bit for bit.

Gparam/s = 1e9 parameters stepped per second. Targets (issue 12): fast path >= 0.95 x proxy and
>= 1.0 x torch fused; single-tensor path >= 3 x torch single-tensor.
``--play intel-avx2|mkl-sse`` runs the benchmark again in a process that plays that kind of
host (``benchmarks/_hosts.py``: torch's AVX2 kernels, Numba code without AVX-512, MKL capped),
so an AVX-512 Intel host measures the paths of one without AVX-512, with its own memory.
Run: ``python -m benchmarks.adam [--params N] [--repeats R] [--check-params N] [--play HOST]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import NoReturn

import numba
import numpy as np
import torch
from numba import njit, prange

from benchmarks._bandwidth import memcpy_bandwidth
from benchmarks._hosts import PLAYED, can_play, played_env
from gradtap.core.jit import JIT_PARALLEL
from gradtap.updater import kernels, mkl_sqrt, selfcheck, state
from gradtap.workload.spec import OptimizerSpec

BYTES_PER_PARAM = 28
DEFAULT_PARAMS = 100_000_000
CHECK_PARAMS = 3_000_000
CHECK_STEPS = 3
REPEATS = 3
TARGETS = {"fast/proxy": 0.95, "fast/torch fused": 1.0, "single/torch single": 3.0}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
TORCH_FLAGS = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@njit(**JIT_PARALLEL)
def _proxy(p, g, m, v):
    for i in prange(p.size):
        gi = g[i]
        m[i] += gi
        v[i] += gi
        p[i] += gi


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _size(requested: int) -> int:
    # p, g, m, v plus torch's single-tensor temporaries (about three more arrays), with room.
    fits = int(_available_bytes() * 0.4) // (4 * 7)
    return min(requested, fits)


class Ours:
    def __init__(self, implementation: str, p, g, m, v, threads: int):
        self.cfg = OptimizerSpec(kind="adamw", implementation=implementation, **HYPER)
        self.root = selfcheck.root_source(self.cfg)
        self.work = kernels.work_spans([p.size], implementation)
        self.arrays, self.threads, self.step = (p, g, m, v), threads, 0

    def __call__(self) -> None:
        numba.set_num_threads(self.threads)
        self.step += 1
        p, g, m, v = self.arrays
        c = kernels.step_constants(self.cfg.implementation, decoupled=True, step=self.step, **HYPER)
        kernels.adam_step(self.cfg.implementation, p, g, m, v, self.work, c, sqrt=self.root)


class Torch:
    def __init__(self, implementation: str, p, g):
        self.param = torch.nn.Parameter(torch.from_numpy(p))
        self.param.grad = torch.from_numpy(g)
        self.optimizer = torch.optim.AdamW([self.param], **HYPER, **TORCH_FLAGS[implementation])

    def __call__(self) -> None:
        self.optimizer.step()


class Proxy:
    def __init__(self, p, g, m, v, threads: int):
        self.arrays, self.threads = (p, g, m, v), threads

    def __call__(self) -> None:
        numba.set_num_threads(self.threads)
        _proxy(*self.arrays)


def bit_exact(implementation: str, n: int, threads: int) -> bool:
    """Whether ``CHECK_STEPS`` gradtap steps of ``implementation`` (its selected root, on
    ``threads`` threads) over ``n`` parameters in three tensors equal torch.optim's bit for bit."""
    rng = np.random.default_rng(1)
    sizes = [n - n // 3 - 7, 7, n // 3]
    bounds = np.cumsum([0] + sizes)
    p = rng.standard_normal(n, dtype=np.float32)
    tensors = [torch.nn.Parameter(torch.from_numpy(p[a:b].copy())) for a, b in zip(bounds, bounds[1:])]
    optimizer = torch.optim.AdamW(tensors, **HYPER, **TORCH_FLAGS[implementation])
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    cfg = OptimizerSpec(kind="adamw", implementation=implementation, **HYPER)
    root, work = selfcheck.root_source(cfg), kernels.work_spans(sizes, implementation)
    numba.set_num_threads(threads)
    for step in range(1, CHECK_STEPS + 1):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(10.0 ** -step)
        for t, a, b in zip(tensors, bounds, bounds[1:]):
            t.grad = torch.from_numpy(g[a:b].copy())
        optimizer.step()
        c = kernels.step_constants(implementation, decoupled=True, step=step, **HYPER)
        kernels.adam_step(implementation, p, g, m, v, work, c, sqrt=root)
    theirs = [torch.cat([t.detach() for t in tensors]).numpy(),
              torch.cat([optimizer.state[t]["exp_avg"] for t in tensors]).numpy(),
              torch.cat([optimizer.state[t]["exp_avg_sq"] for t in tensors]).numpy()]
    return all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip((p, m, v), theirs))


def describe(root: str) -> str:
    if root in mkl_sqrt.KERNELS:
        kernel = mkl_sqrt.KERNELS[root]
        return f"{root} (MKL's {kernel.symbol} reproduced, {kernel.instruction})"
    return {kernels.SQRT_TORCH: f"{root} (torch.sqrt itself, one more pass)",
            kernels.SQRT_IEEE: f"{root} (correctly rounded)"}[root]


def play(host: str, argv: list[str]) -> NoReturn:
    """Run the benchmark with ``argv`` in a process that plays ``host``, and exit with its status."""
    reason = can_play()
    if reason:
        raise SystemExit(f"--play {host}: {reason}")
    print(f"playing {host}: ATEN_CPU_CAPABILITY=avx2, Numba for haswell without AVX-512, "
          f"MKL_ENABLE_INSTRUCTIONS={PLAYED[host]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gradtap-bench-numba-") as cache:
        env = played_env(host, cache)
        status = subprocess.run([sys.executable, "-m", "benchmarks.adam", *argv], env=env).returncode
    raise SystemExit(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=DEFAULT_PARAMS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--check-params", type=int, default=CHECK_PARAMS)
    parser.add_argument("--play", choices=sorted(PLAYED), default=None,
                        help="measure the paths of another kind of host (see the module's docstring)")
    args = parser.parse_args()
    if args.play:
        play(args.play, [a for a in sys.argv[1:] if a not in ("--play", args.play) and not a.startswith("--play=")])
    n = _size(args.params)
    threads = min(2, os.cpu_count() or 1)
    reduced = "" if n == args.params else f" (reduced from {args.params / 1e6:.0f} M to fit in memory)"
    print(f"{n / 1e6:.0f} M float32 parameters ({n * BYTES_PER_PARAM / 1e9:.1f} GB of traffic per step), "
          f"{os.cpu_count()} CPUs, torch {torch.__version__} on {torch.get_num_threads()} threads, "
          f"numba {numba.__version__}{reduced}")
    roots = {impl: selfcheck.root_source(OptimizerSpec(kind="adamw", implementation=impl, **HYPER))
             for impl in ("single_tensor", "fused")}
    exact = {impl: bit_exact(impl, args.check_params, threads) for impl in roots}
    for impl, root in roots.items():
        print(f"gradtap {impl}: root {describe(root)}; bit-exact with torch over {args.check_params / 1e6:g} M "
              f"parameters x {CHECK_STEPS} steps: {'yes' if exact[impl] else 'NO'}")
    # Every array starts on a cache line, as torch's allocator places the exp_avg and
    # exp_avg_sq it creates for itself and as the replica's state is laid out: NumPy's own
    # large arrays start 16 bytes into a page, which split every other vector of a kernel
    # across two lines and gave torch two aligned streams to gradtap's none.
    rng = np.random.default_rng(0)
    p, g, m, v = (state.aligned_empty(n) for _ in range(4))
    p[:] = rng.standard_normal(n, dtype=np.float32)
    g[:] = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    m[:] = 0
    v[:] = 0
    contenders = {}
    for t in range(1, threads + 1):
        contenders[f"proxy, {t}T"] = Proxy(p, g, m, v, t)
        contenders[f"gradtap fused (fast path), {t}T"] = Ours("fused", p, g, m, v, t)
        contenders[f"gradtap single-tensor, {t}T"] = Ours("single_tensor", p, g, m, v, t)
    for impl in ("single_tensor", "foreach", "fused"):
        contenders[f"torch {impl}"] = Torch(impl, p, g)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for run in contenders.values():      # compile, fault pages in, allocate torch's state
        run()
    for _ in range(args.repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    rate = {name: n / min(t) / 1e9 for name, t in times.items()}
    memcpy = {t: memcpy_bandwidth(t) for t in range(1, threads + 1)}
    print(f"\n{'contender':38s} {'Gparam/s':>9s} {'GB/s':>7s}")
    for name, r in rate.items():
        print(f"{name:38s} {r:9.3f} {r * BYTES_PER_PARAM:7.1f}")
    for t, bw in memcpy.items():
        print(f"{f'memcpy, {t}T (2 x copy rate / 28 B)':38s} {2 * bw / BYTES_PER_PARAM:9.3f} {2 * bw:7.1f}")
    top = f"{threads}T"
    pairs = {"fast/proxy": (f"gradtap fused (fast path), {top}", f"proxy, {top}"),
             "fast/torch fused": (f"gradtap fused (fast path), {top}", "torch fused"),
             "single/torch single": (f"gradtap single-tensor, {top}", "torch single_tensor")}
    ratios = {name: rate[ours] / rate[theirs] for name, (ours, theirs) in pairs.items()}
    # The same ratio repeat by repeat (each repeat runs every contender once): its median
    # and range say how much of a best-of ratio is background load on a shared machine.
    per_repeat = {name: np.array(times[theirs]) / np.array(times[ours]) for name, (ours, theirs) in pairs.items()}
    path_exact = {"fast/proxy": exact["fused"], "fast/torch fused": exact["fused"],
                  "single/torch single": exact["single_tensor"]}
    print(f"\nratios at {top}, best of {args.repeats} (target; met only if the path is also bit-exact), "
          "and the ratio per repeat: median [min, max]:")
    for name, r in ratios.items():
        met = r >= TARGETS[name] and path_exact[name]
        each = per_repeat[name]
        print(f"  {name:22s} {r:5.2f}  (>= {TARGETS[name]}) {'met' if met else 'MISSED':6s}  "
              f"{np.median(each):5.2f} [{each.min():.2f}, {each.max():.2f}]")


if __name__ == "__main__":
    main()
