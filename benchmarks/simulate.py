"""How fast the simulator writes mirror captures (``python -m benchmarks.simulate [CONFIG]``).

Runs ``gradtap simulate`` on the GPT-2-small-like 8-rank job (or CONFIG) for one captured
iteration into a temporary directory, and prints frames/s and MB/s written per stream, the
time spent training versus encoding, and the ratio of the encoder's write rate to this
machine's memory bandwidth measured in the same run.

Target (issue 2): the GPT-2-small job writes its 3 mirror streams of one iteration in
under 60 s on a 2-core machine. A job in DDP's rebuilt bucket layout trains iteration 0
first (before capture begins), and that training is included in the wall time.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from benchmarks._bandwidth import memcpy_bandwidth
from gradtap.simulator.faults import FaultSpec
from gradtap.simulator.run import Simulation
from gradtap.workload.spec import load_job

TARGET_S = 60.0


def main(config: str = "configs/gpt2-small.yaml") -> None:
    job = load_job(config)
    bandwidth = memcpy_bandwidth(1)
    with tempfile.TemporaryDirectory(prefix="gradtap-bench-") as tmp:
        started = time.perf_counter()
        summary = Simulation(job, Path(tmp), iterations=1, seed=0, faults=FaultSpec()).run()
        wall = time.perf_counter() - started
    frames = sum(s.frames for s in summary.streams)
    nbytes = sum(s.bytes for s in summary.streams)
    enc = summary.seconds_encoding
    print(f"job {job.name}: {job.world_size} ranks, {len(summary.streams)} streams, 1 captured iteration")
    print(f"  wall time              {wall:8.1f} s   (target < {TARGET_S:.0f} s: {'met' if wall < TARGET_S else 'NOT met'})")
    print(f"  training (all ranks)   {summary.seconds_training:8.1f} s   ({summary.seconds_training / wall:5.1%})")
    print(f"  encoding + writing     {enc:8.1f} s   ({enc / wall:5.1%})")
    print(f"  frames written         {frames:8,d}     {frames / enc / 1e6:6.2f} Mframes/s while encoding")
    print(f"  bytes written          {nbytes / 1e6:8.1f} MB  {nbytes / enc / 1e9:6.2f} GB/s while encoding")
    print(f"  memcpy, 1 thread       {bandwidth:8.2f} GB/s; encoder at {nbytes / enc / 1e9 / bandwidth:5.1%} of it")


if __name__ == "__main__":
    main(*sys.argv[1:])
