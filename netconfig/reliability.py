"""Per-iteration probability that mirrored gradients cannot be recovered.

An iteration is lost when some allgather packet is dropped on every mirror link that
carries it. With mirror-link loss rate p (independent per link and packet), K allgather
packets per iteration spread evenly over the N chunks of the ring, and c_k mirrored
streams carrying chunk k, the exact coverage model is::

    P(fail) = 1 - prod_k (1 - p**c_k) ** (K / N)

FlowCheck (EuroSys '25) Eq. (2) is the special case of M egress streams of distinct
ranks, where M chunks are carried M-1 times and N-M chunks M times::

    P(fail)_M = 1 - (1 - p**(M-1)) ** (M/N * K) * (1 - p**M) ** ((N-M)/N * K)

Both are evaluated in log space with ``log1p``/``expm1``: ``1 - (1 - 1e-27)**1e7`` is 1e-20
exactly, but 0 when computed naively, since ``1 - 1e-27`` rounds to 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def _check(packets_per_iteration: float, loss_rate: float) -> None:
    if not packets_per_iteration > 0:
        raise ValueError(f"Invalid packets per iteration: {packets_per_iteration} (must be > 0)")
    if not 0 <= loss_rate < 1:
        raise ValueError(f"Invalid loss rate: {loss_rate} (must be in [0, 1))")


def _fail_from_log_success(log_success: float) -> float:
    return -math.expm1(log_success)


def p_fail_exact(coverage: Sequence[int], packets_per_iteration: float, loss_rate: float) -> float:
    """P(fail) of one iteration for chunk coverage ``coverage`` (c_k per chunk, length N)."""
    _check(packets_per_iteration, loss_rate)
    if not coverage:
        raise ValueError("Invalid coverage: empty (one count per chunk is needed)")
    if min(coverage) <= 0:
        return 1.0
    per_chunk = packets_per_iteration / len(coverage)
    return _fail_from_log_success(sum(per_chunk * math.log1p(-(loss_rate**c)) for c in coverage))


def p_fail_eq2(n_ranks: int, n_streams: int, packets_per_iteration: float, loss_rate: float) -> float:
    """FlowCheck Eq. (2): M = ``n_streams`` egress streams of distinct ranks of an N-rank ring."""
    _check(packets_per_iteration, loss_rate)
    if not 1 <= n_streams <= n_ranks:
        raise ValueError(f"Invalid stream count: {n_streams} (must be in 1..{n_ranks})")
    if n_streams == 1:
        return 1.0
    m, n, k = n_streams, n_ranks, packets_per_iteration
    log_success = (m / n * k) * math.log1p(-(loss_rate ** (m - 1)))
    log_success += ((n - m) / n * k) * math.log1p(-(loss_rate**m))
    return _fail_from_log_success(log_success)


def p_any_fails(probabilities: Iterable[float]) -> float:
    """Probability that at least one of independent events with these probabilities happens."""
    log_none = 0.0
    for p in probabilities:
        if p >= 1.0:
            return 1.0
        log_none += math.log1p(-p)
    return _fail_from_log_success(log_none)


def iterations_between_failures(p_fail: float) -> float:
    """Expected iterations until the first unrecoverable one (geometric: 1/p; inf if p = 0)."""
    return math.inf if p_fail <= 0 else 1.0 / p_fail
