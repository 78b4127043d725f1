"""The kernel cache sees edits to the modules a kernel depends on, not only to its own file.

A throw-away package ``gradtap`` (its ``__init__`` and ``core/`` copied from this checkout,
plus a ``probe/`` subpackage) is run in fresh processes: ``probe/a.py`` holds a cached
kernel that calls a cached kernel of ``probe/b.py`` and reads a constant of ``probe/c.py``.
Numba's own check (the hash of ``a.py``) would load the first machine code forever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gradtap
import gradtap.core

A = '''from numba import njit
from gradtap.core.jit import JIT
from gradtap.probe.b import callee
from gradtap.probe.c import OFFSET

@njit(**JIT)
def caller(x):
    return callee(x) + OFFSET
'''
B = '''from numba import njit
from gradtap.core.jit import JIT

@njit(**JIT)
def callee(x):
    return x * {factor}
'''
C = "OFFSET = {offset}\n"
RUN = "from gradtap.probe.a import caller; print(caller(10))"


def _package(root: Path) -> Path:
    package = root / "gradtap"
    shutil.copytree(Path(gradtap.core.__file__).parent, package / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(gradtap.__file__, package / "__init__.py")
    probe = package / "probe"
    probe.mkdir()
    (probe / "__init__.py").write_text("")
    (probe / "a.py").write_text(A)
    return probe


def _run(root: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "GRADTAP_"))}
    env.update(PYTHONPATH=str(root), NUMBA_DEBUG_CACHE="1", NUMBA_CACHE_DIR=str(root / "cache"))
    out = subprocess.run([sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    result = int([line for line in lines if line.strip() and not line.startswith("[cache]")][-1])
    return result, out.stdout


def test_an_edit_to_a_callee_or_a_constant_in_another_module_is_compiled_again(tmp_path):
    probe = _package(tmp_path)
    (probe / "b.py").write_text(B.format(factor=2))
    (probe / "c.py").write_text(C.format(offset=1))
    result, log = _run(tmp_path)
    assert result == 21 and "data saved" in log
    result, log = _run(tmp_path)
    assert result == 21 and "data loaded" in log and "data saved" not in log   # the cache is used
    (probe / "b.py").write_text(B.format(factor=3))
    assert _run(tmp_path)[0] == 31
    (probe / "c.py").write_text(C.format(offset=5))
    result, log = _run(tmp_path)
    assert result == 35 and "data saved" in log


def test_a_thread_pinned_to_one_core_runs_its_kernels_on_one_thread():
    """``fit_threads``: Numba's count is per thread, and a pinned thread's is its cores."""
    import threading

    import numba

    from gradtap.core.jit import fit_threads
    cores = os.sched_getaffinity(0)
    seen = []

    def pinned():
        os.sched_setaffinity(0, {max(cores)})
        seen.append((fit_threads(), numba.get_num_threads()))

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen == [(1, 1)]
    assert os.sched_getaffinity(0) == cores, "pinning another thread moved this one"
    every = min(numba.config.NUMBA_NUM_THREADS, len(cores))
    thread = threading.Thread(target=lambda: seen.append((fit_threads(), numba.get_num_threads())))
    thread.start()
    thread.join()
    assert seen[1] == (every, every)
