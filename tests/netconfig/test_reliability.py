import math

import numpy as np
import pytest

from gradtap.netconfig.reliability import iterations_between_failures, p_any_fails, p_fail_eq2, p_fail_exact
from gradtap.netconfig.ring import chunk_coverage

N, K, P = 8, 16e6, 1e-9  # FlowCheck's worked example


def test_flowcheck_example_two_streams_fail_about_every_250_iterations():
    assert p_fail_eq2(N, 2, K, P) == pytest.approx(4e-3, rel=0.01)


def test_flowcheck_example_three_streams_fail_about_6e_minus_12():
    assert p_fail_eq2(N, 3, K, P) == pytest.approx(6e-12, rel=1e-6)


def test_the_three_stream_figure_needs_log_space():
    naive = 1 - (1 - P**2) ** (3 / N * K) * (1 - P**3) ** (5 / N * K)
    assert naive == 0.0  # 1 - 1e-18 rounds to 1: the naive formula loses the answer entirely


@pytest.mark.parametrize("m", [2, 3, 4, 8])
def test_exact_model_equals_eq2_for_distinct_egress_streams(m):
    coverage = chunk_coverage(N, range(m))
    assert p_fail_exact(coverage, K, P) == pytest.approx(p_fail_eq2(N, m, K, P), rel=1e-12)


def test_exact_model_edge_cases():
    assert p_fail_exact([0, 2, 2], 30, 0.1) == 1.0
    assert p_fail_exact([1, 1], 10, 0.0) == 0.0
    assert iterations_between_failures(0.0) == math.inf
    assert iterations_between_failures(4e-3) == pytest.approx(250)
    assert p_any_fails([0.5, 0.5]) == pytest.approx(0.75)
    assert p_any_fails([1e-12] * 1000) == pytest.approx(1e-9, rel=1e-6)
    assert p_any_fails([0.1, 1.0]) == 1.0


def test_invalid_arguments_name_the_value():
    with pytest.raises(ValueError, match="Invalid loss rate: 1.5"):
        p_fail_exact([1], 10, 1.5)
    with pytest.raises(ValueError, match="Invalid packets per iteration: 0"):
        p_fail_eq2(8, 3, 0, 1e-9)
    with pytest.raises(ValueError, match="Invalid stream count: 9"):
        p_fail_eq2(8, 9, 10, 1e-9)


def test_exact_model_against_monte_carlo():
    """Drop every packet copy independently and count iterations with a packet lost on all its streams."""
    rng = np.random.default_rng(7)
    nranks, packets_per_chunk, loss, trials = 4, 2, 0.3, 200_000
    coverage = chunk_coverage(nranks, [0, 1])  # [2, 1, 1, 2]
    lost_everywhere = np.zeros(trials, dtype=bool)
    for copies in coverage:
        drops = rng.random((trials, packets_per_chunk, copies)) < loss
        lost_everywhere |= drops.all(axis=2).any(axis=1)
    expected = p_fail_exact(coverage, nranks * packets_per_chunk, loss)
    sigma = math.sqrt(expected * (1 - expected) / trials)
    assert abs(lost_everywhere.mean() - expected) < 5 * sigma
