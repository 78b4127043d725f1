"""Running test files again with Numba's bounds checks on: a fresh interpreter with
``NUMBA_BOUNDSCHECK=1`` and a kernel cache of its own (:data:`CACHE`).

Numba reads the variable once, at import, so the files whose tests feed kernels hostile input
run a second time in a subprocess (``tests/parser/test_under_boundscheck.py``), where an
out-of-bounds read raises ``IndexError`` instead of reading past a frame.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.core.no_jit import ROOT

# The kernels compiled with bounds checks, kept apart from the ones compiled without (which
# ``__pycache__`` beside the sources holds, and Numba's index does not tell apart): only a
# process with ``NUMBA_BOUNDSCHECK=1`` reads or writes here. A fresh clone compiles them in the
# suite's run, about 40 s on a 2-core AMD EPYC; ``gradtap.core.jit``'s source stamps make an
# edited kernel compile again.
CACHE = ROOT / "tests" / "__pycache__" / "numba-boundscheck"


def boundscheck_env() -> dict[str, str]:
    """``os.environ`` for a process whose kernels check every index (:data:`CACHE`)."""
    return dict(os.environ, NUMBA_BOUNDSCHECK="1", GRADTAP_JIT_CACHE="1", NUMBA_CACHE_DIR=str(CACHE))


def rerun_with_boundscheck(*test_files: str, timeout: float = 880) -> str:
    """pytest's stdout for ``test_files`` rerun in one interpreter with bounds checks, so that
    the kernels they share compile once; the calling test fails unless every test there ran
    and passed (the caller lives outside the files it reruns, so nothing is skipped)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *test_files],
                         cwd=ROOT, env=boundscheck_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    assert "skipped" not in out.stdout, out.stdout[-2000:]
    return out.stdout
