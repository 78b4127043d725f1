import itertools

import pytest

from gradtap.netconfig.ring import chunk_coverage, missing_chunk, stream_hops
from tests.netconfig.naive_ring import allgather_chunks_sent, coverage_by_replay


@pytest.mark.parametrize("nranks", range(2, 11))
def test_each_hop_misses_exactly_the_chunk_after_its_sender(nranks):
    for hop in range(nranks):
        assert allgather_chunks_sent(hop, nranks) == set(range(nranks)) - {missing_chunk(hop, nranks)}


def test_stream_hops_follow_the_nic_view():
    assert stream_hops(3, "egress", 8) == (3,)   # rank 3 transmits on link 3 -> 4
    assert stream_hops(3, "ingress", 8) == (2,)  # rank 3 receives link 2 -> 3
    assert stream_hops(0, "ingress", 8) == (7,)
    assert stream_hops(0, "both", 8) == (0, 7)


@pytest.mark.parametrize("nranks", [2, 3, 5, 8])
def test_coverage_matches_the_replayed_schedule(nranks):
    for size in range(1, 4):
        for hops in itertools.combinations_with_replacement(range(nranks), size):
            assert chunk_coverage(nranks, hops) == coverage_by_replay(nranks, list(hops))


def test_distinct_egress_streams_carry_every_chunk_at_least_m_minus_1_times():
    for hops in itertools.combinations(range(8), 3):
        coverage = chunk_coverage(8, hops)
        assert sorted(coverage) == [2, 2, 2, 3, 3, 3, 3, 3]


def test_both_ends_of_one_link_repeat_its_gap():
    hops = stream_hops(2, "egress", 8) + stream_hops(3, "ingress", 8)
    assert chunk_coverage(8, hops)[3] == 0
