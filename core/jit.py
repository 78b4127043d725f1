"""Numba options, the kernel cache, and the target features kernels may use, in one place.

Every kernel in gradtap is decorated with ``njit(**JIT)`` or ``njit(**JIT_PARALLEL)``; no
kernel writes its own option literals. Tests can run the whole suite with
``NUMBA_DISABLE_JIT=1`` (coverage) or ``NUMBA_BOUNDSCHECK=1`` (safety): Numba reads those
environment variables itself, so nothing here overrides them. ``GRADTAP_JIT_CACHE=0`` turns
the on-disk cache off (a run that must compile everything afresh, e.g. under
``NUMBA_BOUNDSCHECK``).

**The cache.** ``cache=True`` keeps compiled kernels across processes (CLI start-up, pipeline
workers). Numba itself checks a cached kernel only against the file that defines it, yet a
kernel also holds machine code of the functions it calls or inlines and the values of the
module constants it reads, many of them in other files (``wire/headers``, ``core/bytes.py``):
after an edit there, Numba would load the old code. So every gradtap kernel is cached through
:class:`SourceTreeLocator`, registered here before any kernel is decorated. It keeps the
directory Numba would choose (``NUMBA_CACHE_DIR``, else ``__pycache__`` beside the source,
else the user's cache) and replaces Numba's freshness stamp by :func:`source_stamp`: a hash
of gradtap's version, Numba's version and the source of the kernel's module and of every
gradtap module it imports, transitively. An edit anywhere in that closure makes the index
stale, and the kernel is compiled again (and the index rewritten) on its next call.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
from functools import lru_cache

import numba
from llvmlite import binding as llvm_binding
from numba.core import caching

import gradtap

# fastmath stays off: the updater must be bit-exact with PyTorch and the parser exact
# with the wire.
JIT = dict(cache=os.environ.get("GRADTAP_JIT_CACHE", "1") == "1", nogil=True, fastmath=False)
JIT_PARALLEL = dict(JIT, parallel=True)
# Per-frame kernels that allocate nothing run without Numba's reference counting (NRT). With
# it, every call between compiled functions increments and then decrements the count of
# each array it passes, every array of a tuple argument included, each an atomic
# (``lock``-prefixed) instruction: about 40 per frame in the stage-2 parser (counted with
# ``NUMBA_DEBUG_NRT``), which took a one-stream parse from 0.197 to 0.27 s. Such a kernel
# cannot allocate (Numba refuses to compile one that does) and keeps no array past its
# return. Numba's own hot helpers do the same (``numba/cpython/unicode.py``:
# ``register_jitable(_nrt=False)``, "Disable RefCt for performance").
JIT_NO_REFCOUNT = dict(JIT, _nrt=False)


@lru_cache(maxsize=None)
def has_feature(name: str) -> bool:
    """Whether the kernels Numba compiles here may use the target feature ``name`` (LLVM's
    spelling: ``"avx512f"``, ``"sse"``): the features ``NUMBA_CPU_FEATURES`` names when it is
    set (Numba then compiles for them, e.g. an AVX2 target on an AVX-512 host), else the host
    CPU's as LLVM sees them."""
    features = numba.config.CPU_FEATURES if numba.config.CPU_FEATURES is not None \
        else llvm_binding.get_host_cpu_features().flatten()
    return f"+{name}" in features.split(",")


PACKAGE = gradtap.__name__


def fit_threads() -> int:
    """Set the calling thread's Numba thread count (Numba keeps one per thread) to the cores
    it may run on, at most ``NUMBA_NUM_THREADS``, and return it: a thread pinned to fewer
    cores than the process had when Numba started would otherwise run each ``prange`` on a
    thread for every one of those cores, crowded onto its own."""
    n = min(numba.config.NUMBA_NUM_THREADS, len(os.sched_getaffinity(0)))
    numba.set_num_threads(n)
    return n


@lru_cache(maxsize=None)
def _spec(name: str):
    """The import spec of module ``name`` without importing it (only its parent packages,
    whose ``__init__`` files hold docstrings); ``None`` if ``name`` is not a module (a
    function or constant imported from one)."""
    parent = name.rpartition(".")[0]
    if parent:
        outer = _spec(parent)
        if outer is None or outer.submodule_search_locations is None:
            return None
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


@lru_cache(maxsize=None)
def _read(path: str, mtime_ns: int, size: int) -> tuple[bytes, tuple[str, ...]]:
    """``(sha256 of the file, the gradtap modules it imports)``; keyed on the file's stat so
    that an edit while the process runs is seen."""
    with open(path, "rb") as f:
        source = f.read()
    names = set()
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    ours = sorted(n for n in names if n == PACKAGE or n.startswith(PACKAGE + "."))
    return hashlib.sha256(source).digest(), tuple(ours)


def _module_files(py_file: str) -> dict[str, bytes]:
    """Source file -> content hash, for ``py_file`` and every gradtap module it imports,
    transitively."""
    seen: dict[str, bytes] = {}
    todo = [os.path.abspath(py_file)]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        st = os.stat(path)
        seen[path], imported = _read(path, st.st_mtime_ns, st.st_size)
        for name in imported:
            spec = _spec(name)
            if spec is not None and spec.origin and spec.origin.endswith(".py"):
                todo.append(os.path.abspath(spec.origin))
    return seen


def source_stamp(py_file: str) -> str:
    """The freshness stamp of the kernels defined in ``py_file`` (hex sha256; see the module
    docstring)."""
    h = hashlib.sha256(f"{PACKAGE} {gradtap.__version__} numba {numba.__version__}".encode())
    for path, digest in sorted(_module_files(py_file).items()):
        h.update(path.encode() + b"\0" + digest)
    return h.hexdigest()


_CacheImpl = getattr(caching, "CacheImpl", None) or caching._CacheImpl   # the older name


class SourceTreeLocator(caching._CacheLocator):
    """Numba's own choice of cache directory for a gradtap function, with the freshness stamp
    of :func:`source_stamp`. Functions outside gradtap are left to Numba's locators."""

    def __init__(self, inner, py_file: str):
        self._inner, self._py_file = inner, py_file

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    def get_source_stamp(self):
        return source_stamp(self._py_file)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not (py_func.__module__ or "").startswith(PACKAGE + "."):
            return None
        for numba_locator in _CacheImpl._locator_classes:
            if numba_locator is cls:
                continue
            inner = numba_locator.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner, py_file)
        return None


if SourceTreeLocator not in _CacheImpl._locator_classes:
    _CacheImpl._locator_classes.insert(0, SourceTreeLocator)
