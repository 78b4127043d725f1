"""Running a test file again with Numba's bounds checks on: a fresh interpreter with
``NUMBA_BOUNDSCHECK=1`` and the kernel cache off (cached code was compiled without them).

Numba reads the variable once, at import, so the file's tests that feed kernels hostile
input run a second time in a subprocess, where an out-of-bounds read raises ``IndexError``
instead of reading past a frame. The file skips the rerunning test itself there.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.core.no_jit import ROOT


def rerun_with_boundscheck(test_file: str, timeout: float = 880) -> str:
    """pytest's stdout for ``test_file`` rerun with bounds checks; the calling test fails
    unless it passed with exactly one test (the caller) skipped."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", GRADTAP_JIT_CACHE="0")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    assert "1 skipped" in out.stdout     # only the rerunning test is skipped there
    return out.stdout
