"""The rate of unrecoverable iterations matches FlowCheck's Eq. (2).

FlowCheck (EuroSys '25), Eq. (2), for M mirrored egress streams of consecutive ranks of an
N-rank ring, K packets of gradient per iteration and mirror-link loss p:

    P(fail)_M = 1 - (1 - p^(M-1))^(M/N K) * (1 - p^M)^((N-M)/N K)

Our own analysis: the egress of ring position r carries every allgather chunk but r+1, so
with streams at positions 0..M-1 the M chunks 1..M reach M-1 streams and the other N-M reach
all M. A coverage block is lost when every stream carrying it loses its packet, so exactly

    P(fail) = 1 - prod over blocks b of (1 - p^(c_b)),   c_b = streams carrying b.

Eq. (2) is this formula when every chunk has K/N blocks. Here chunks differ slightly in size
(a bucket rarely divides evenly), so the test compares the measured rate with the exact
model, and checks that Eq. (2) with K = the job's blocks agrees with it closely.
"""

import math

import numpy as np
import pytest

from gradtap.replay import replay
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import DATA, PHASE_AG

N = 4


def job_with(m: int):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:02:{i + 1:02x}"} for i in range(N)]
    return parse_job({
        "name": f"rel{m}", "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [64, 200, 8]}},
        "ddp": {"bucket_cap_mb": 1}, "optimizer": {"kind": "adam"},
        "nccl": {"protocol": "Simple", "channels": 1, "mtu": 1024},
        "ring": {"ranks": ranks}, "training": {"batch_size": 2},
        "mirrors": [{"name": f"r{r}", "rank": r, "direction": "egress"} for r in range(m)],
    })


def carried_by(plan, m: int) -> np.ndarray:
    """How many of the M egress streams carry each coverage block."""
    count = np.zeros(len(plan.blocks), np.int64)
    msgs = plan.messages
    for r in range(m):
        flows = plan.flows_of(r, "egress")
        ag = msgs[np.isin(msgs["flow"], flows) & (msgs["kind"] == DATA) & (msgs["phase"] == PHASE_AG)
                  & (msgs["block"] >= 0)]
        mine = np.zeros(len(plan.blocks), bool)
        for w in ag:
            mine[w["block"]:w["block"] + w["npkts"]] = True
        count += mine
    return count


def p_fail_exact(carried: np.ndarray, p: float) -> float:
    if (carried == 0).any():
        return 1.0                       # a block no stream carries is always lost
    return -math.expm1(float(np.sum(np.log1p(-(p ** carried.astype(float))))))


def p_fail_eq2(n: int, m: int, k: int, p: float) -> float:
    return 1 - (1 - p ** (m - 1)) ** (m / n * k) * (1 - p ** m) ** ((n - m) / n * k)


class Counter:
    def __init__(self):
        self.reports = []

    def bucket(self, iteration, bucket, data):
        pass

    def iteration_done(self, iteration, report):
        self.reports.append(report)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3])
def test_unrecoverable_rate_matches_eq2(tmp_path, m):
    job = job_with(m)
    plan = job_plan(job)
    carried = carried_by(plan, m)
    # The loss rate at which the model predicts about one failed iteration in three, so
    # that a few hundred iterations measure the rate to within a few percent.
    lo, hi = 1e-6, 0.5
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if p_fail_exact(carried, p) < 0.33 else (lo, p)
    p = round(p, 4)
    exact = p_fail_exact(carried, p)
    k = len(plan.blocks)
    assert abs(p_fail_eq2(N, m, k, p) - exact) <= 0.1 * exact + 1e-9
    iterations = 300
    Simulation(job, tmp_path, iterations=iterations, seed=5,
               faults=parse_faults(f"mirror_loss={p}", tuple(s.name for s in job.mirrors))).run()
    sink = Counter()
    replay(job, plan, {s.name: tmp_path / "streams" / f"{s.name}.pcap" for s in job.mirrors}, sink)
    reports = sink.reports[1:]            # the first may be cut by lock-on
    n = len(reports)
    assert n >= iterations - 3
    failed = sum(not r.recovered for r in reports)
    sigma = math.sqrt(n * exact * (1 - exact))
    print(f"M={m} p={p}: {failed}/{n} unrecoverable, exact model {exact:.4f}, Eq. 2 {p_fail_eq2(N, m, k, p):.4f}")
    assert abs(failed - n * exact) <= 4 * sigma + 1, (m, p, failed, n, exact)
