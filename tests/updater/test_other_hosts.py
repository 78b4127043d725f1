"""One host also runs the updater's paths of the hosts it is not, and each equals torch there.

What a host runs is chosen in three places, each from the CPU: torch's ATen kernels (the
fused Adam among them: AVX-512 or AVX2 builds), Numba's code (the host's features), and
MKL's square root behind ``torch.sqrt`` (``updater/mkl_sqrt.py``: AVX-512, AVX2 or SSE
kernel). Each can be told to take a lesser path: ``ATEN_CPU_CAPABILITY=avx2``,
``NUMBA_CPU_NAME=haswell`` with the host's features less every AVX-512 one
(``NUMBA_CPU_FEATURES``, which ``updater.intrinsics.has_feature`` asks as Numba compiles by
it), and ``MKL_ENABLE_INSTRUCTIONS`` (Intel's documented switch; MKL honours it on Intel
CPUs). So a subprocess plays each kind of host and runs the root and kernel tests and the
start-up self-check there, against that subprocess's own torch:

- an Intel CPU with AVX2 and no AVX-512 (a Xeon E5 v4, a desktop): MKL's AVX2 root;
- a CPU on which MKL takes its SSE root (the AMD EPYC this project met, any non-Intel x86).

A host that cannot play one (no AVX2 or FMA to compile for, or an MKL that keeps its own
choice) skips it, saying so; a host that *is* that kind runs it as its default already.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llvmlite import binding as llvm

from gradtap.updater import mkl_sqrt
from tests.updater.roots import mkl_runs_here

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {  # played host: (MKL_ENABLE_INSTRUCTIONS, the MKL root torch.sqrt then is)
    "intel-avx2": ("AVX2", mkl_sqrt.AVX2),
    "mkl-sse": ("SSE4_2", mkl_sqrt.SSE),
}


def _host_features() -> list[str]:
    return llvm.get_host_cpu_features().flatten().split(",")


def _without_avx512() -> str:
    """The host's features as LLVM names them, every AVX-512 one turned off."""
    return ",".join(("-" + f[1:]) if f[1:].startswith("avx512") else f for f in _host_features())


def _playing(host: str, cache: Path) -> dict[str, str]:
    return {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "NUMBA_CPU_NAME": "haswell",
            "NUMBA_CPU_FEATURES": _without_avx512(), "NUMBA_CACHE_DIR": str(cache),
            "MKL_ENABLE_INSTRUCTIONS": HOSTS[host][0]}


@pytest.fixture(scope="module")
def numba_cache(tmp_path_factory) -> Path:
    """One Numba cache for every played host: they compile for the same CPU."""
    return tmp_path_factory.mktemp("numba")


@pytest.mark.slow
@pytest.mark.parametrize("host", HOSTS)
def test_the_paths_of_another_host_equal_torch(host, numba_cache):
    if not {"+avx2", "+fma"} <= set(_host_features()):
        pytest.skip("this CPU has no AVX2 and FMA to compile the played host's code for")
    instructions, root = HOSTS[host]
    env = _playing(host, numba_cache)
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from gradtap.updater.intrinsics import has_feature; "
                               "from gradtap.updater.selfcheck import mkl_roots; "
                               "print(torch.backends.cpu.get_cpu_capability(), has_feature('avx512f'), "
                               "has_feature('avx2'), *mkl_roots())"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.split()[:3] == ["AVX2", "False", "True"], probe.stdout + probe.stderr
    if mkl_runs_here(instructions)[0] != root:
        pytest.skip(f"MKL on this CPU does not run {mkl_sqrt.KERNELS[root].symbol} under "
                    f"MKL_ENABLE_INSTRUCTIONS={instructions}")
    assert probe.stdout.split()[3:] == [root], probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/updater/test_mkl_sqrt.py", "tests/updater/test_kernels.py", "tests/updater/test_selfcheck.py",
         "-k", f"({root} or ieee or torch_root_path or not_this_hosts or test_selfcheck) and not fresh_process"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1]
    assert " passed" in summary, run.stdout[-2000:]
    assert f"not MKL's {mkl_sqrt.KERNELS[root].symbol}" not in run.stdout, run.stdout[-2000:]
