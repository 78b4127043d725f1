"""Numba options, in one place.

Every kernel in gradtap is decorated with ``njit(**JIT)`` or ``njit(**JIT_PARALLEL)``; no
kernel writes its own option literals. Tests can run the whole suite with
``NUMBA_DISABLE_JIT=1`` (coverage) or ``NUMBA_BOUNDSCHECK=1`` (safety): Numba reads those
environment variables itself, so nothing here overrides them.
"""

import os

# cache=True keeps compiled kernels across processes (CLI start-up, pipeline workers).
# fastmath stays off: the updater must be bit-exact with PyTorch and the parser exact
# with the wire.
JIT = dict(cache=os.environ.get("GRADTAP_JIT_CACHE", "1") == "1", nogil=True, fastmath=False)
JIT_PARALLEL = dict(JIT, parallel=True)
