"""``gradtap inspect`` on hostile captures of many one-frame flows (issue 11, "Resources and
the disk"): time and peak memory, with and without a job, against tshark.

Each capture holds ``--flows`` RoCEv2 flows of one frame each (``tests/parser/many_flows.py``:
RDMA WRITE ONLY with immediate, 16 B of payload, a correct ICRC, 110 B per frame in the file),
made once and cached in ``--cache``. Each run is a fresh process so that its figures are its
own:

- **api**: ``inspect_capture(FILE)`` (default ``max_flows``), after a warm-up call that
  compiles every kernel;
- **api --job**: the same with a 2-rank job whose ranks are the flows' addresses, so that
  every flow is a candidate for the flow learner (the worst case for ``--job``);
- **cli --json**: ``gradtap inspect FILE --json`` as an operator runs it (start-up, JSON
  output to ``/dev/null``);
- **tshark**: ``tshark -r FILE -T fields -e infiniband.bth.destqp`` (its rate in frames per
  second is the peer figure; ``--no-tshark`` leaves it out).

Figures: wall seconds, frames per second, and peak RSS: the whole process's ``VmHWM``, and
for the API runs what the call added to the RSS it started from (the peak is reset first
through ``/proc/self/clear_refs``, proc(5)).

Run from the repository root: ``python -m benchmarks.inspect [--flows N ...] [--cache DIR]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

API = """
import json, sys, time
from gradtap.parser.inspect import inspect_capture

def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

job = None
if sys.argv[3] == "job":
    from tests.simulator.test_simulate import make_job
    job = make_job(n=2, protocol="LL", ipv6=False)      # ranks 198.18.0.1 and 198.18.1.1
inspect_capture(sys.argv[2], job, max_flows=2)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
start = time.perf_counter()
s = inspect_capture(sys.argv[1], job)
print(json.dumps({"s": time.perf_counter() - start, "added_mb": (status("VmHWM") - before) / 1024,
                  "peak_mb": status("VmHWM") / 1024, "listed": len(s["flows"]), "not_tracked": s["not_tracked"]}))
"""

CLI = """
import sys, time, resource
start = time.perf_counter()
sys.argv = ["gradtap", "inspect", sys.argv[1], "--json"]
sys.stdout = open("/dev/null", "w")
from gradtap.cli import main
try:
    main()
except SystemExit as exit:
    assert not exit.code, exit.code
sys.stderr.write(f"{time.perf_counter() - start} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}\\n")
"""


def capture(cache: Path, flows: int) -> Path:
    from tests.parser.many_flows import one_frame_flows

    path = cache / f"inspect-{flows}-flows.pcap"
    if not path.exists():
        tmp = path.with_suffix(".part")
        one_frame_flows(tmp, flows)
        tmp.rename(path)
    return path


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flows", type=int, nargs="+", default=[500_000, 2_000_000])
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "gradtap-bench")
    ap.add_argument("--no-tshark", action="store_true")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    few = capture(args.cache, 10)
    print(f"{'flows':>9} {'run':<12} {'s':>7} {'Mframes/s':>9} {'peak MB':>8} {'added MB':>8}  not tracked")
    for n in args.flows:
        path = capture(args.cache, n)
        for name, mode in (("api", "plain"), ("api --job", "job")):
            r = json.loads(run(API, str(path), str(few), mode).stdout)
            print(f"{n:>9} {name:<12} {r['s']:>7.2f} {n / r['s'] / 1e6:>9.2f} {r['peak_mb']:>8.0f} "
                  f"{r['added_mb']:>8.0f}  {r['not_tracked']['flows']:,} flows, {r['not_tracked']['frames']:,} frames")
        s, peak = map(float, run(CLI, str(path)).stderr.split()[-2:])
        print(f"{n:>9} {'cli --json':<12} {s:>7.2f} {n / s / 1e6:>9.2f} {peak:>8.0f}")
        if not args.no_tshark:
            start = time.perf_counter()
            subprocess.run(["tshark", "-r", str(path), "-T", "fields", "-e", "infiniband.bth.destqp"],
                           stdout=subprocess.DEVNULL, check=True)
            s = time.perf_counter() - start
            print(f"{n:>9} {'tshark':<12} {s:>7.2f} {n / s / 1e6:>9.2f}")


if __name__ == "__main__":
    main()
