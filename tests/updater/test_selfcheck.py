"""The start-up self-check picks the fastest exact path on this host (judged by torch.sqrt
itself), falls back to torch.sqrt's roots, refuses an inexact one, and the kernels equal torch
without the JIT too (the plain-Python twins)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradtap.core.errors import GradtapError
from gradtap.updater import kernels, mkl_sqrt, selfcheck
from gradtap.workload.spec import OptimizerSpec
from tests.forked import Child
from tests.updater.roots import MKL_ROOTS, mkl_runs_here, torch_uses


def test_fast_roots_on_this_host():
    """The first reproduced MKL root (in the product's order) that torch.sqrt agrees with on
    a sample of the test's own, else torch.sqrt's roots; IEEE for fused."""
    want = next((root for root in MKL_ROOTS if torch_uses(root)), kernels.SQRT_TORCH)
    for impl in ("single_tensor", "foreach"):
        assert selfcheck.root_source(OptimizerSpec(implementation=impl)) == want
    assert selfcheck.root_source(OptimizerSpec(kind="adamw", implementation="fused",
                                               weight_decay=0.1)) == kernels.SQRT_IEEE


def test_the_root_mkl_runs_on_this_cpu_is_reproduced():
    """Where this CPU's MKL kernel is known (from its vendor and features), the product's
    probe finds exactly it, so the single-tensor updater takes one pass, not torch.sqrt's."""
    kernel, why = mkl_runs_here()
    if kernel is None:
        pytest.skip(why)
    reason = mkl_sqrt.missing(kernel)
    if reason:
        pytest.skip(reason)
    assert selfcheck.mkl_roots() == [kernel], why
    assert torch_uses(kernel), why


def test_without_an_mkl_root_the_roots_come_from_torch(monkeypatch, caplog):
    monkeypatch.setattr(selfcheck, "mkl_roots", lambda: [])
    cfg = OptimizerSpec(kind="adamw", implementation="single_tensor", weight_decay=0.01, lr=3e-3)
    selfcheck.root_source.cache_clear()
    try:
        assert selfcheck.root_source(cfg) == kernels.SQRT_TORCH
    finally:
        selfcheck.root_source.cache_clear()
    assert "takes its roots from torch.sqrt" in caplog.text


def test_an_inexact_kernel_is_refused(monkeypatch):
    real = kernels.step_constants

    def off_by_one_ulp(*args, **kwargs):
        c = real(*args, **kwargs)
        return c._replace(eps=np.nextafter(c.eps, np.float32(1)))

    monkeypatch.setattr(kernels, "step_constants", off_by_one_ulp)
    cfg = OptimizerSpec(kind="adam", eps=1e-3, implementation="foreach", lr=0.1)
    assert not selfcheck.probe_matches(cfg, kernels.SQRT_TORCH)
    selfcheck.root_source.cache_clear()
    try:
        with pytest.raises(GradtapError, match="cannot be replicated bit for bit on this host"):
            selfcheck.root_source(cfg)
    finally:
        selfcheck.root_source.cache_clear()


NO_JIT_SCRIPT = """
import numba, numpy as np
assert numba.config.DISABLE_JIT
from tests.updater.test_kernels import assert_same, run_both
from tests.updater.test_replica import assert_equal_state, drive, job
from gradtap.updater import kernels, mkl_sqrt, selfcheck
assert not any(mkl_sqrt.available(k) or mkl_sqrt.reproduces_torch(k) for k in mkl_sqrt.KERNELS)
assert selfcheck.mkl_roots() == []
for impl in ("single_tensor", "fused"):
    assert_same(*run_both(impl, "adamw-lowbeta", "bf16", 3, steps=3, sizes=[1, 9, 17],
                          sqrt=kernels.SQRT_TORCH if impl != "fused" else kernels.SQRT_IEEE))
replica, reference = drive(job(kind="adamw", weight_decay=0.1, clip=1e-3,
                               factory=("gradtap.workload.models:mlp", {"sizes": [5, 7, 3]})), iterations=3)
assert replica.root == kernels.SQRT_TORCH
assert_equal_state(replica, reference)
print("ok")
"""


@pytest.mark.slow
def test_kernels_equal_torch_without_the_jit():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", NO_JIT_SCRIPT], cwd=root, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, NUMBA_DISABLE_JIT="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"]


FRESH_SCRIPT = """
from gradtap.core.vector_math import settle_vector_math
print(settle_vector_math.cache_info().currsize)         # 0: the fork server has not settled MKL's vector math
from gradtap.updater import selfcheck
print(",".join(selfcheck.mkl_roots()) or "-")
"""
FRESH_PROCESSES = 12


@pytest.mark.slow
def test_every_fresh_process_finds_the_same_roots(tmp_path):
    """The self-check's answer is the host's, not the process's: MKL's vector math, set up by
    a parallel first call, gave one thread low-accuracy roots in about 1 process in 10 on a
    Xeon (``core/vector_math.py``), and that process took the slow torch.sqrt path. In 12
    fresh processes (torch's default threads: one per CPU; not set, which would start its
    thread pool before the first call), every one finds the roots this one does. They are
    forked from the tests' fork server (``tests/forked.py``), which has imported torch and
    gradtap but run no optimizer step or self-check, so has not settled MKL's vector math (each
    child checks that much): 12 interpreters took 41 s of a fresh-clone run."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: torch.sqrt runs on one thread, and its first call cannot race")
    procs = [Child(FRESH_SCRIPT, stderr=tmp_path / f"stderr{i}") for i in range(FRESH_PROCESSES)]
    answers = []
    for i, proc in enumerate(procs):
        with proc:
            code = proc.wait(600)
            assert code == 0, (tmp_path / f"stderr{i}").read_text()[-3000:]
            settled_before, roots = proc.stdout.read().split()
        assert settled_before == "0"
        answers.append(roots)
    assert answers == [",".join(selfcheck.mkl_roots()) or "-"] * FRESH_PROCESSES
