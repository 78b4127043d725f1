"""Wire-plan build time: the vectorised builder against its message-by-message twin.

For ``configs/gpt2-small.yaml`` (GPT-2 small, 124 M parameters, 8 ranks) with each protocol
forced on every bucket, both builders get the same DDP bucket sizes (the bucket layout is
computed once, outside the timing) and must return equal plans:

- ``gradtap.workload.wire_plan.build_plan``: NumPy over the sends of each call and over all
  messages (``workload/plan_columns.py``);
- ``tests/workload/naive_plan.naive_plan``: the per-message Python loop it replaced.

Times are CPU seconds (``time.process_time``, the best of ``REPEATS`` for the fast builder,
one run of the slow one), so a loaded machine inflates them less than wall time. Run:
``python -m benchmarks.plan [config.yaml]``.
"""

import argparse
import os
import time
from pathlib import Path

import numpy as np

from gradtap.workload.layout import job_buckets
from gradtap.workload.spec import load_job
from gradtap.workload.wire_plan import build_plan
from tests.workload.naive_plan import naive_plan

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpt2-small.yaml"
PROTOCOLS = ("Simple", "LL", "LL128")
REPEATS = 3
# What "fast enough" means: plans are built at every appliance start, per era and protocol
# candidate at lock-on, and in hundreds of tests; GPT-2 small LL (the most messages) must
# take under a second and every protocol must beat the loop by 20x.
TARGET_RATIO, TARGET_LL_SECONDS = 20.0, 1.0


def _cpu(fn, *args, repeats: int = 1):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.process_time()
        out = fn(*args)
        best = min(best, time.process_time() - t)
    return best, out


def _equal(a, b) -> bool:
    if any(getattr(a, k) != getattr(b, k) for k in ("geometries", "bucket_numels", "bucket_offsets")):
        return False
    for name in ("steps_per_iteration", "fifo_per_iteration", "phase_steps", "phase_period"):
        if not np.array_equal(getattr(a, name), getattr(b, name)):
            return False
    return all(getattr(a, t).dtype == getattr(b, t).dtype and getattr(a, t).shape == getattr(b, t).shape
               and all(np.array_equal(getattr(a, t)[f], getattr(b, t)[f]) for f in getattr(a, t).dtype.names)
               for t in ("messages", "flows", "blocks"))


def main(config: Path = CONFIG) -> None:
    base = load_job(config)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {config.name}, "
          f"{base.world_size} ranks, {base.nccl.channels} channels, era {base.nccl.era}; CPU seconds")
    print(f"{'protocol':8s} {'messages':>9s} {'blocks':>8s} {'naive s':>8s} {'fast s':>8s} {'ratio':>7s} "
          f"{'naive msg/s':>12s} {'fast msg/s':>12s}  equal")
    sizes = None
    for proto in PROTOCOLS:
        job = base.model_copy(update={"nccl": base.nccl.model_copy(update={"protocol": proto, "protocols": None})})
        sizes = sizes or [b.numel for b in job_buckets(job)]
        fast_s, fast = _cpu(build_plan, job, sizes, repeats=REPEATS)
        naive_s, naive = _cpu(naive_plan, job, sizes)
        count = len(fast.messages)
        ratio = naive_s / fast_s
        print(f"{proto:8s} {count:9d} {len(fast.blocks):8d} {naive_s:8.3f} {fast_s:8.3f} {ratio:6.1f}x "
              f"{count / naive_s:12,.0f} {count / fast_s:12,.0f}  {_equal(fast, naive)}")
        verdict = "met" if ratio >= TARGET_RATIO else "MISSED"
        print(f"  target ratio >= {TARGET_RATIO:g}x: {verdict}")
        if proto == "LL":
            print(f"  target LL fast < {TARGET_LL_SECONDS:g} s: {'met' if fast_s < TARGET_LL_SECONDS else 'MISSED'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=CONFIG,
                        help=f"the job whose plan is built (default: {CONFIG.name})")
    main(parser.parse_args().config)
