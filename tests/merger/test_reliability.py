"""The rate of unrecoverable iterations matches FlowCheck's Eq. (2), tightly enough to catch a 10% error in p.

FlowCheck (EuroSys '25), Eq. (2), for M mirrored egress streams of consecutive ranks of an
N-rank ring, K packets of gradient per iteration and mirror-link loss p:

    P(fail)_M = 1 - (1 - p^(M-1))^(M/N K) * (1 - p^M)^((N-M)/N K)

Our own analysis: the egress of ring position r carries every allgather chunk but r+1, so
with streams at positions 0..M-1 the M chunks 1..M reach M-1 streams and the other N-M reach
all M. A coverage block is lost when every mirrored link carrying it loses its packet, so,
with c_b the links carrying block b (a ``both`` stream is two links),

    q_b = p^(c_b),    P(fail) = 1 - prod_b (1 - q_b),    lost blocks per iteration = sum_b Bernoulli(q_b).

Eq. (2) is this formula when every chunk has K/N blocks; here chunks differ slightly in size
(a bucket rarely divides evenly), so the measurements are compared with the exact model, and
Eq. (2) (``gradtap.netconfig.reliability.p_fail_eq2``) is checked against the exact model.

Two statistics, both exact (no normal approximation), at significance ALPHA each:

1. **Unrecoverable iterations** (the quantity Eq. (2) predicts): failures ~ Binomial(n,
   P(fail)), two-sided exact test, with p chosen so that P(fail) is about 0.6.
2. **Lost blocks** (what Eq. (2) is built from): their total over n iterations has the
   n-fold convolution of the Poisson-binomial law of the q_b; two-sided exact test, on
   streams with a higher p so that each iteration loses many blocks.

A failure indicator carries little information about p (a 10% error in p moves P(fail)
from 0.60 to about 0.67; telling those apart at ALPHA takes thousands of iterations), while
the lost-block count carries much more: for every M the test computes the power of statistic
2 against p x 1.1 and p x 0.9, requires it to be at least MIN_POWER, and checks that the
observed counts do reject those wrong models. So an appliance whose effective loss is 10%
off (a merger ignoring a stream's copy, a parser dropping a neighbour of every lost
packet, ...) fails here.

M = 1 is tested meaningfully twice: one ``both`` stream covers every chunk (c_b = 1 or 2), so
most iterations must be recovered; one egress stream misses a chunk (c_b = 0: those blocks are
lost with probability 1), so every iteration fails, but with exactly the blocks the model says,
not with everything. An appliance that loses everything fails both.

All streams come from one simulation: several mirrors of the same port with their own loss
rates (the simulator draws each mirror path's faults independently), replayed in subsets.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradtap.netconfig.reliability import p_fail_eq2
from gradtap.replay import replay
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import parse_job
from gradtap.workload.wire_plan import DATA, PHASE_AG

N = 4
ITERATIONS = 200
ALPHA = 1e-3
MIN_POWER = 0.999
P_BLOCKS = 0.4          # loss rate of the streams for the lost-block statistic
TARGET_FAIL = 0.6       # P(fail) the rate streams are tuned to

#: Mirror streams: name -> (ring position, direction). Each group is replayed on its own.
RATE = {3: {"a0": (0, "egress"), "a1": (1, "egress"), "a2": (2, "egress")},
        2: {"c0": (0, "egress"), "c1": (1, "egress")},
        1: {"d0": (0, "both")}}
BLOCKS = {3: {"b0": (0, "egress"), "b1": (1, "egress"), "b2": (2, "egress")},
          2: {"b0": (0, "egress"), "b1": (1, "egress")},
          1: {"e0": (0, "both")}}
ONE_EGRESS = {"b0": (0, "egress")}


def job_with(mirrors: dict[str, tuple[int, str]]):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:02:{i + 1:02x}"} for i in range(N)]
    return parse_job({
        "name": "rel", "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [64, 200, 8]}},
        "ddp": {"bucket_cap_mb": 1}, "optimizer": {"kind": "adam"},
        "nccl": {"protocol": "Simple", "channels": 1, "mtu": 1024},
        "ring": {"ranks": ranks}, "training": {"batch_size": 2},
        "mirrors": [{"name": name, "rank": r, "direction": d} for name, (r, d) in mirrors.items()],
    })


def links_carrying(plan, mirrors: dict[str, tuple[int, str]]) -> np.ndarray:
    """c_b: how many mirrored links (flows) carry each coverage block."""
    count = np.zeros(len(plan.blocks), np.int64)
    msgs = plan.messages
    for rank, direction in mirrors.values():
        for flow in plan.flows_of(rank, direction):
            ag = msgs[(msgs["flow"] == flow) & (msgs["kind"] == DATA) & (msgs["phase"] == PHASE_AG)
                      & (msgs["block"] >= 0)]
            mine = np.zeros(len(plan.blocks), bool)
            for w in ag:
                mine[w["block"]:w["block"] + w["npkts"]] = True
            count += mine
    return count


def block_loss(carried: np.ndarray, p: float) -> np.ndarray:
    """q_b = p ** c_b (1 where no link carries the block)."""
    return np.where(carried == 0, 1.0, p ** carried.astype(float))


def p_fail_exact(carried: np.ndarray, p: float) -> float:
    q = block_loss(carried, p)
    return 1.0 if (q >= 1).any() else -math.expm1(float(np.sum(np.log1p(-q))))


def loss_for(carried: np.ndarray, target: float) -> float:
    lo, hi = 1e-6, 0.5
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if p_fail_exact(carried, p) < target else (lo, p)
    return round(p, 4)


# -- exact distributions ------------------------------------------------------------------------------

def binomial_pmf(n: int, prob: float) -> np.ndarray:
    k = np.arange(n + 1)
    if prob <= 0 or prob >= 1:
        return (k == (0 if prob <= 0 else n)).astype(float)
    logc = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k])
    return np.exp(logc + k * math.log(prob) + (n - k) * math.log1p(-prob))


def lost_blocks_pmf(q: np.ndarray, n: int) -> np.ndarray:
    """PMF of the lost-block total over ``n`` independent iterations (block b lost with q_b)."""
    one = np.array([1.0])
    for qb in q:
        one = np.convolve(one, [1.0 - qb, qb])
    total, power = np.array([1.0]), one
    while n:                                   # n-fold convolution by squaring
        if n & 1:
            total = np.convolve(total, power)
        power, n = np.convolve(power, power), n >> 1
    return total


def acceptance(pmf: np.ndarray, alpha: float) -> tuple[int, int]:
    """Smallest and largest count a two-sided test at ``alpha`` accepts (equal tails)."""
    cdf, sf = np.cumsum(pmf), np.cumsum(pmf[::-1])[::-1]
    ok = np.flatnonzero(2 * np.minimum(cdf, sf) >= alpha)
    return int(ok[0]), int(ok[-1])


def power(pmf_alternative: np.ndarray, region: tuple[int, int]) -> float:
    return 1.0 - float(pmf_alternative[region[0]:region[1] + 1].sum())


# -- the run ------------------------------------------------------------------------------------------

class Counter:
    def __init__(self):
        self.reports = []

    def bucket(self, iteration, bucket, data):
        pass

    def iteration_done(self, iteration, report):
        self.reports.append(report)


def all_streams() -> dict[str, tuple[int, str]]:
    streams = {}
    for group in (*RATE.values(), *BLOCKS.values(), ONE_EGRESS):
        streams.update(group)
    return streams


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """One simulation holding every stream, with each stream's loss rate."""
    out = tmp_path_factory.mktemp("reliability")
    streams = all_streams()
    job = job_with(streams)
    plan = job_plan(job)
    rates = {m: loss_for(links_carrying(plan, group), TARGET_FAIL) for m, group in RATE.items()}
    loss = {name: P_BLOCKS for name in streams}
    for m, group in RATE.items():
        loss.update({name: rates[m] for name in group})
    faults = ",".join(f"{name}.mirror_loss={p}" for name, p in loss.items())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # a tiny model: more threads only contend on a shared machine
    try:
        Simulation(job, out, iterations=ITERATIONS, seed=5, faults=parse_faults(faults, tuple(streams))).run()
    finally:
        torch.set_num_threads(threads)
    return job, plan, out, loss


def replayed(capture, mirrors: dict[str, tuple[int, str]]):
    """Per-iteration (failed, lost blocks) of replaying only ``mirrors``, after the first
    iteration (which lock-on may cut)."""
    job, plan, out, _ = capture
    sink = Counter()
    replay(job, plan, {name: out / "streams" / f"{name}.pcap" for name in mirrors}, sink)
    reports = sink.reports[1:]
    assert len(reports) >= ITERATIONS - 3
    failed = np.array([not r.recovered for r in reports])
    lost = np.array([sum(r.missing_blocks.values()) for r in reports])
    assert (failed == (lost > 0)).all(), "an iteration failed without a missing block, or the reverse"
    return failed, lost


def check_lost_blocks(carried: np.ndarray, p: float, lost: np.ndarray, what: str, sharp: bool = True) -> None:
    """The lost-block total is accepted at ALPHA; if ``sharp``, models 10% off in p are not."""
    n = len(lost)
    region = acceptance(lost_blocks_pmf(block_loss(carried, p), n), ALPHA)
    total = int(lost.sum())
    print(f"{what}: p={p}: {total} blocks lost in {n} iterations; accepted {region}")
    assert region[0] <= total <= region[1], (what, p, total, region)
    for wrong in (p * 1.1, p * 0.9) if sharp else ():
        alternative = lost_blocks_pmf(block_loss(carried, wrong), n)
        pw = power(alternative, region)
        print(f"    power against p={wrong:.4f}: {pw:.6f}")
        assert pw >= MIN_POWER, (what, wrong, pw)
        wrong_region = acceptance(alternative, ALPHA)
        assert not wrong_region[0] <= total <= wrong_region[1], f"{what}: the data do not reject p={wrong}"


def check_failures(carried: np.ndarray, p: float, failed: np.ndarray, what: str) -> None:
    n = len(failed)
    predicted = p_fail_exact(carried, p)
    region = acceptance(binomial_pmf(n, predicted), ALPHA)
    count = int(failed.sum())
    pw = [power(binomial_pmf(n, p_fail_exact(carried, w)), region) for w in (p * 1.1, p * 0.9)]
    print(f"{what}: p={p}: {count}/{n} unrecoverable, exact model {predicted:.4f} -> accepted {region}; "
          f"power against p x 1.1 / x 0.9: {pw[0]:.3f} / {pw[1]:.3f}")
    assert region[0] <= count <= region[1], (what, p, count, n, predicted, region)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3])
def test_unrecoverable_rate_matches_eq2(capture, m):
    job, plan, out, loss = capture
    rate_streams, block_streams = RATE[m], BLOCKS[m]
    carried = links_carrying(plan, rate_streams)
    p = loss[next(iter(rate_streams))]
    predicted = p_fail_exact(carried, p)
    assert 0.4 < predicted < 0.8, predicted
    if m > 1:       # Eq. (2) describes M egress streams of distinct ranks
        k = len(plan.blocks)
        assert abs(p_fail_eq2(N, m, k, p) - predicted) <= 0.1 * predicted, (p_fail_eq2(N, m, k, p), predicted)
    else:           # one both stream: every block on one or two links, so most iterations recover
        assert set(carried) == {1, 2}
    failed, lost = replayed(capture, rate_streams)
    check_failures(carried, p, failed, f"M={m} {sorted(rate_streams)}")
    check_lost_blocks(carried, p, lost, f"M={m} {sorted(rate_streams)}", sharp=False)
    failed, lost = replayed(capture, block_streams)
    check_lost_blocks(links_carrying(plan, block_streams), P_BLOCKS, lost, f"M={m} {sorted(block_streams)}")


@pytest.mark.slow
def test_one_egress_stream_loses_exactly_the_chunk_it_never_carries(capture):
    """Eq. (2) at M = 1 is 1 for any p: the egress of position r never carries chunk r+1. Every
    iteration fails, but with that chunk's blocks plus the model's share of the others."""
    job, plan, out, loss = capture
    carried = links_carrying(plan, ONE_EGRESS)
    never = int((carried == 0).sum())
    assert 0 < never < len(carried) // 2
    assert p_fail_eq2(N, 1, len(carried), P_BLOCKS) == 1.0
    failed, lost = replayed(capture, ONE_EGRESS)
    assert failed.all()
    assert (lost >= never).all() and (lost < len(carried)).any()
    check_lost_blocks(carried, P_BLOCKS, lost, f"M=1 {sorted(ONE_EGRESS)}")
