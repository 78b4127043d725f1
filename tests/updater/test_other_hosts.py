"""One host also runs the updater's paths of the hosts it is not, and each equals torch there.

A subprocess plays each kind of host (``benchmarks/_hosts.py``: torch, Numba and MKL each told
to take a lesser path) and runs the root, kernel and gradient-norm tests and the start-up
self-check there, against that subprocess's own torch:

- an Intel CPU with AVX2 and no AVX-512 (a Xeon E5 v4, a desktop): MKL's AVX2 root;
- a CPU on which MKL takes its SSE root (the AMD EPYC this project met, any non-Intel x86).

A host that cannot play one (no AVX2 or FMA to compile for, or an MKL that keeps its own
choice) skips it, saying so. A host that *is* that kind (no AVX-512, and MKL takes that root
unasked) skips it too: the suite's own updater tests run those paths there, as they are, and
playing it again took 98-127 s of a fresh-clone run on the AMD EPYC.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._hosts import PLAYED, can_play, host_features, played_env
from gradtap.updater import mkl_sqrt
from tests.updater.roots import mkl_runs_here

ROOT = Path(__file__).resolve().parents[2]
ROOTS = {"intel-avx2": mkl_sqrt.AVX2, "mkl-sse": mkl_sqrt.SSE}   # the MKL root torch.sqrt then is


@pytest.fixture(scope="module")
def numba_cache(tmp_path_factory) -> Path:
    """One Numba cache for every played host: they compile for the same CPU."""
    return tmp_path_factory.mktemp("numba")


@pytest.mark.slow
@pytest.mark.parametrize("host", PLAYED)
def test_the_paths_of_another_host_equal_torch(host, numba_cache):
    reason = can_play()
    if reason:
        pytest.skip(reason)
    instructions, root = PLAYED[host], ROOTS[host]
    if "+avx512f" not in host_features() and mkl_runs_here()[0] == root:
        pytest.skip(f"this host is a {host} host (no AVX-512, MKL's {mkl_sqrt.KERNELS[root].symbol} "
                    f"unasked): the suite's own updater tests run its paths")
    if mkl_runs_here(instructions)[0] != root:
        pytest.skip(f"MKL on this CPU does not run {mkl_sqrt.KERNELS[root].symbol} under "
                    f"MKL_ENABLE_INSTRUCTIONS={instructions}")
    env = played_env(host, str(numba_cache))
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from gradtap.core.jit import has_feature; "
                               "from gradtap.updater.selfcheck import mkl_roots; "
                               "print(torch.backends.cpu.get_cpu_capability(), has_feature('avx512f'), "
                               "has_feature('avx2'), *mkl_roots())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.split()[:3] == ["AVX2", "False", "True"], probe.stdout + probe.stderr
    assert probe.stdout.split()[3:] == [root], probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/updater/test_mkl_sqrt.py", "tests/updater/test_kernels.py", "tests/updater/test_selfcheck.py",
         "tests/updater/test_norms.py",
         "-k", f"({root} or ieee or torch_root_path or not_this_hosts or test_selfcheck or test_norms) "
               "and not fresh_process"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1]
    assert " passed" in summary, run.stdout[-2000:]
    assert f"not MKL's {mkl_sqrt.KERNELS[root].symbol}" not in run.stdout, run.stdout[-2000:]
