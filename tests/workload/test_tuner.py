"""The tuner model (workload/tuner.py) against a literal re-computation of NCCL's formulas,
its behaviour in size, the LL128 switch, ``tuned()``, and a simulated ``protocol: auto`` job."""

from __future__ import annotations

import pytest

from gradtap.core.errors import ConfigError, PlanError
from gradtap.simulator.faults import parse_faults
from gradtap.simulator.run import Simulation
from gradtap.wire.protocol import Protocol
from gradtap.workload import tuner
from gradtap.workload.layout import job_buckets
from gradtap.workload.spec import parse_job
from tests.simulator.test_simulate import check_allgather_matches_truth, make_job


def ring_job(n, era="2.19", *, cc=90, nic=200, ppn=1, channels=2, protocol="auto", protocols=None, **tune):
    ranks = [{"ip": f"198.18.{i}.1", "mac": f"02:00:00:00:02:{i + 1:02x}"} for i in range(n)]
    nccl = {"era": era, "protocol": protocol, "channels": channels,
            "tuner": {"compute_capability": cc, "nic_gbps": nic, "ppn": ppn, **tune}}
    if protocols is not None:
        nccl["protocols"] = protocols
    return parse_job({"name": "tune", "model": {"factory": "gradtap.workload.models:mlp", "kwargs": {"sizes": [8, 4]}},
                      "nccl": nccl, "ring": {"ranks": ranks},
                      "mirrors": [{"name": "m", "rank": 0, "direction": "egress"}]})


def nccl_times(era, nranks, nnodes, cc, graph_channels, graph_bw, comm_channels, nbytes):
    """Ring allreduce times (us) of LL, LL128, Simple, typed out from src/graph/tuning.cc
    (ncclTopoTuneModel, ncclTopoGetAlgoTime) for one GPU per node, Intel CPUs, IB (latencyInter
    0), LL128 on; era '2.19' (v2.19.3-1), '2.22' (v2.22.3-1) or '2.30' (v2.30.7-1)."""
    ppn = nranks / nnodes
    nsteps = 2 * (nranks - 1)
    index2 = nnodes - 1 if nnodes <= 2 else 2
    bw = graph_channels * graph_bw
    ll_max = [39.0, 39.0, 20.4][index2]                                  # llMaxBws[0] (Intel, several nodes)
    per_ch = [36.7, 36.7, 36.7][index2] if cc >= 90 else [20.0, 20.0, 20.0][index2]
    if era == "2.19":
        bus = [min(ll_max, bw * 1.0 / 4.0), min(bw * (0.7 if ppn < 2 else 0.92), graph_channels * per_ch), bw]
        n_inter = 2 * nnodes
        inter = [2.7, 4.0, 14.0]                                         # hwLat[NET][RING]
    elif era == "2.22":
        bus = [min(ll_max, bw * .5), min(bw * (0.7 if ppn < 2 else 0.92), graph_channels * per_ch), bw]
        n_inter = 2 * nnodes
        inter = [2.7, 4.0, 14.0]
    else:
        bus = [min(ll_max, bw * .5), min(bw * 0.92, graph_channels * per_ch), bw]
        n_inter = 2 * (nnodes - 1)
        inter = [5.0, 8.5, 14] if ppn == 1 else [2.7, 4.0, 14.0]         # ppn 1: hwLat[NET][TREE]
    base = [6.6, 14.0, 8.4]
    intra = [1.0, 2.5, 5.7]                                              # hwLat[PCI][RING] (typeIntra LOC)
    overhead = [1.0, 1.0, 3.0]                                           # getNetOverhead Intel, x3 Simple
    times = []
    for p in range(3):
        algbw = bus[p] * nranks / nsteps
        lat = base[p] + (nsteps - n_inter) * max(intra[p], overhead[p]) + n_inter * inter[p]
        if p == 2 and nbytes // (comm_channels * nranks) >= 64:
            lat *= 1.4 if cc >= 80 else 1.9
        times.append(lat + nbytes / (1000 * algbw))
    return times


def nccl_choice(*args):
    times = nccl_times(*args)
    return ("LL", "LL128", "Simple")[min(range(3), key=lambda p: (times[p], p))]


def switch_points(choice, top=1 << 36):
    """Sizes where ``choice(nbytes)`` differs from ``choice(nbytes - 1)``, by a scan of powers
    of two and a bisection of each change."""
    points, lo = [], 1
    while lo < top:
        hi = lo * 2
        a, b = choice(lo), choice(hi)
        if a != b:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if choice(mid) == a:
                    lo = mid
                else:
                    hi = mid
            points.append((hi, b))
        lo = hi
    return points


# (nodes, compute capability, NIC Gb/s, the ring graph from search.cc by hand: channels x GB/s)
CONFIGS = [(2, 80, 200, 1, 24.0),    # speedArrayInter: 24 <= 25 GB/s, one channel; bw < 25: no duplication
           (8, 80, 200, 1, 24.0),
           (2, 90, 400, 2, 24.0),    # sm90: 48 <= 50 GB/s, one channel; ncclTopoDupChannels: 2 x 24
           (8, 90, 400, 2, 24.0),
           (8, 90, 200, 1, 24.0)]


@pytest.mark.parametrize("era", ["2.19", "2.22", "2.30"])
@pytest.mark.parametrize("nodes,cc,nic,gch,gbw", CONFIGS)
def test_crossovers_equal_a_literal_recomputation(era, nodes, cc, nic, gch, gbw):
    job = ring_job(nodes, era, cc=cc, nic=nic)
    assert tuner.ring_graph(job.nccl.tuner, tuner.era_tuning(job)) == (gch, gbw)
    expected = switch_points(lambda b: nccl_choice(era, nodes, nodes, cc, gch, gbw, 2, b))
    got = [(b, p.nccl_name) for b, p in tuner.crossovers(job, 1 << 36)[1:]]
    assert got == expected
    assert [p for _, p in got] == ["LL128", "Simple"]
    for size in (1, 4096, 1 << 20, 1 << 26):
        assert tuner.ring_model(job).choose(size).nccl_name == nccl_choice(era, nodes, nodes, cc, gch, gbw, 2, size)


def test_eras_differ_where_nccl_changed():
    points = {era: tuner.crossovers(ring_job(8, era, cc=90, nic=400)) for era in tuner.ERA_TUNING}
    assert points["2.19"] == points["2.20"] != points["2.21"] == points["2.22"] != points["2.23"]
    assert points["2.23"] == points["2.30"]


@pytest.mark.parametrize("era", sorted(tuner.ERA_TUNING))
@pytest.mark.parametrize("nodes,cc,nic", [(2, 80, 200), (8, 90, 400), (4, 70, 100), (16, 100, 800)])
def test_protocol_only_grows_with_size(era, nodes, cc, nic):
    model = tuner.ring_model(ring_job(nodes, era, cc=cc, nic=nic))
    rank = {Protocol.LL: 0, Protocol.LL128: 1, Protocol.SIMPLE: 2}
    sizes = [int(1.07 ** k) for k in range(400)]
    chosen = [rank[model.choose(s)] for s in sizes]
    assert chosen == sorted(chosen)
    assert chosen[0] == 0 and chosen[-1] == 2


@pytest.mark.parametrize("setting", [{"ll128": False}, {"gpu_nic_path": "PHB"}, {"ppn": 2, "nvlink": False}])
def test_ll128_disabled_is_never_chosen(setting):
    job = ring_job(8, "2.30", cc=90, nic=400, **setting)
    protocols = {p for _, p in tuner.crossovers(job)}
    assert Protocol.LL128 not in protocols and protocols == {Protocol.LL, Protocol.SIMPLE}


def test_ll128_default_follows_the_era():
    # Ada (89) is enabled by default only from 2.27 (v2.27.3-1: any compute capability >= 70);
    # Blackwell (100) from 2.25 (v2.25.1-1: case 100)
    for era, ada, blackwell in [("2.24", False, False), ("2.25", False, True), ("2.27", True, True)]:
        for cc, on in ((89, ada), (100, blackwell)):
            job = ring_job(4, era, cc=cc)
            assert tuner.ll128_enabled(job.nccl.tuner, tuner.era_tuning(job)) is on
    assert tuner.ll128_enabled(ring_job(4, "2.19", cc=90, gpu_nic_path="PXN").nccl.tuner, tuner.ERA_TUNING["2.19"])
    assert not tuner.ll128_enabled(ring_job(4, "2.19", cc=80, gpu_nic_path="PXN").nccl.tuner, tuner.ERA_TUNING["2.19"])


def test_tuned_fills_auto_and_leaves_explicit_protocols_alone():
    numels = [16, 1 << 18, 1 << 24]
    job = ring_job(4)
    assert tuner.tuned(job, numels).nccl.protocols == ("LL", "LL128", "Simple")
    explicit = ring_job(4, protocols=["Simple", "Simple", "LL"])
    assert tuner.tuned(explicit, numels) is explicit
    fixed = ring_job(4, protocol="LL")
    assert tuner.tuned(fixed, numels) is fixed


def test_unresolvable_jobs_name_the_field():
    with pytest.raises(PlanError, match="nccl.era"):
        tuner.ring_protocols(ring_job(4, "auto"), [1])
    with pytest.raises(ConfigError, match="nccl.tuner"):
        tuner.ring_protocols(ring_job(4, ppn=3), [1])
    with pytest.raises(ConfigError, match="graph_channels"):
        ring_job(4, graph_channels=2)


def test_simulator_refuses_era_auto(tmp_path):
    job = make_job(3, "auto", era="auto")
    with pytest.raises(ConfigError, match="nccl.era"):
        Simulation(job, tmp_path, iterations=1, seed=7, faults=None).run()
    assert not (tmp_path / "streams").exists()


def test_simulated_auto_job_carries_the_tuners_protocols(tmp_path):
    # A slow graph (1 channel of 0.5 GB/s) puts the LL -> Simple switch (11575 B) between the
    # two buckets of the small MLP (4264 B and 24576 B), so the tuner picks both; iteration 0's
    # single bucket of the initial layout (28840 B) is a Simple call of its own.
    job = make_job(3, "auto", tuner={"graph_channels": 1, "graph_bw": 0.5, "ll128": False})
    job = job.model_copy(update={"ddp": job.ddp.model_copy(update={"bucket_cap_mb": 0.004})})
    numels = [b.numel for b in job_buckets(job)]
    assert len(job_buckets(job, "initial")) == 1
    wire_job = tuner.tuned(job, numels)
    assert wire_job.nccl.protocols == ("LL", "Simple")
    Simulation(job, tmp_path, iterations=2, seed=7, faults=parse_faults("", ("m-egress", "m-ingress", "m-both"))).run()
    check_allgather_matches_truth(tmp_path, wire_job, 2)
