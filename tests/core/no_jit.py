"""Running test code as plain Python: a fresh interpreter with ``NUMBA_DISABLE_JIT=1``.

Numba reads the variable once, at import, so a test that compares the compiled kernels with
their plain-Python run starts a subprocess for the latter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_without_jit(code: str, *args: str, timeout: float = 600) -> str:
    """The stdout of ``python -c code args...`` run from the checkout's root (so ``tests`` is
    importable) without the JIT; the calling test fails with the end of stderr if it fails."""
    out = subprocess.run([sys.executable, "-c", "import numba\nassert numba.config.DISABLE_JIT\n" + code, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, NUMBA_DISABLE_JIT="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
