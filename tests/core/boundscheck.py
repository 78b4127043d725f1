"""Running a test file again with Numba's bounds checks on: a fresh interpreter with
``NUMBA_BOUNDSCHECK=1`` and a kernel cache of its own (:data:`CACHE`).

Numba reads the variable once, at import, so the file's tests that feed kernels hostile
input run a second time in a subprocess, where an out-of-bounds read raises ``IndexError``
instead of reading past a frame. The file skips the rerunning test itself there.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.core.no_jit import ROOT

# The kernels compiled with bounds checks, kept apart from the ones compiled without (which
# ``__pycache__`` beside the sources holds, and Numba's index does not tell apart): only a
# process with ``NUMBA_BOUNDSCHECK=1`` reads or writes here. The fuzz files share stage 1's
# kernels, so the second and third compile only their own (about 10 s each on a 2-core
# Xeon). ``gradtap.core.jit``'s source stamps make an edited kernel compile again.
CACHE = ROOT / "tests" / "__pycache__" / "numba-boundscheck"


def boundscheck_env() -> dict[str, str]:
    """``os.environ`` for a process whose kernels check every index (:data:`CACHE`)."""
    return dict(os.environ, NUMBA_BOUNDSCHECK="1", GRADTAP_JIT_CACHE="1", NUMBA_CACHE_DIR=str(CACHE))


def rerun_with_boundscheck(test_file: str, timeout: float = 880) -> str:
    """pytest's stdout for ``test_file`` rerun with bounds checks; the calling test fails
    unless it passed with exactly one test (the caller) skipped."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                         cwd=ROOT, env=boundscheck_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    assert "1 skipped" in out.stdout     # only the rerunning test is skipped there
    return out.stdout
