"""The environment that makes this host run the paths of another kind of x86-64 host.

What runs is chosen in three places, each from the CPU: torch's ATen kernels (AVX-512 or AVX2
builds; ``ATEN_CPU_CAPABILITY`` caps it), Numba's code (``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES``, which ``gradtap.core.jit.has_feature`` reads too) and MKL's
kernels behind ``torch.sqrt`` (``MKL_ENABLE_INSTRUCTIONS``, honoured on Intel CPUs; see
``updater/mkl_sqrt.py``). ``tests/updater/test_other_hosts.py`` and ``benchmarks.adam --play``
run in it. The instruction paths are the played host's; the memory system stays this one's.
"""

from __future__ import annotations

import os
from typing import Callable

from llvmlite import binding as llvm

#: played host -> MKL_ENABLE_INSTRUCTIONS
PLAYED = {
    "intel-avx2": "AVX2",   # an Intel CPU with AVX2 and FMA, no AVX-512: MKL's AVX2 root
    "mkl-sse": "SSE4_2",    # a CPU on which MKL runs its SSE root (the AMD EPYC this project met)
}


def host_features() -> list[str]:
    """This CPU's features as LLVM names them (``+avx2``, ``-avx512f``, ...)."""
    return llvm.get_host_cpu_features().flatten().split(",")


def features_without(drop: Callable[[str], bool]) -> str:
    """This CPU's features for ``NUMBA_CPU_FEATURES``, with each one ``drop(name)`` (LLVM's name,
    no sign) is true of turned off."""
    return ",".join(("-" + f[1:]) if drop(f[1:]) else f for f in host_features())


def can_play() -> str | None:
    """Why this host cannot play the others (``None`` when it can): it needs AVX2 and FMA."""
    if not {"+avx2", "+fma"} <= set(host_features()):
        return "this CPU has no AVX2 and FMA to compile the played host's code for"
    return None


def played_env(host: str, numba_cache: str) -> dict[str, str]:
    """``os.environ`` with the variables that make a new process play ``host`` (one of
    :data:`PLAYED`), its Numba cache in ``numba_cache`` (code for another CPU)."""
    without_avx512 = features_without(lambda f: f.startswith("avx512"))
    return {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "NUMBA_CPU_NAME": "haswell",
            "NUMBA_CPU_FEATURES": without_avx512, "NUMBA_CACHE_DIR": numba_cache,
            "MKL_ENABLE_INSTRUCTIONS": PLAYED[host]}
