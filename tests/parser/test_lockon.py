"""Lock-on's alignment candidates: a flow's writes narrowed together equal them narrowed one by one.

``LockOn._narrow_writes`` checks a resolved flow's writes in one array expression and falls
back to ``_narrow`` from the first write that does not keep its candidate. Whatever the
writes (the plan's, lengths the plan lacks, writes that contradict the candidate, PSNs
that wrap), the candidates, reference PSN and span must be those of ``_narrow`` taken
write by write.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradtap.parser import lockon as lockon_module
from gradtap.parser.flow_learning import FlowLearner
from gradtap.parser.lockon import LockOn
from gradtap.parser.stream_tables import stream_tables
from gradtap.workload.layout import job_plan
from gradtap.workload.spec import load_job

ROOT = Path(__file__).resolve().parents[2]


def lockon():
    job = load_job(ROOT / "configs" / "small.yaml")
    t = stream_tables(job, job_plan(job), job.mirrors[0])
    return LockOn(t, 1_000_000, FlowLearner(t, False))


def writes(lock, f, rng, n, base, wrong_share):
    """``n`` writes of flow ``f`` as the plan has them from iteration base PSN ``base`` (a
    random mirror loss between), with ``wrong_share`` of them replaced by a length the plan
    has elsewhere or none at all."""
    t = lock.tables
    m = t.messages[t.msg_start[f]:t.msg_start[f] + t.msg_count[f]]
    period = int(t.period[f])
    k = np.sort(rng.choice(len(m) * 3, size=min(n, len(m) * 3), replace=False))
    psn = (base + (k // len(m)) * period + m["psn_offset"][k % len(m)]) % (1 << 24)
    length = m["wire_bytes"][k % len(m)].astype(np.uint32)
    wrong = rng.random(len(k)) < wrong_share
    length[wrong] = rng.choice([*np.unique(m["wire_bytes"]).tolist(), 12345], wrong.sum())
    return psn.astype(np.uint32), length


@pytest.mark.parametrize("cells", [None, 5], ids=["whole", "in-chunks"])
@pytest.mark.parametrize("seed", range(6))
def test_writes_narrowed_together_equal_them_one_by_one(seed, cells, monkeypatch):
    if cells is not None:      # the comparisons made a few writes at a time, as for a long plan
        monkeypatch.setattr(lockon_module, "MAX_CELLS", cells)
    rng = np.random.default_rng(seed)
    one, many = lockon(), lockon()
    f = int(one.tables.data_flows[seed % len(one.tables.data_flows)])
    base = int(rng.integers(1 << 24)) if seed % 2 else (1 << 24) - 40       # wraps past 2**24
    period = int(one.tables.period[f])
    for batch in range(4):         # each batch three iterations on from the last
        psn, length = writes(one, f, rng, int(rng.integers(1, 60)), base + 3 * batch * period,
                             0.0 if batch < 2 else 0.2)
        for p, n in zip(psn.tolist(), length.tolist()):
            one._narrow(f, p, n)
        many._narrow_writes(f, psn, length)
        assert (one.candidates, one.ref, one.span) == (many.candidates, many.ref, many.span), batch


def test_a_resolved_flow_that_the_writes_contradict_is_narrowed_as_before():
    rng = np.random.default_rng(7)
    one, many = lockon(), lockon()
    f = int(one.tables.data_flows[-1])
    psn, length = writes(one, f, rng, 40, 1000, 0.0)
    for lock in (one, many):
        lock._narrow(f, int(psn[0]), int(length[0]))
        lock.candidates[f] = {1}          # a base one packet off: no planned write starts there
    for p, n in zip(psn.tolist(), length.tolist()):
        one._narrow(f, p, n)
    many._narrow_writes(f, psn, length)
    assert (one.candidates, one.span) == (many.candidates, many.span)
    assert one.candidates[f] != {1}
