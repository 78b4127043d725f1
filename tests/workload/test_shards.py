"""Bucket ownership in a mirror group: by size, and by what each node's streams carry."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from gradtap.core.errors import ConfigError
from gradtap.netconfig.ring import missing_chunk, stream_hops
from gradtap.workload.layout import job_plan
from gradtap.workload.shards import Shards, _cheapest, planned_coverage, planned_missing
from gradtap.workload.spec import MirrorGroupSpec, load_job, parse_job
ROOT = Path(__file__).resolve().parents[2]


def ring_job(mirrors):
    doc = load_job(ROOT / "configs" / "small.yaml").model_dump(mode="json", exclude_none=True)
    doc["ddp"]["bucket_cap_mb"] = 0.02            # a bucket per layer or so
    doc["model"]["kwargs"]["sizes"] = [128] * 14 + [10]
    doc["mirrors"] = [{"name": f"r{r}-{d}", "rank": r, "direction": d} for r, d in mirrors]
    return parse_job(doc)


EVERY = [(r, d) for r in range(4) for d in ("egress", "ingress", "both")]


def test_each_stream_lacks_the_chunk_its_ring_hop_never_carries():
    """netconfig/ring.py's account of NCCL's step order: hop h misses chunk h+1. Streams on the
    same hop lack the same blocks, streams on different hops disjoint ones; both directions
    of a port carry every block."""
    job = ring_job(EVERY)
    plan = job_plan(job)
    cov = planned_coverage(job, plan)
    lacking = {}
    for r, d in EVERY:
        hops = stream_hops(r, d, 4)
        if d == "both":
            assert cov[f"r{r}-both"].all()
            continue
        (hop,) = hops
        lacking.setdefault(missing_chunk(hop, 4), []).append(~cov[f"r{r}-{d}"])
    assert sorted(lacking) == [0, 1, 2, 3]
    for chunk, masks in lacking.items():
        assert all(np.array_equal(m, masks[0]) for m in masks) and masks[0].any(), chunk
    for a, b in itertools.combinations(lacking, 2):
        assert not (lacking[a][0] & lacking[b][0]).any()
    nbytes = plan.blocks["nelem"] * plan.elem_size
    share = nbytes[lacking[1][0]].sum() / nbytes.sum()
    assert 0.2 < share < 0.35                     # about a quarter (chunks of small buckets are uneven)


def brute(numels, missing, cap):
    """Every split of the buckets into contiguous ranges, node r the r-th: the least cost."""
    world, n = missing.shape
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), world - 1):
        bounds = [0, *cuts, n]
        owner = [r for r in range(world) for _ in range(bounds[r], bounds[r + 1])]
        loads = [sum(numels[bounds[r]:bounds[r + 1]]) for r in range(world)]
        if max(loads) > cap:
            continue
        cost = sum(int(missing[owner[b], b]) for b in range(n))
        best = cost if best is None else min(best, cost)
    return best


def test_the_cheapest_ranges_are_the_least_cost_of_every_split():
    rng = np.random.default_rng(2)
    for _ in range(60):
        world, n = int(rng.integers(1, 4)), int(rng.integers(1, 7))
        numels = [int(x) for x in rng.integers(1, 10, n)]
        missing = rng.integers(0, 5, (world, n)).astype(np.int64)
        cap = int(rng.integers(max(numels), sum(numels) + 1))
        cost, owner = _cheapest(numels, missing, cap)
        assert cost == brute(numels, missing, cap)
        if cost is None:
            continue
        assert cost == sum(int(missing[owner[b], b]) for b in range(n))
        assert owner == sorted(owner)
        assert max(sum(x for x, o in zip(numels, owner) if o == r) for r in range(world)) <= cap


def test_a_node_whose_streams_cover_its_buckets_owns_what_the_balance_allows():
    job = ring_job([(0, "egress"), (1, "egress"), (2, "egress"), (3, "egress")])
    plan = job_plan(job)
    assert len(plan.bucket_numels) >= 6
    placement = [["r1-egress", "r2-egress"], ["r0-egress"]]
    shards = Shards.covering(job, plan, placement)
    missing = planned_missing(job, plan, placement)
    assert not missing[0].any() and missing[1].all()
    balanced = Shards.balanced(plan.bucket_numels, 2)

    def cost(owner):
        return sum(int(missing[o, b]) for b, o in enumerate(owner))

    def loads(owner):
        return [sum(n for n, o in zip(plan.bucket_numels, owner) if o == r) for r in range(2)]
    assert cost(shards.owner) < cost(balanced.owner)
    assert loads(shards.owner)[0] > loads(balanced.owner)[0]          # the covering node takes more ...
    assert max(loads(shards.owner)) <= max(sum(plan.bucket_numels) * 1.1 / 2, max(loads(balanced.owner)))  # ... within the slack
    group = MirrorGroupSpec(rank=0, world_size=2, rendezvous="file:///tmp/x", streams=placement)
    assert Shards.of_group(job, plan, group) == shards
    assert Shards.of_group(job, plan, group.model_copy(update={"streams": ()})) == balanced
    assert shards.fingerprint != balanced.fingerprint
    # every node covering everything: the balanced cost (nothing), the least cap
    both = Shards.covering(job, plan, [["r0-egress", "r1-egress"], ["r2-egress", "r3-egress"]])
    assert max(loads(both.owner)) == max(loads(balanced.owner))


def test_placements_that_cannot_be_are_refused():
    job = ring_job([(0, "egress"), (1, "egress")])
    with pytest.raises(ConfigError, match=r"streams\[1\]: \['r9-egress'\] are not streams of the job"):
        Shards.covering(job, job_plan(job), [["r0-egress"], ["r9-egress"]])
    for streams, match in (([["a"]], "lists 1 nodes' streams; the group has 2"),
                           ([["a"], []], r"streams\[1\] is empty"),
                           ([["a"], ["a"]], "'a' is listed for ranks 0 and 1")):
        with pytest.raises(ValueError, match=match):
            MirrorGroupSpec(rank=0, world_size=2, rendezvous="file:///tmp/x", streams=streams)
