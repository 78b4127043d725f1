"""An AVX-512 host also runs the updater's AVX2 paths, the ones a host without AVX-512 takes.

The suite on such a host exercises what it dispatches to by default: torch's AVX-512 kernels
(``CPU capability usage: AVX512``) and Numba code compiled for the host's features. A host
without AVX-512 takes the other path everywhere: torch's AVX2 build of its kernels (the
fused Adam among them) and Numba code without AVX-512 instructions. Both can run here, so
both are tested here: a subprocess with ``ATEN_CPU_CAPABILITY=avx2`` (torch's dispatch) and
``NUMBA_CPU_NAME=haswell`` with the host's features less every AVX-512 one
(``NUMBA_CPU_FEATURES``, which ``updater.intrinsics.has_feature`` asks as Numba compiles by
it) runs the kernels-equal-torch tests and the start-up self-check. MKL still picks its square
root from the CPU itself, so the roots are this host's; which one the product takes is
checked against torch either way. On a host without AVX-512 the default run is this path
already, and the test says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llvmlite import binding as llvm

ROOT = Path(__file__).resolve().parents[2]


def _avx2_features() -> str:
    """The host's features as LLVM names them, every AVX-512 one turned off."""
    return ",".join(("-" + f[1:]) if f[1:].startswith("avx512") else f
                    for f in llvm.get_host_cpu_features().flatten().split(","))


@pytest.mark.slow
def test_the_avx2_paths_equal_torch_on_an_avx512_host(tmp_path):
    if "+avx512f" not in llvm.get_host_cpu_features().flatten().split(","):
        pytest.skip("this host has no AVX-512: the suite's default run takes the AVX2 paths already")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "NUMBA_CPU_NAME": "haswell",
           "NUMBA_CPU_FEATURES": _avx2_features(), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from gradtap.updater.intrinsics import has_feature; "
                               "print(torch.backends.cpu.get_cpu_capability(), has_feature('avx512f'), "
                               "has_feature('avx2'))"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.split() == ["AVX2", "False", "True"], probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/updater/test_kernels.py", "-k", "equals_torch or torch_root_path or many_steps",
         "tests/updater/test_selfcheck.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]
